"""The checkpoint file: HDF5 layout, checksum, atomic file steps, reading and verification.

No MPI here: rank 0 calls this module and broadcasts what it reads.

File ``<run_dir>/checkpoints/ckpt-<step:08d>.h5``:

- root attributes ``format``, ``format_version`` and ``checksum`` (``sha256:<hex>``);
- ``manifest``: JSON text with the step, a unique id, the id of the checkpoint its run continued
  from (lineage, for people), the retention record (metric values of the kept checkpoints)
  and the list of arrays (name, dtype, shape) in order;
- ``meta``: the caller's JSON-able meta, verbatim;
- ``arrays/<name>``: one dataset per array (a name such as ``opt/m`` makes a group).

The checksum covers the manifest and meta bytes and every array's raw bytes, each length-prefixed.

The write protocol that uses these steps lives in ``manager.py``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.base.version import __version__
from hpc_rlx.checkpoint.graph_match import check_frozen, different_graph
from hpc_rlx.base.errors import CheckpointError

FORMAT = "hpc_rlx-checkpoint"
FORMAT_VERSION = 1
POINTER = "latest"
BEST_POINTER = "best"

CKPT_RE = re.compile(r"ckpt-(\d{8,})\.h5")
# only temporaries this module creates; retention and cleanup never touch any other name
TMP_RE = re.compile(r"\.(?:ckpt-\d{8,}\.h5|latest|best)\.tmp-[0-9a-f]{12}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_BLOCK_BYTES = 64 << 20  # verification streams large arrays in blocks of this size
SLACK_BYTES = 1 << 20  # HDF5 metadata on top of the raw array bytes
_DTYPE_KINDS = {"b": 1, "i": 8, "u": 8, "f": 8, "c": 16}  # kind -> largest itemsize stored

Warn = Callable[[str], None]


def warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.h5"


def checkpoints_dir(run_dir) -> Path:
    """Where a run keeps its checkpoints: ``<run_dir>/checkpoints``."""
    return Path(run_dir) / names.CHECKPOINTS


@dataclass
class CheckpointState:
    """Everything needed to continue training.

    arrays: flat NumPy arrays by name ("params", "opt/<name>", "policy/<name>", "rng/<name>", ...).
    meta: JSON-able dict (epoch, step, shard positions, metric history, world_size,
        graph_fingerprint, config_yaml, ...); dict keys must be strings.
    path, info: filled by `read_checkpoint` (the file and its manifest); ignored by `save`.
    """

    arrays: dict[str, np.ndarray]
    meta: dict
    path: Path | None = None
    info: dict = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.info.get("step")


# ---------------------------------------------------------------- validation of what is saved

def normalise_meta(value, where: str = "meta"):
    """A JSON-exact copy of `value`: tuples become lists, NumPy scalars Python numbers."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"checkpoint {where} has key {key!r} of type {type(key).__name__}; "
                                f"meta keys must be strings (JSON would silently turn them into text)")
            out[key] = normalise_meta(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [normalise_meta(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"checkpoint {where} is a {type(value).__name__}; meta must be JSON-able "
                    f"(dict, list, str, int, float, bool, None): put arrays in CheckpointState.arrays")


def check_arrays(arrays) -> dict[str, np.ndarray]:
    if not isinstance(arrays, dict):
        raise TypeError(f"CheckpointState.arrays must be a dict of NumPy arrays, got {type(arrays).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        segments = name.split("/") if isinstance(name, str) else [None]
        if not all(isinstance(s, str) and _SEGMENT_RE.fullmatch(s) for s in segments):
            raise ValueError(f"checkpoint array name {name!r} is invalid: use '/'-separated parts "
                             f"of letters, digits, '_', '-' and '.', not starting with '.' or '-'")
        if not isinstance(a, np.ndarray):
            raise TypeError(f"checkpoint array {name!r} is a {type(a).__module__}.{type(a).__name__}, "
                            f"not a NumPy array; copy device arrays to the host first")
        limit = _DTYPE_KINDS.get(a.dtype.kind)
        if limit is None or a.dtype.itemsize > limit:
            raise TypeError(f"checkpoint array {name!r} has dtype {a.dtype}; only bool, integer, "
                            f"float (up to 64-bit) and complex (up to 128-bit) arrays are stored")
        out[name] = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    for name in out:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in out:
                raise ValueError(f"checkpoint array names {'/'.join(parts[:i])!r} and {name!r} clash: "
                                 f"one would be a group holding the other")
    return out


# ---------------------------------------------------------------- checksum

def raw_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def feed(h, data) -> None:
    h.update(memoryview(data).nbytes.to_bytes(8, "little"))
    h.update(data)


def checksum(manifest: bytes, meta: bytes, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    feed(h, manifest)
    feed(h, meta)
    for a in arrays.values():
        feed(h, raw_bytes(a))
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------- low-level file steps
# Module-level so tests can interrupt the protocol between any two of them.

class GuardedFile:
    """The file HDF5 writes through (h5py's file-object driver), holding back write errors.

    HDF5 2.0 can crash the process when a write fails inside a flush (seen with a full disk and
    with RLIMIT_FSIZE). Here a failed write is recorded and later ones are skipped, so HDF5 always
    sees success; `raise_recorded` then reports the first error and the caller discards the file.
    """

    def __init__(self, path: Path):
        self._f = open(path, "w+b", buffering=0)
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    n = self._f.write(view[done:])
                    if not n:
                        raise OSError(errno.ENOSPC, "write made no progress")
                    done += n
            except OSError as e:
                self.error = e
        return len(view)

    def truncate(self, size=None) -> int:
        if self.error is None:
            try:
                return self._f.truncate(size)
            except OSError as e:
                self.error = e
        return size if size is not None else self._f.tell()

    def seek(self, *args) -> int:
        return self._f.seek(*args)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, size: int = -1) -> bytes:
        return self._f.read(size)

    def readinto(self, buffer) -> int:
        return self._f.readinto(buffer)

    def flush(self) -> None:
        pass  # unbuffered; durability comes from the fsync that follows

    def raise_recorded(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._f.close()


def write_header(f: h5py.File, manifest: bytes, meta: bytes) -> h5py.Group:
    """The format attributes, manifest and meta of a new file; returns its empty ``arrays``
    group. The checksum attribute is the caller's: known before the arrays are written
    (``write_h5``) or only after they are read back (``staged_file``)."""
    text = h5py.string_dtype("utf-8")
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = FORMAT_VERSION
    f.create_dataset("manifest", data=manifest.decode("utf-8"), dtype=text)
    f.create_dataset("meta", data=meta.decode("utf-8"), dtype=text)
    return f.create_group("arrays")


def write_h5(path: Path, manifest: bytes, meta: bytes, arrays: dict[str, np.ndarray],
              checksum: str) -> None:
    guarded = GuardedFile(path)
    try:
        f = h5py.File(guarded, "w")
        try:
            group = write_header(f, manifest, meta)
            f.attrs["checksum"] = checksum
            for name, a in arrays.items():
                group.create_dataset(name, data=a)
            f.flush()
        finally:
            f.close()
        guarded.raise_recorded()
    finally:
        guarded.close()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename durable; some network filesystems refuse fsync on directories."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def replace_file(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def temp_name(final: Path) -> Path:
    return final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = temp_name(path)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        replace_file(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(path.parent)


# ---------------------------------------------------------------- reading and verifying

def _read_text(f: h5py.File, name: str) -> bytes:
    raw = f[name][()]
    return raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)


def read_array(ds) -> np.ndarray:
    if ds.shape == ():
        return np.asarray(ds[()], dtype=ds.dtype)
    out = np.empty(ds.shape, dtype=ds.dtype)
    if out.size:
        ds.read_direct(out)
    return out


def _hash_dataset(h, ds, nbytes: int) -> None:
    """Feed a dataset into the checksum without holding all of a large one in memory."""
    h.update(nbytes.to_bytes(8, "little"))
    if ds.ndim == 0 or nbytes <= _BLOCK_BYTES:
        h.update(raw_bytes(read_array(ds)))
        return
    rows = max(1, _BLOCK_BYTES // max(1, nbytes // ds.shape[0]))
    for start in range(0, ds.shape[0], rows):
        h.update(raw_bytes(np.ascontiguousarray(ds[start:start + rows])))


def _read(path, keep_arrays: bool) -> tuple[dict, bytes, dict[str, np.ndarray]]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"checkpoint {path} is not an HDF5 file (empty, partial or overwritten)")
    try:
        with h5py.File(path, "r", locking=False) as f:
            fmt = f.attrs.get("format")
            if fmt != FORMAT:
                raise CheckpointError(f"{path} is not an hpc_rlx checkpoint (format attribute {fmt!r})")
            version = int(f.attrs.get("format_version", -1))
            if version != FORMAT_VERSION:
                raise CheckpointError(f"checkpoint {path} has format version {version}; this hpc_rlx "
                                      f"{__version__} reads version {FORMAT_VERSION}")
            stored = str(f.attrs["checksum"])
            manifest_bytes, meta_bytes = _read_text(f, "manifest"), _read_text(f, "meta")
            h = hashlib.sha256()
            feed(h, manifest_bytes)
            feed(h, meta_bytes)
            manifest = json.loads(manifest_bytes)
            arrays: dict[str, np.ndarray] = {}
            for name, dtype, shape in manifest["arrays"]:
                ds = f["arrays"][name]
                if ds.dtype.str != dtype or list(ds.shape) != list(shape):
                    raise CheckpointError(
                        f"checkpoint {path}: array {name!r} is {ds.dtype.str}{list(ds.shape)} in the "
                        f"file but {dtype}{list(shape)} in its manifest; the file is corrupt")
                if keep_arrays:
                    arrays[name] = a = read_array(ds)
                    feed(h, raw_bytes(a))
                else:
                    _hash_dataset(h, ds, int(np.prod(shape, dtype=np.int64)) * ds.dtype.itemsize)
    except CheckpointError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable (partial write or corrupt file): {e}") from e
    computed = "sha256:" + h.hexdigest()
    if computed != stored:
        raise CheckpointError(f"checkpoint {path} failed its checksum (stored {stored[:20]}..., "
                              f"computed {computed[:20]}...): the file is corrupt")
    return manifest, meta_bytes, arrays


def _info(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "arrays"}


def read_checkpoint(path, arrays: bool = True) -> CheckpointState:
    """Load a checkpoint after verifying its checksum; CheckpointError naming the file if it is
    missing, not HDF5, partial, corrupt or of another format version. arrays=False: verify it
    without keeping its arrays (``info["arrays"]`` lists them; read slices from the file)."""
    manifest, meta_bytes, kept = _read(path, keep_arrays=arrays)
    try:
        meta = json.loads(meta_bytes)
    except ValueError as e:  # unreachable unless the checksum collides; keep the message clear anyway
        raise CheckpointError(f"checkpoint {path} has unreadable meta: {e}") from e
    info = _info(manifest) if arrays else dict(_info(manifest), arrays=manifest["arrays"])
    return CheckpointState(arrays=kept, meta=meta, path=Path(path), info=info)


def read_meta(path) -> dict:
    """A checkpoint's meta without reading or verifying its arrays: cheap, for telling which
    run a checkpoint belongs to, never for resuming (that is `read_checkpoint`)."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not an hpc_rlx checkpoint")
            meta = json.loads(_read_text(f, "meta"))
    except CheckpointError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path} has no meta record")
    return meta


def verify_checkpoint(path) -> dict:
    """Check a checkpoint end to end without keeping its arrays; returns its manifest info."""
    return _info(_read(path, keep_arrays=False)[0])


def check_compatible(state: CheckpointState, graph_fingerprint: str, frozen: dict | None = None) -> None:
    """Refuse a checkpoint written for another model graph (the world size may differ), or with
    other frozen parameters than `frozen` (`graph_match.frozen_record`; None: not checked)."""
    where = state.path if state.path is not None else "(in memory)"
    if frozen is not None and isinstance(state.meta, dict):
        check_frozen(str(where), state.meta, frozen)
    have = state.meta.get("graph_fingerprint") if isinstance(state.meta, dict) else None
    if have is None:
        raise CheckpointError(f"checkpoint {where} records no model graph fingerprint, so it cannot "
                              f"be matched to the current model (fingerprint {graph_fingerprint})")
    if have != graph_fingerprint:
        raise different_graph(f"checkpoint {where}", "checkpoint", have, graph_fingerprint, "resume")
