"""Reading and validating HDF5 training data (no MPI).

A dataset file holds two row-aligned datasets, inputs ``x`` (N, *sample_shape) and targets
``y`` (N, *label_shape); row i of both is sample i. Everything here reports user-fixable problems
as :class:`~hpc_rlx.base.errors.DataError` with the path, the dataset names and the offending values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from hpc_rlx.base.errors import DataError

__all__ = ["DatasetInfo", "describe", "check_compatible", "read_rows", "check_values", "open_readonly",
           "guess_dataset_names"]

# check_values scans inputs in blocks of about this many elements, so a multi-GB shard never
# needs a same-sized boolean temporary
_SCAN_ELEMS = 1 << 22
# read_rows casts through a buffer of about this many bytes
_CAST_BYTES = 16 << 20


@dataclass(frozen=True)
class DatasetInfo:
    path: str
    n: int
    x_shape: tuple[int, ...]  # per sample
    x_dtype: np.dtype
    y_shape: tuple[int, ...]  # per sample
    y_dtype: np.dtype
    attrs: dict[str, Any] = field(default_factory=dict)
    x_name: str = "x"
    y_name: str = "y"
    y_attrs: dict[str, Any] = field(default_factory=dict)  # the label dataset's own attributes
    files: Any = None    # many files as one: their FileSet (data/files.py describe_set)


def _plain(v):
    """HDF5 attribute value -> plain Python value (str, int, float, list)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, np.ndarray):
        return [_plain(e) for e in v.tolist()] if v.dtype.kind in "OS" else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _list_datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def open_dataset_file(path) -> h5py.File:
    """Open a dataset file for reading; a DataError that says what is wrong with it otherwise."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"dataset file {path!r} does not exist")
    if os.path.isdir(path):
        raise DataError(f"dataset path {path!r} is a directory, not an HDF5 file")
    try:
        is_h5 = h5py.is_hdf5(path)
    except OSError as e:
        raise DataError(f"cannot read dataset file {path!r}: {e}") from None
    if not is_h5:
        raise DataError(f"dataset file {path!r} is not an HDF5 file")
    try:
        return open_readonly(path)
    except OSError as e:
        raise DataError(f"cannot open HDF5 file {path!r}: {e}") from None


def open_readonly(path) -> h5py.File:
    """Open for reading without HDF5's file lock.

    Locks fail on many cluster filesystems (NFS, some Lustre mounts), and are not needed here:
    datasets are written under a temporary name and renamed into place, so a reader never sees a
    file that is still being written.
    """
    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):  # HDF5 builds older than 1.12.1 have no locking switch
        return h5py.File(path, "r")


# Dataset names people use for inputs and labels (compared lower-case, without a _train/_val
# style suffix); a guess only, offered in the message when data.x / data.y are not in the file.
_INPUT_NAMES = {"x", "data", "input", "inputs", "features", "feature", "images", "image", "samples", "tokens"}
_LABEL_NAMES = {"y", "label", "labels", "target", "targets", "class", "classes", "labels_idx", "t"}


def _stem(name: str) -> str:
    base = name.rsplit("/", 1)[-1].lower()
    for suffix in ("_train", "_training", "_val", "_valid", "_test", "_all"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def guess_dataset_names(shapes: dict[str, tuple]) -> tuple[str, str] | None:
    """(input name, label name) among datasets {name: shape}, or None if it is not clear.

    By name first (data/label, features/targets, X_train/y_train, ...); else, of exactly two
    row-aligned datasets, the one with one value per row is the label."""
    rows = {n: s for n, s in shapes.items() if len(s) >= 1}
    xs = [n for n in rows if _stem(n) in _INPUT_NAMES]
    ys = [n for n in rows if _stem(n) in _LABEL_NAMES]
    if len(xs) == 1 and len(ys) == 1 and rows[xs[0]][0] == rows[ys[0]][0]:
        return xs[0], ys[0]
    if len(rows) == 2:
        (a, sa), (b, sb) = rows.items()
        if sa[0] == sb[0] and (len(sa) == 1) != (len(sb) == 1):
            return (b, a) if len(sa) == 1 else (a, b)
    return None


def _check_names(f: h5py.File, path: str, x_name: str, y_name: str) -> None:
    """Both names at once: a file with other dataset names is one message naming the
    overrides that fit it, not one round trip per name."""
    missing = [(role, n) for role, n in (("input", x_name), ("label", y_name)) if f.get(n) is None]
    if not missing:
        return
    have = _list_datasets(f)
    what = " and ".join(f"no {role} dataset {n!r}" for role, n in missing)
    text = f"HDF5 file {path!r} has {what}; datasets in the file: {have if have else 'none'}"
    shapes = {n: tuple(f[n].shape or ()) for n in have}
    guess = guess_dataset_names(shapes)
    if guess:
        text += f"; use data.x={guess[0]} data.y={guess[1]}"
    elif have:
        text += "; name them with data.x=<inputs> data.y=<labels>"
    raise DataError(text)


def _get_dataset(f: h5py.File, path: str, name: str, role: str, scalar_ok: bool = False) -> h5py.Dataset:
    obj = f.get(name)
    if obj is None:
        have = _list_datasets(f)
        raise DataError(
            f"HDF5 file {path!r} has no {role} dataset {name!r}; datasets in the file: "
            f"{have if have else 'none'}"
        )
    if not isinstance(obj, h5py.Dataset):
        raise DataError(
            f"{role} {name!r} in HDF5 file {path!r} is a group, not a dataset; datasets in the "
            f"file: {_list_datasets(f)}"
        )
    if obj.shape is None or (len(obj.shape) == 0 and not scalar_ok):
        raise DataError(
            f"{role} dataset {name!r} in {path!r} is a scalar; it needs one row per sample (a file "
            f"that holds one sample without a sample axis: data.one_sample_per_file=true)"
        )
    return obj


def describe_open_file(f: h5py.File, path: str, x_name: str, y_name: str, one_sample: bool = False) -> DatasetInfo:
    """one_sample: the file holds one sample, without a sample axis (data.one_sample_per_file)."""
    _check_names(f, path, x_name, y_name)
    x = _get_dataset(f, path, x_name, "input", scalar_ok=one_sample)
    y = _get_dataset(f, path, y_name, "label", scalar_ok=one_sample)
    if one_sample:
        return DatasetInfo(path=path, n=1, x_shape=tuple(int(s) for s in x.shape), x_dtype=np.dtype(x.dtype),
                           y_shape=tuple(int(s) for s in y.shape), y_dtype=np.dtype(y.dtype),
                           attrs={k: _plain(v) for k, v in f.attrs.items()}, x_name=x_name, y_name=y_name,
                           y_attrs={k: _plain(v) for k, v in y.attrs.items()})
    for name, d in ((x_name, x), (y_name, y)):
        if d.shape[0] == 0:
            raise DataError(f"dataset {name!r} in {path!r} is empty (shape {d.shape})")
    if x.shape[0] != y.shape[0]:
        raise DataError(
            f"inputs {x_name!r} and labels {y_name!r} in {path!r} have different lengths: "
            f"{x.shape[0]} vs {y.shape[0]} rows"
        )
    attrs = {k: _plain(v) for k, v in f.attrs.items()}
    return DatasetInfo(
        path=path,
        n=int(x.shape[0]),
        x_shape=tuple(int(s) for s in x.shape[1:]),
        x_dtype=np.dtype(x.dtype),
        y_shape=tuple(int(s) for s in y.shape[1:]),
        y_dtype=np.dtype(y.dtype),
        attrs=attrs,
        x_name=x_name,
        y_name=y_name,
        y_attrs={k: _plain(v) for k, v in y.attrs.items()},
    )


def describe(path, x_name: str = "x", y_name: str = "y", one_sample: bool = False) -> DatasetInfo:
    """Shapes, dtypes, length and root attributes of a dataset file; reads no sample data."""
    path = os.fspath(path)
    with open_dataset_file(path) as f:
        return describe_open_file(f, path, x_name, y_name, one_sample)


_INPUT_KINDS = {"float": "fiub", "int": "iu"}  # integers feed float models (cast), not vice versa
_LABEL_KINDS = ("class", "float")


def check_compatible(
    info: DatasetInfo,
    input_shape,
    input_dtype_kind: str,
    label_kind: str,
    label_shape=(),
) -> None:
    """Check the file against what the model expects, per sample.

    ``input_shape``/``label_shape`` are per-sample shapes; a ``None`` or ``-1`` entry matches any
    size. ``input_dtype_kind`` is "float" (any numeric input is accepted and cast) or "int"
    (token ids: integer data only). ``label_kind`` is "class" (integer class indices) or "float".
    """
    if input_dtype_kind not in _INPUT_KINDS:
        raise ValueError(f"input_dtype_kind must be one of {sorted(_INPUT_KINDS)}, got {input_dtype_kind!r}")
    if label_kind not in _LABEL_KINDS:
        raise ValueError(f"label_kind must be one of {list(_LABEL_KINDS)}, got {label_kind!r}")
    where = f"dataset {info.path!r}"

    def _matches(have, want) -> bool:
        want = tuple(want)
        return len(have) == len(want) and all(w is None or w == -1 or h == w for h, w in zip(have, want))

    if not _matches(info.x_shape, input_shape):
        raise DataError(
            f"{where}: per-sample input shape of {info.x_name!r} is {info.x_shape}, but the model "
            f"expects {tuple(input_shape)}"
        )
    if info.x_dtype.kind not in _INPUT_KINDS[input_dtype_kind]:
        raise DataError(
            f"{where}: inputs {info.x_name!r} have dtype {info.x_dtype}, but the model needs "
            + ("integer token ids" if input_dtype_kind == "int" else "numeric inputs")
        )
    if label_kind == "class" and info.y_dtype.kind not in "iu":
        raise DataError(
            f"{where}: labels {info.y_name!r} have dtype {info.y_dtype}, but the loss needs integer "
            "class indices"
            + (" (float labels found; store them as int64)" if info.y_dtype.kind == "f" else "")
        )
    if label_kind == "float" and info.y_dtype.kind not in "fiub":
        raise DataError(f"{where}: labels {info.y_name!r} have non-numeric dtype {info.y_dtype}")
    if not _matches(info.y_shape, label_shape):
        raise DataError(
            f"{where}: per-sample label shape of {info.y_name!r} is {info.y_shape}, but the model "
            f"expects {tuple(label_shape)}"
        )


def _read_into(d: h5py.Dataset, start: int, stop: int, dtype=None) -> np.ndarray:
    # native byte order, so buffers from 'read' and 'scatter' modes agree and MPI can send them
    stored = d.dtype.newbyteorder("=")
    out = np.empty((stop - start,) + d.shape[1:], dtype=stored if dtype is None else dtype)
    if stop <= start:
        return out
    if out.dtype == stored:
        d.read_direct(out, source_sel=np.s_[start:stop])
        return out
    # a cast (float64 file, float32 run): through a bounded buffer, so the shard is never held
    # twice; NumPy's cast, the one the per-batch path of data.cache=stream uses
    block = max(1, _CAST_BYTES // max(1, stored.itemsize * int(np.prod(d.shape[1:], dtype=np.int64))))
    buf = np.empty((min(block, stop - start),) + d.shape[1:], dtype=stored)
    for a in range(start, stop, block):
        b = min(stop, a + block)
        d.read_direct(buf, source_sel=np.s_[a:b], dest_sel=np.s_[0:b - a])
        out[a - start:b - start] = buf[:b - a]
    return out


def read_rows(path, x_name: str, y_name: str, start: int, stop: int, x_dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of x and y; reads only that hyperslab from disk. ``x_dtype``:
    the type x is wanted in (cast block by block while reading), else as stored."""
    path = os.fspath(path)
    with open_dataset_file(path) as f:
        info = describe_open_file(f, path, x_name, y_name)
        if not (0 <= start <= stop <= info.n):
            raise DataError(
                f"row range [{start}, {stop}) is outside dataset {path!r} with {info.n} rows"
            )
        try:
            return _read_into(f[x_name], start, stop, x_dtype), _read_into(f[y_name], start, stop)
        except OSError as e:
            raise DataError(f"reading rows [{start}, {stop}) of {path!r} failed: {e}") from None


def _blocks(a: np.ndarray):
    """(first row, rows) blocks of about _SCAN_ELEMS elements: checks never allocate a
    shard-sized temporary."""
    per_row = max(1, int(np.prod(a.shape[1:], dtype=np.int64)))
    block = max(1, _SCAN_ELEMS // per_row)
    for s in range(0, len(a), block):
        yield s, a[s:s + block]


@dataclass(frozen=True)
class TokenVocab:
    """The ids a token input may hold: [0, size), the rows of the embedding table `table`; in
    `columns` [a, b) of the packed rows only, for one of several inputs (data/model_inputs.py)."""
    size: int
    table: str | None = None
    columns: tuple | None = None

    def out_of_range(self, token: int, row: int) -> str:
        where = f" of the embedding '{self.table}'" if self.table else ""
        return (f"input token id {token} at row {row} is outside the vocabulary [0, {self.size}){where}: "
                "the data was tokenized for another vocabulary than the model's")


def check_values(x: np.ndarray, y: np.ndarray, num_classes, check_finite: bool, first_row: int = 0,
                 vocab: TokenVocab | None = None) -> None:
    """Reject out-of-range class labels, (optionally) non-finite inputs and, with ``vocab``,
    integer inputs outside its range (token ids that index an embedding).

    ``first_row`` is the global index of row 0 of this shard, so messages name the row in the
    file. ``num_classes=None`` skips the label check (regression targets). ``vocab`` may be a
    list: one per packed input that indexes an embedding.
    """
    if num_classes is not None and y.size:
        _check_labels(y, num_classes, first_row)
    for v in (vocab if isinstance(vocab, list) else [] if vocab is None else [vocab]):
        _check_ids(x if v.columns is None else x[:, v.columns[0]:v.columns[1]], v, first_row)
    if check_finite and x.dtype.kind == "f" and x.size:
        for s, xb in _blocks(x):
            ok = np.isfinite(xb).reshape(len(xb), -1).all(axis=1)
            if not ok.all():
                r = s + int(np.argmin(ok))
                bad_vals = x[r][~np.isfinite(x[r])]
                raise DataError(
                    f"input row {first_row + r} contains a non-finite value ({bad_vals.flat[0]}); "
                    "drop or repair that row in the file (a NaN or Inf input makes the loss NaN)"
                )


def _check_ids(x: np.ndarray, vocab: TokenVocab, first_row: int) -> None:
    if x.dtype.kind in "iu" and x.size:
        for s, xb in _blocks(x):
            bad = (xb < 0) | (xb >= vocab.size)
            if bad.any():
                row = int(np.flatnonzero(bad.reshape(len(xb), -1).any(axis=1))[0])
                raise DataError(vocab.out_of_range(int(xb[row][bad[row]].flat[0]), first_row + s + row))


class Classes(int):
    """The number of classes a label indexes, and the label exempt from the range
    (`model.ignore_index`, which may lie outside it: 255, -100), or None."""

    def __new__(cls, n: int, ignore: int | None = None):
        out = super().__new__(cls, n)
        out.ignore = ignore
        return out


def _check_labels(y: np.ndarray, num_classes: int, first_row: int) -> None:
    per_row = max(1, int(np.prod(y.shape[1:], dtype=np.int64)))
    first = None
    count = 0
    ignore = getattr(num_classes, "ignore", None)
    for s, yb in _blocks(y):
        bad = (yb < 0) | (yb >= num_classes)
        if ignore is not None:
            bad &= yb != ignore
        n = int(np.count_nonzero(bad))
        if n and first is None:
            flat = int(np.flatnonzero(bad.reshape(-1))[0])
            first = (s * per_row + flat, yb.reshape(-1)[flat].item())
        count += n
    if first is None:
        return
    flat, value = first
    row, col = divmod(flat, per_row)
    pos = f"row {first_row + row}"
    if y.ndim > 1:
        pos += f" (position {tuple(int(i) for i in np.unravel_index(col, y.shape[1:]))})"
    raise DataError(
        f"label {value} at {pos} is outside [0, {num_classes}) for num_classes={num_classes}"
        f"{'' if ignore is None else f' (model.ignore_index={ignore} is exempt)'}; "
        f"{count} bad label(s) in rows [{first_row}, {first_row + len(y)})"
    )
