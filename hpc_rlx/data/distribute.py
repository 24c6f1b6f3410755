"""Getting each rank its rows of the dataset: the only MPI code in ``hpc_rlx.data``.

Two modes, same result:

- ``"read"``: every rank opens the file (shared filesystem) and reads only its own hyperslab;
- ``"scatter"``: rank 0 alone opens the file and hands every rank its rows with buffer
  ``Scatterv`` (no pickling), x and y separately, in rounds bounded in bytes and below the
  32-bit count/displacement limit of MPI.

Failures never leave ranks waiting in a collective: each possible failure point is followed by
a small pickled ``bcast``/``allgather`` of the status, and then every rank raises the same
:class:`~hpc_rlx.base.errors.DataError`. This is ``comm.collective.agree`` specialised for reading:
the message names the failing rank's host and, when the file is missing on some ranks only,
says the path is not on a shared filesystem. Every collective here runs under the stall
watchdog (``watched_call``), like the training loop's.
"""

from __future__ import annotations

import math
import socket
from typing import Sequence

import numpy as np

from hpc_rlx.comm.collective import watched_call
from hpc_rlx.data.files import Meta, meta_of
from hpc_rlx.data.set_reader import SetReader, read_set
from hpc_rlx.data.fileset import FileSet
from hpc_rlx.data.hdf5 import describe
from hpc_rlx.base.errors import ConfigError, DataError, HpcRlxError

__all__ = ["MODES", "load_shard", "round_rows"]

MODES = ("read", "scatter")

# MPI counts and displacements are C ints (counted in elements of the datatype)
_INT_MAX = 2**31 - 1
# rank 0's send buffers per round (x and y together)
_CHUNK_BYTES = 16 << 20     # under MPICH's ~32 MiB slowdown for one large message


def _message(exc: BaseException) -> str:
    if isinstance(exc, HpcRlxError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _raise_if_failed(statuses: Sequence[str | None], what: str, hosts: Sequence[str] | None = None,
                     hint: str = "") -> None:
    """Same DataError on every rank, from the same gathered statuses (and, when gathered, the
    hosts the ranks run on, so the message says where the failure happened)."""
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return
    r, msg = failed[0]
    on = f" on {hosts[r]}" if hosts else ""
    more = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
    raise DataError(f"{what} failed on rank {r}{on}{more}: {msg}{hint}")


def _host() -> str:
    return socket.gethostname().split(".")[0]


_NOT_SHARED_HINT = ("; with data.distribution=read every rank opens the file at this path, so it must "
                    "be on a filesystem every node sees: without one, use data.distribution=scatter "
                    "(rank 0 reads the file and sends each rank its rows)")


def _check_bounds(bounds, size: int) -> list[tuple[int, int]]:
    if len(bounds) != size:
        raise ValueError(f"load_shard needs one (start, stop) per rank: {len(bounds)} bounds for {size} ranks")
    out = []
    for r, (a, b) in enumerate(bounds):
        a, b = int(a), int(b)
        if not 0 <= a <= b:
            raise ValueError(f"rank {r} has a bad row range [{a}, {b})")
        out.append((a, b))
    return out


def round_rows(size: int, row_bytes: int, row_elems: int, chunk_bytes: int, int_max: int = _INT_MAX) -> int:
    """Rows per rank per scatter round.

    Bounded so that rank 0's send buffer stays under ``chunk_bytes`` and every count and
    displacement (all ranks' rows of a round, in elements) fits in a C int.
    """
    by_mem = chunk_bytes // max(1, size * row_bytes)
    by_int = int_max // max(1, size * row_elems)
    if by_int < 1:
        raise DataError(
            f"one sample has {row_elems} elements: {size} ranks' samples do not fit one MPI "
            f"count ({int_max}); use mode 'read'"
        )
    return max(1, min(by_mem, by_int))


def load_shard(comm, mode: str, path, x_name: str, y_name: str, bounds, *, chunk_bytes: int = _CHUNK_BYTES,
               x_dtype=None, expect: tuple[Meta, str] | None = None):
    """This rank's rows ``bounds[comm.rank]`` of x and y, as native-order NumPy arrays.

    ``path``: one file, or a :class:`FileSet` (many files as one; a rank opens only the files
    of its rows, and checks each against ``expect``: the (Meta, file) every file must match,
    which a FileSet needs).

    ``bounds`` holds one ``(start, stop)`` per rank (identical on every rank); empty ranges are
    fine. ``x_dtype``: the type x is wanted in (a float cast, done while reading, so no rank
    holds its shard twice), else x as stored. Collective: every rank of ``comm`` must call it
    with the same arguments.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown data distribution mode {mode!r}; choose one of {list(MODES)}")
    bounds = _check_bounds(bounds, comm.Get_size())
    if mode == "read":
        return _load_read(comm, path, x_name, y_name, bounds, x_dtype, expect)
    return _load_scatter(comm, path, x_name, y_name, bounds, chunk_bytes, x_dtype, expect)


def _check_numeric(path, name: str, dtype: np.dtype) -> None:
    # MPI buffers and the executors need plain numbers; both modes reject the same files
    if dtype.kind not in "biuf":
        raise DataError(f"dataset {name!r} in {path!r} has non-numeric dtype {dtype}")


def _as_set(path, x_name: str, y_name: str, expect) -> tuple[FileSet, Meta, str]:
    """(the set, the Meta its files must match, the file that Meta came from); one file is
    described here (every reading rank opens it anyway)."""
    if isinstance(path, FileSet):
        if expect is None:
            raise ValueError("load_shard over a FileSet needs expect=(Meta, file)")
        files, (ref, ref_path) = path, expect
    else:
        info = describe(path, x_name, y_name)
        files, ref, ref_path = FileSet.single(path, info.n), meta_of(info), str(path)
    _check_numeric(ref_path, x_name, ref.x_dtype)
    _check_numeric(ref_path, y_name, ref.y_dtype)
    return files, ref, ref_path


def _label(path) -> str:
    if not isinstance(path, FileSet):
        return str(path)
    return path.paths[0] if len(path) == 1 else f"{path.paths[0]} ... ({len(path)} files)"


def _load_read(comm, path, x_name, y_name, bounds, x_dtype=None, expect=None):
    status = None
    x = y = None
    try:
        files, ref, ref_path = _as_set(path, x_name, y_name, expect)
        x, y = read_set(files, x_name, y_name, *bounds[comm.Get_rank()], ref, ref_path, x_dtype=x_dtype)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        status = (_message(e), isinstance(e, FileNotFoundError) or "does not exist" in str(e))
    gathered = watched_call("data: read status (allgather)", comm.allgather, (status, _host()))
    statuses = [st[0] if st else None for st, _ in gathered]
    missing = [st is not None and st[1] for st, _ in gathered]
    # the file missing on some ranks only: the classic sign of a node-local path
    hint = _NOT_SHARED_HINT if any(missing) and not all(missing) else ""
    _raise_if_failed(statuses, f"reading {_label(path)!r}", [h for _, h in gathered], hint)
    return x, y


def _mpi_type(dtype: np.dtype):
    from mpi4py.util.dtlib import from_numpy_dtype

    return from_numpy_dtype(dtype)


def _load_scatter(comm, path, x_name, y_name, bounds, chunk_bytes, x_dtype=None, expect=None):
    where = f"scattering {_label(path)!r}"
    # 1. rank 0 checks the file and the ranges, and tells everyone the shapes
    (x_shape, x_dt, y_shape, y_dt), source = _scatter_description(comm, path, x_name, y_name, bounds, expect, where)
    if x_dtype is not None:
        x_dt = np.dtype(x_dtype)    # rank 0 casts while filling its send buffer
    lens = [b - a for a, b in bounds]
    # 2. every rank allocates; rank 0 also its reusable send buffers and the file handle
    cap, f, out, send = _scatter_buffers(comm, (x_shape, x_dt, y_shape, y_dt), lens, chunk_bytes, source,
                                         x_name, y_name, where)
    # 3. rounds: rank 0 reads, everyone hears whether it worked, then two Scatterv
    try:
        _scatter_rounds(comm, f, bounds, lens, cap, send, out, (math.prod(x_shape), math.prod(y_shape)), where)
    finally:
        if f is not None:
            f.close()
    return out


def _scatter_description(comm, path, x_name, y_name, bounds, expect, where):
    """((x shape, x dtype, y shape, y dtype), rank 0's (file set, reference, its path); None elsewhere)."""
    meta, status, source = None, None, None
    if comm.Get_rank() == 0:
        try:
            files, ref, ref_path = _as_set(path, x_name, y_name, expect)
            for r, (a, b) in enumerate(bounds):
                if b > files.n:
                    raise DataError(
                        f"rank {r}'s rows [{a}, {b}) are outside dataset {ref_path!r} with {files.n} rows"
                    )
            meta = (ref.x_shape, ref.x_dtype.str, ref.y_shape, ref.y_dtype.str)
            source = (files, ref, ref_path)
        except Exception as e:  # noqa: BLE001
            status = _message(e)
    status, meta = watched_call("data: rank 0's file description (bcast)", comm.bcast, (status, meta), root=0)
    _raise_if_failed([status], where)
    x_shape, x_dt, y_shape, y_dt = meta
    return (x_shape, np.dtype(x_dt), y_shape, np.dtype(y_dt)), source


def _scatter_buffers(comm, meta, lens, chunk_bytes, source, x_name, y_name, where):
    """(rows per round, rank 0's open file set, (out_x, out_y), rank 0's (send_x, send_y)),
    allocated on every rank before any reads; a failure anywhere fails all of them."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x_shape, x_dt, y_shape, y_dt = meta
    x_elems, y_elems = math.prod(x_shape), math.prod(y_shape)
    f = None
    out_x = out_y = send_x = send_y = None
    status = None
    try:
        cap = round_rows(
            size, x_dt.itemsize * x_elems + y_dt.itemsize * y_elems, max(x_elems, y_elems), chunk_bytes, _INT_MAX
        )
        out_x = np.empty((lens[rank],) + tuple(x_shape), dtype=x_dt)
        out_y = np.empty((lens[rank],) + tuple(y_shape), dtype=y_dt)
        if rank == 0:
            rows0 = sum(min(cap, n) for n in lens)  # round 0 is the largest
            send_x = np.empty((rows0,) + tuple(x_shape), dtype=x_dt)
            send_y = np.empty((rows0,) + tuple(y_shape), dtype=y_dt)
            f = SetReader(source[0], x_name, y_name, source[1], source[2])   # casts x while reading
    except Exception as e:  # noqa: BLE001
        status = _message(e)
    statuses = watched_call("data: receive buffers (allgather)", comm.allgather, status)
    if any(s is not None for s in statuses) and f is not None:
        f.close()
    _raise_if_failed(statuses, where)
    return cap, f, (out_x, out_y), (send_x, send_y)


def _scatter_rounds(comm, f, bounds, lens, cap, send, out, elems, where) -> None:
    """Rank 0 reads each round's rows of every rank; everyone hears whether it worked; then
    one Scatterv for x and one for y."""
    rank = comm.Get_rank()
    (send_x, send_y), (out_x, out_y) = send, out
    tx, ty = _mpi_type(out_x.dtype), _mpi_type(out_y.dtype)
    rounds = max((math.ceil(n / cap) for n in lens), default=0)
    for k in range(rounds):
        counts = [max(0, min(cap, n - k * cap)) for n in lens]
        offs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        status = None
        if rank == 0:
            try:
                for r, c in enumerate(counts):
                    if c:
                        a = bounds[r][0] + k * cap
                        f.read_range(a, a + c, send_x, send_y, at=int(offs[r]))
            except Exception as e:  # noqa: BLE001
                status = _message(e)
        _raise_if_failed([watched_call("data: rank 0's read (bcast)", comm.bcast, status, root=0)], where)

        lo, hi = k * cap, k * cap + counts[rank]
        for snd, dst, n_elems, mt in ((send_x, out_x, elems[0], tx), (send_y, out_y, elems[1], ty)):
            sendspec = None
            if rank == 0:
                sendspec = [
                    snd.reshape(-1),
                    [c * n_elems for c in counts],
                    [int(o) * n_elems for o in offs],
                    mt,
                ]
            watched_call("data: shard round (Scatterv)", comm.Scatterv, sendspec, [dst[lo:hi].reshape(-1), mt],
                         root=0)
