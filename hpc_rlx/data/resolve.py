"""Rank 0's decisions about the data before the model is built (no MPI).

- whether a missing `data.path` may be prepared: only at the data group's own default path, so
  a mistyped path of one's own data is an error instead of a digits file written there;
- how many classes the model has: `model.num_classes`, else a `num_classes` / `vocab_size`
  attribute of the file or of its label dataset, else the training labels (max + 1).

The result travels to every rank inside the TrainSpec, so all ranks agree on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpc_rlx.base.errors import ConfigError, DataError

from .files import check_like, describe_set, meta_of, read_whole
from .fileset import FileSet
from .hdf5 import DatasetInfo, open_readonly
from .prepare import ensure_prepared

_GROUP_DIR = Path(__file__).resolve().parent.parent / "configs" / "data"
_CLASS_ATTRS = ("num_classes", "vocab_size")
# labels scanned per block when counting classes: bounded memory whatever the file size
_SCAN_ROWS = 1 << 20


def group_default_path(name) -> str | None:
    """`path` as the data group `name` declares it (configs/data/<name>.yaml), or None."""
    if not isinstance(name, str) or not name or "/" in name:
        return None

    try:
        from omegaconf import OmegaConf   # here: the ranks other than 0 never load YAML
        group = OmegaConf.load(_GROUP_DIR / f"{name}.yaml")
    except (OSError, ValueError):
        return None
    path = group.get("path")
    return path if isinstance(path, str) and path not in ("", "???") else None


def _same_path(a: str, b: str) -> bool:
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def prepare_missing_data(d: dict) -> None:
    """Prepare the group's dataset when its file is missing, or refuse a missing user path.

    A group with `prepare: KIND` prepares KIND at its own default path only: any other missing
    path is a typo or a file the user meant to bring (`data=file`)."""
    path, kind = d["path"], d.get("prepare")
    if not kind or not isinstance(path, str) or os.path.exists(path):
        return
    default = group_default_path(d.get("name"))
    if default is None or not _same_path(path, default):
        raise DataError(
            f"dataset file {path!r} does not exist. data={d.get('name')} prepares its {kind} "
            f"dataset only at its own path {default or '(none)'}; for your own data use "
            f"data=file data.path={path} (or write it there first: python -m hpc_rlx.data "
            f"prepare {kind} --out {path})")
    ensure_prepared(path, kind)


@dataclass(frozen=True)
class Sources:
    """What rank 0 plans with: the training set described as one file, its files, the
    validation set's (None: the tail of the training files) and where each part's rows lie."""
    info: DatasetInfo
    files: FileSet
    vinfo: DatasetInfo | None
    val_files: FileSet | None
    n_train: int
    val_start: int
    val_stop: int


def data_sources(d: dict) -> Sources:
    """`data.path` and `data.val_path` (a file, a directory or a glob) as file sets; validation
    by `val_fraction` is the tail of the training samples (whole files with one sample each)."""
    one = bool(d.get("one_sample_per_file"))
    info, files = describe_set(d["path"], d["x"], d["y"], one)
    if d["val_path"]:
        vinfo, vfiles = describe_set(d["val_path"], d["x"], d["y"], one, key="data.val_path")
        # every file of both sets is read into the same buffers: the same datasets throughout
        check_like(meta_of(vinfo), meta_of(info), vfiles.paths[0], files.paths[0], d["x"], d["y"])
        return Sources(info, files, vinfo, vfiles, info.n, 0, vinfo.n)
    n_val = int(round(info.n * float(d["val_fraction"] or 0.0)))
    if info.n - n_val <= 0:
        raise DataError(f"data.val_fraction={d['val_fraction']} leaves no training samples "
                        f"in {d['path']} ({info.n} samples)")
    return Sources(info, files, None, None, info.n - n_val, info.n - n_val, info.n)


def _positive_attr(where: str, key: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise DataError(f"the {key} attribute of {where} must be a positive integer, got {v!r}")
    return int(v)


def attribute_classes(info) -> tuple[int, str] | None:
    """(classes, where) from the file's root attributes or the label dataset's attributes.

    Both are accepted; when both say it, they must agree."""
    found: list[tuple[int, str, str]] = []
    for attrs, where in ((info.attrs, f"{info.path!r}"),
                         (getattr(info, "y_attrs", {}) or {}, f"label dataset {info.y_name!r} of {info.path!r}")):
        for key in _CLASS_ATTRS:
            if key in attrs:
                found.append((_positive_attr(where, key, attrs[key]), key, where))
                break
    if not found:
        return None
    values = {n for n, _, _ in found}
    if len(values) > 1:
        said = " but ".join(f"{where} says {key}={n}" for n, key, where in found)
        raise DataError(f"the number of classes is ambiguous: {said}; fix one of them or set "
                        f"model.num_classes")
    n, key, where = found[0]
    return n, f"the {key} attribute of {where}"


def label_classes(path, y_name: str, n_rows: int, extra_names=(), ignore=None) -> tuple[int, int]:
    """(max label + 1, rows scanned) over rows [0, n_rows) of the integer datasets `y_name`
    (and `extra_names`, e.g. token-id inputs that index the same vocabulary), block by block.
    `path`: a file, or a FileSet (its files in order, up to n_rows samples)."""
    files = path if isinstance(path, FileSet) else FileSet.single(path, n_rows)
    if files.one_sample and not extra_names:
        return _one_sample_classes(files, y_name, n_rows, ignore), n_rows
    top = -1
    for p in files.pieces(0, min(n_rows, files.n)):
        where = files.opened(p.file)
        try:
            got, _ = _label_classes(where, y_name, (p.lo, p.hi), extra_names, files.one_sample, ignore)
        except OSError as e:
            raise DataError(f"reading the labels of {where!r} to count the classes failed: {e}") from None
        top = max(top, got - 1)
    return top + 1, n_rows


def _one_sample_classes(files: FileSet, y_name: str, n_rows: int, ignore) -> int:
    """Max label + 1 over the first n_rows one-sample files, each label read through HDF5's
    low-level calls (rank 0 reads every file before planning: a few times cheaper)."""
    top = -1
    for k in range(min(n_rows, files.n)):
        block = read_whole(files.opened(k), y_name)
        if block.dtype.kind not in "iu":
            raise DataError(f"dataset {files.opened(k)!r}: labels {y_name!r} have dtype {block.dtype}, but the "
                            "loss needs integer class indices"
                            + (" (float labels found; store them as int64)" if block.dtype.kind == "f" else ""))
        if block.size == 0:
            continue
        if ignore is not None:     # model.ignore_index: no class
            block = np.where(block == ignore, 0, block)
        low = int(block.min())
        if low < 0:
            raise DataError(f"label {low} of {y_name!r} in {files.opened(k)!r} is negative: class labels are "
                            "indices 0 .. num_classes-1")
        top = max(top, int(block.max()))
    return top + 1


def _label_classes(path, y_name, rows, extra_names, one_sample=False, ignore=None) -> tuple[int, int]:
    top = -1
    lo, n_rows = rows
    with open_readonly(path) as f:
        extra = [n for n in extra_names if f[n].dtype.kind in "iu"]
        for name in (y_name, *extra):
            d = f[name]
            if d.dtype.kind not in "iu":
                raise DataError(
                    f"dataset {path!r}: labels {name!r} have dtype {d.dtype}, but the loss needs "
                    "integer class indices"
                    + (" (float labels found; store them as int64)" if d.dtype.kind == "f" else ""))
            for start in range(lo, n_rows, _SCAN_ROWS):
                block = d[()][None] if one_sample else d[start:min(n_rows, start + _SCAN_ROWS)]
                if block.size == 0:
                    continue
                if ignore is not None and name == y_name:     # model.ignore_index: no class
                    block = np.where(block == ignore, 0, block)
                low = int(block.min())
                if low < 0:
                    flat = int(np.flatnonzero(block.reshape(len(block), -1).min(axis=1) < 0)[0])
                    raise DataError(
                        f"label {low} at row {start + flat} of {name!r} in {path!r} is negative: "
                        "class labels are indices 0 .. num_classes-1")
                top = max(top, int(block.max()))
    return top + 1, n_rows


def num_classes(model_cfg: dict, info, n_train: int) -> tuple[int | None, str | None]:
    """(classes, where it came from); (None, None) for models that take no class count."""
    n = model_cfg.get("num_classes")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"model.num_classes must be null or a positive integer, got {n!r}")
        return n, "model.num_classes"
    found = attribute_classes(info)
    if found is not None:
        return found
    if model_cfg.get("name") not in ("mlp", "cnn", "transformer_lm"):
        return None, None
    # token-id inputs index the same vocabulary as the next-token labels
    extra = (info.x_name,) if model_cfg.get("name") == "transformer_lm" else ()
    classes, rows = label_classes(info.files or info.path, info.y_name, n_train, extra,
                                  model_cfg.get("ignore_index"))
    if classes < 2:
        raise DataError(f"every training label in {info.path!r} is 0: a classifier needs at least "
                        "2 classes; set model.num_classes")
    return classes, f"the training labels (max label {classes - 1} over {rows} rows)"
