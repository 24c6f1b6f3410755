"""Convert the files users have (CSV, NumPy .npz) into the HDF5 layout hpc_rlx reads.

    python -m hpc_rlx.data convert iris.csv --label species_id --out data/iris.h5
    python -m hpc_rlx.data convert mnist.npz --label y_train --x x_train --out data/mnist.h5

The output holds ``x`` (N, ...) and ``y`` (N, ...), row-aligned, as chunked, gzip-compressed
datasets whose chunks are whole rows (about 1 MiB each): a rank's hyperslab of contiguous rows
decompresses only the chunks it covers. Labels whose values are all whole numbers become int64
class indices (with a ``num_classes`` attribute); other labels, or ``--regression``, stay
float32 targets. A CSV is read in blocks, so its inputs never need to fit in memory at once.
The file is written under a temporary name and renamed into place; an existing output is
replaced only with ``force``.
"""

from __future__ import annotations

import csv
import os
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np

from hpc_rlx.base.version import __version__
from hpc_rlx.base.errors import ConfigError, DataError

from .prepare import atomic_h5

__all__ = ["Converted", "convert", "SUFFIXES"]

CSV_SUFFIXES = (".csv", ".tsv", ".txt")
SUFFIXES = CSV_SUFFIXES + (".npz",)
_CHUNK_BYTES = 1 << 20         # about 1 MiB of rows per chunk
_CSV_BLOCK_ROWS = 1 << 16      # CSV rows parsed per block before they are written
_DTYPES = ("float32", "float64")


@dataclass
class Converted:
    out: str
    rows: int
    x_shape: tuple
    x_dtype: str
    y_shape: tuple
    y_dtype: str
    num_classes: int | None
    columns: list = field(default_factory=list)     # CSV: the input columns, in order

    def describe(self) -> str:
        labels = (f"{self.num_classes} classes" if self.num_classes is not None
                  else "float regression targets")
        return (f"wrote {self.out}: {self.rows} rows, x {self.x_shape} {self.x_dtype}, "
                f"y {self.y_shape} {self.y_dtype} ({labels}); train on it with: "
                f"mpirun -n 4 python -m hpc_rlx data=file data.path={self.out}")


def convert(src, out, label, x: str | None = None, force: bool = False, dtype: str = "float32",
            regression: bool = False, delimiter: str | None = None,
            num_classes: int | None = None) -> Converted:
    """Write `src` (.csv/.tsv/.txt or .npz) as hpc_rlx's HDF5 layout at `out`."""
    src, out = os.fspath(src), os.fspath(out)
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be one of {_DTYPES}, got {dtype!r}")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or num_classes < 2):
        raise ConfigError(f"--num-classes must be an integer >= 2, got {num_classes!r}")
    if regression and num_classes is not None:
        raise ConfigError("--num-classes is for class labels; it does not go with --regression")
    if not os.path.isfile(src):
        raise DataError(f"input file {src!r} does not exist" if not os.path.exists(src)
                        else f"input {src!r} is not a file")
    suffix = os.path.splitext(src)[1].lower()
    if suffix not in SUFFIXES:
        raise DataError(f"cannot convert {src!r}: convert reads {', '.join(SUFFIXES)} files")
    if os.path.exists(out):
        if os.path.abspath(out) == os.path.abspath(src):
            raise DataError(f"--out {out!r} is the input file itself; choose another output path")
        if not force:
            raise DataError(f"output {out!r} already exists; pass --force to replace it")
        if os.path.isdir(out):
            raise DataError(f"output {out!r} is a directory")
    opts = dict(dtype=np.dtype(dtype), regression=regression, num_classes=num_classes)
    if suffix == ".npz":
        if delimiter is not None:
            raise ConfigError("--delimiter is for CSV files, not .npz")
        return _convert_npz(src, out, label, x, **opts)
    if x is not None:
        raise ConfigError("--x names an array of an .npz file; a CSV's inputs are all its "
                          "columns except --label")
    return _convert_csv(src, out, label, delimiter, **opts)


# ---- labels ------------------------------------------------------------------------------

def label_array(y: np.ndarray, where: str, regression: bool, num_classes: int | None):
    """(labels as stored, classes or None): whole numbers -> int64 class indices 0..K-1."""
    if y.dtype.kind not in "biuf":
        raise DataError(f"{where} is not numeric (dtype {y.dtype}); labels must be numbers")
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        row = int(np.flatnonzero(~np.isfinite(y.reshape(len(y), -1)).all(axis=1))[0])
        raise DataError(f"{where} has a non-finite value at row {row}")
    integral = y.dtype.kind in "biu" or bool(np.all(y == np.floor(y)))
    if regression or not integral:
        return y.astype(np.float32), None
    labels = y.astype(np.int64)
    low, high = int(labels.min()), int(labels.max())
    if low < 0:
        raise DataError(f"{where} holds whole numbers, so they are read as class labels, but "
                        f"{low} is negative: class labels are 0 .. K-1 (remap them), or pass "
                        f"--regression for numeric targets")
    classes = high + 1
    if num_classes is not None:
        if num_classes <= high:
            raise DataError(f"--num-classes {num_classes}, but {where} has label {high}")
        classes = num_classes
    if classes < 2:
        raise DataError(f"{where}: every label is 0, a classifier needs at least 2 classes "
                        f"(or pass --regression)")
    return labels, classes


# ---- writing ------------------------------------------------------------------------------

def _chunk_rows(sample_shape: tuple, itemsize: int, rows: int | None) -> int:
    """Whole rows, about 1 MiB, never more rows than the dataset has (None: growing)."""
    per_row = max(1, itemsize * int(np.prod(sample_shape, dtype=np.int64)))
    fit = max(1, _CHUNK_BYTES // per_row)
    return fit if rows is None else max(1, min(rows, fit))


def _dataset(f, name: str, rows: int, sample_shape: tuple, dtype, resizable: bool = False):
    chunk = (_chunk_rows(sample_shape, np.dtype(dtype).itemsize, None if resizable else rows),) \
        + tuple(sample_shape)
    return f.create_dataset(name, shape=(rows,) + tuple(sample_shape), dtype=dtype, chunks=chunk,
                            maxshape=(None,) + tuple(sample_shape) if resizable else None,
                            compression="gzip", compression_opts=4, shuffle=True)


def _attrs(f, src: str, classes: int | None, extra: dict) -> None:

    f.attrs["kind"] = "converted"
    f.attrs["source"] = os.path.abspath(src)
    f.attrs["x_name"] = "x"
    f.attrs["y_name"] = "y"
    f.attrs["prepared_by"] = f"hpc_rlx {__version__} (python -m hpc_rlx.data convert)"
    if classes is not None:
        f.attrs["num_classes"] = int(classes)
    for k, v in extra.items():
        f.attrs[k] = v


# ---- .npz ---------------------------------------------------------------------------------

def _convert_npz(src, out, label, x_name, dtype, regression, num_classes) -> Converted:
    try:
        archive = np.load(src, allow_pickle=False)
    except zipfile.BadZipFile as e:
        # a zip archive cut short (a download or copy) has lost its central directory
        raise DataError(f"{src!r} is not a readable .npz file ({e}): it is damaged or cut "
                        "short; copy or download it again") from None
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{src!r} is not a readable .npz file: {e}") from None
    if not hasattr(archive, "files"):
        raise DataError(f"{src!r} holds a single array, not an .npz archive of arrays")
    with archive:
        names = list(archive.files)
        if not names:
            raise DataError(f"{src!r} is empty: it holds no arrays")
        if label not in names:
            raise DataError(f"{src!r} has no array {label!r} for --label; arrays: {', '.join(names)}")
        others = [n for n in names if n != label]
        if x_name is None:
            if len(others) != 1:
                raise DataError(f"{src!r} holds {len(others)} arrays besides {label!r} "
                                f"({', '.join(others) or 'none'}); name the inputs with --x NAME")
            x_name = others[0]
        elif x_name not in others:
            raise DataError(f"{src!r} has no array {x_name!r} for --x"
                            + ("" if x_name != label else " (it is the --label array)")
                            + f"; arrays: {', '.join(names)}")
        xs, ys = _load_member(archive, x_name, src), _load_member(archive, label, src)
    for name, arr in ((x_name, xs), (label, ys)):
        if arr.ndim == 0:
            raise DataError(f"array {name!r} in {src!r} is a scalar; it needs one row per sample")
        if len(arr) == 0:
            raise DataError(f"array {name!r} in {src!r} is empty (shape {arr.shape})")
    if len(xs) != len(ys):
        raise DataError(f"arrays {x_name!r} and {label!r} in {src!r} have different lengths: "
                        f"{len(xs)} vs {len(ys)} rows")
    if xs.dtype.kind not in "biuf":
        raise DataError(f"inputs {x_name!r} in {src!r} are not numeric (dtype {xs.dtype})")
    if xs.dtype.kind == "f":
        xs = xs.astype(dtype, copy=False)
    elif xs.dtype.kind == "b":
        xs = xs.astype(np.uint8)
    ys, classes = label_array(ys, f"labels {label!r} of {src!r}", regression, num_classes)
    with atomic_h5(out) as f:
        for name, arr in (("x", xs), ("y", ys)):
            _dataset(f, name, len(arr), arr.shape[1:], arr.dtype)[...] = arr
        _attrs(f, src, classes, {"x_source": x_name, "y_source": label})
    return Converted(out, len(xs), tuple(xs.shape[1:]), str(xs.dtype), tuple(ys.shape[1:]),
                     str(ys.dtype), classes)


def _load_member(archive, name: str, src: str) -> np.ndarray:
    try:
        return np.asarray(archive[name])
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        # a damaged member: bad CRC, a broken compressed stream, bytes missing
        raise DataError(f"array {name!r} in {src!r} is corrupt ({e}): the file was damaged, "
                        "e.g. in a download or copy; copy or download it again") from None
    except ValueError as e:   # object arrays need pickle, which is never enabled here
        raise DataError(f"array {name!r} in {src!r} cannot be read without pickle ({e}); "
                        "save it as a numeric array") from None


# ---- CSV ----------------------------------------------------------------------------------

def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def choose_delimiter(first_line: str, suffix: str) -> str:
    if suffix == ".tsv":
        return "\t"
    counts = {d: first_line.count(d) for d in (",", "\t", ";")}
    best = max(counts, key=counts.get)
    return best if counts[best] else ","


def resolve_label_column(label: str, header: list[str] | None, width: int, src: str) -> int:
    """The label column's index, by header name (exact, then case-insensitive) or by number."""
    if header is not None:
        if label in header:
            if header.count(label) > 1:
                raise DataError(f"{src!r} has {header.count(label)} columns named {label!r}")
            return header.index(label)
        folded = [h.lower() for h in header]
        if folded.count(label.lower()) == 1:
            return folded.index(label.lower())
    try:
        i = int(label)
    except ValueError:
        cols = ", ".join(header) if header else f"none (no header row; use a number 0..{width - 1})"
        raise DataError(f"{src!r} has no label column {label!r}; columns: {cols}") from None
    if not -width <= i < width:
        raise DataError(f"--label {i}: {src!r} has {width} columns (0..{width - 1})")
    return i % width


def _convert_csv(src, out, label, delimiter, dtype, regression, num_classes) -> Converted:
    try:
        return _read_csv(src, out, label, delimiter, dtype, regression, num_classes)
    except UnicodeDecodeError as e:
        raise DataError(f"{src!r} is not UTF-8 text (byte {e.start}: {e.reason}); save the CSV "
                        "as UTF-8") from None
    except csv.Error as e:
        raise DataError(f"{src!r} is not a readable CSV file: {e}") from None


def _read_csv(src, out, label, delimiter, dtype, regression, num_classes) -> Converted:
    with open(src, newline="", encoding="utf-8-sig") as fh:
        first = fh.readline()
        fh.seek(0)
        delim = delimiter or choose_delimiter(first, os.path.splitext(src)[1].lower())
        reader = csv.reader(fh, delimiter=delim)
        rows = ((reader.line_num, [c.strip() for c in r]) for r in reader if any(c.strip() for c in r))
        head = next(rows, None)
        if head is None:
            raise DataError(f"{src!r} is empty: no header and no data rows")
        _, fields = head
        has_header = any(_number(c) is None for c in fields)
        header = fields if has_header else None
        width = len(fields)
        if width < 2:
            raise DataError(f"{src!r} has {width} column (delimiter {delim!r}); it needs the "
                            "inputs and a label column (set --delimiter if it is not "
                            f"{delim!r})")
        yi = resolve_label_column(label, header, width, src)
        names = header or [str(i) for i in range(width)]
        x_cols = [i for i in range(width) if i != yi]
        pending = [] if has_header else [head]
        with atomic_h5(out) as f:
            dx = None
            labels: list[np.ndarray] = []
            n = 0
            block: list = list(pending)
            for item in rows:
                block.append(item)
                if len(block) >= _CSV_BLOCK_ROWS:
                    if dx is None:    # more than one block: the dataset grows block by block
                        dx = _dataset(f, "x", 0, (len(x_cols),), dtype, resizable=True)
                    n = _write_block(dx, labels, block, n, yi, x_cols, names, width, src, dtype)
                    block = []
            if dx is None and not block:
                raise DataError(f"{src!r} has a header but no data rows")
            if dx is None:            # all rows in one block: chunks no larger than the data
                dx = _dataset(f, "x", len(block), (len(x_cols),), dtype)
            n = _write_block(dx, labels, block, n, yi, x_cols, names, width, src, dtype)
            ys, classes = label_array(np.concatenate(labels), f"label column {names[yi]!r} of {src!r}",
                                      regression, num_classes)
            _dataset(f, "y", n, (), ys.dtype)[...] = ys
            _attrs(f, src, classes, {"feature_names": [names[i] for i in x_cols],
                                     "label_column": names[yi]})
    return Converted(out, n, (len(x_cols),), str(np.dtype(dtype)), (), str(ys.dtype), classes,
                     columns=[names[i] for i in x_cols])


def _parse_block(block, yi, names, width, src) -> np.ndarray:
    """The block's fields as float64 (rows, width); the first bad field named by line/column."""
    for line, fields in block:
        if len(fields) != width:
            raise DataError(f"line {line} of {src!r} has {len(fields)} fields, but the first "
                            f"row has {width}")
    try:    # numpy parses a whole block at C speed; only a bad block is walked field by field
        return np.array([fields for _, fields in block], dtype=np.float64)
    except ValueError:
        pass
    for line, fields in block:
        for c, text in enumerate(fields):
            if _number(text) is not None:
                continue
            what = "label column" if c == yi else "column"
            if text == "":
                raise DataError(f"line {line} of {src!r}: {what} {names[c]!r} is empty "
                                "(a missing value); fill or drop such rows first")
            hint = ("labels must be numbers: encode the classes as 0 .. K-1" if c == yi else
                    "every input column must be numeric: drop it or encode it as numbers")
            raise DataError(f"{what} {names[c]!r} of {src!r} is not numeric (line {line}: "
                            f"{text!r}); {hint}")
    # every field is a Python float numpy did not take (e.g. '1_000')
    return np.array([[float(t) for t in fields] for _, fields in block], dtype=np.float64)


def _write_block(dx, labels, block, n, yi, x_cols, names, width, src, dtype) -> int:
    if not block:
        return n
    values = _parse_block(block, yi, names, width, src)
    # NaN/Inf inputs ('nan' in the file) are kept: data.check_finite=true refuses them at load
    if dx.shape[0] < n + len(block):
        dx.resize(n + len(block), axis=0)
    dx[n:n + len(block)] = values[:, x_cols].astype(dtype)
    labels.append(values[:, yi])
    return n + len(block)
