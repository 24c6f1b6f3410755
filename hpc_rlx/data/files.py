"""`data.path` as a file, a directory or a glob pattern: the files, their sample counts and the
check that they all hold the same datasets (no MPI).

- :func:`resolve` lists the files (sorted as Python sorts strings);
- :func:`file_meta` reads one file's dataset shapes and dtypes through HDF5's low-level calls
  (about 0.2 ms a file: no sample data, no Python objects for the file);
- :func:`describe_set` is rank 0's view before planning: the first file described in full, and
  every file's count (read only when the files hold several samples each);
- :func:`read_one_sample` reads a one-sample file through HDF5 (`data/one_sample.py` skips HDF5
  for files laid out like one it has read).

Reading ranges of a set is `data/set_reader.py`.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, replace

import h5py
import numpy as np
from h5py import h5d, h5f, h5p, h5s

from hpc_rlx.data.fileset import FileSet
from hpc_rlx.data.hdf5 import DatasetInfo, describe, describe_open_file, open_dataset_file
from hpc_rlx.base.errors import DataError

__all__ = ["resolve", "read_whole", "Meta", "file_meta", "check_like", "describe_set", "meta_of", "check_files",
           "read_one_sample", "plan_files"]

def _is_hdf5(path: str) -> bool:
    try:
        return bool(h5py.is_hdf5(path))
    except OSError as e:
        raise DataError(f"cannot read data file {path!r}: {e}") from None


def resolve(spec, key: str = "data.path") -> list[str]:
    """The files `spec` names: the file itself, every HDF5 file in a directory (by its
    signature, so a netCDF-4 `.nc` counts; not recursive; names starting with '.' skipped, as
    a shell's `*` skips them), or the files a glob pattern matches. Sorted as strings."""
    spec = os.path.expanduser(os.fspath(spec))
    if os.path.isdir(spec):
        names = sorted(n for n in os.listdir(spec) if not n.startswith("."))
        paths = [os.path.join(spec, n) for n in names if os.path.isfile(os.path.join(spec, n))]
        if not paths:
            raise DataError(f"{key}={spec} is a directory with no files in it")
        for p in paths:
            if not _is_hdf5(p):
                raise DataError(f"{key}={spec}: {p!r} in that directory is not an HDF5 file; move it "
                                f"out, or pick the data files with a glob ({key}='{os.path.join(spec, '*.h5')}')")
        return paths
    if glob.has_magic(spec) and not os.path.exists(spec):
        paths = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
        if not paths:
            raise DataError(f"{key}={spec} matches no file")
        return paths
    return [spec]     # one file; open_dataset_file says what is wrong with it


@dataclass(frozen=True)
class Meta:
    """One file's datasets: samples, and per sample the shapes and (native-order) dtypes."""
    n: int
    x_shape: tuple
    x_dtype: np.dtype
    y_shape: tuple
    y_dtype: np.dtype


def meta_of(info: DatasetInfo) -> Meta:
    return Meta(info.n, tuple(info.x_shape), np.dtype(info.x_dtype).newbyteorder("="),
                tuple(info.y_shape), np.dtype(info.y_dtype).newbyteorder("="))


_FAPL = h5p.create(h5p.FILE_ACCESS)
_FAPL.set_fclose_degree(h5f.CLOSE_STRONG)
try:
    _FAPL.set_file_locking(False, True)      # as open_readonly: no locks on cluster filesystems
except AttributeError:
    pass


def _fast_meta(path: str, x_name: str, y_name: str, one_sample: bool) -> Meta | None:
    try:
        fid = h5f.open(os.fsencode(path), h5f.ACC_RDONLY, fapl=_FAPL)
    except Exception:  # noqa: BLE001 - the full describe says what is wrong
        return None
    try:
        dx, dy = h5d.open(fid, x_name.encode()), h5d.open(fid, y_name.encode())
        xs, ys = tuple(int(s) for s in dx.shape), tuple(int(s) for s in dy.shape)
        xd, yd = np.dtype(dx.dtype).newbyteorder("="), np.dtype(dy.dtype).newbyteorder("=")
    except Exception:  # noqa: BLE001
        return None
    finally:
        fid.close()
    if one_sample:
        return Meta(1, xs, xd, ys, yd)
    if not xs or not ys or xs[0] != ys[0] or xs[0] == 0:
        return None
    return Meta(xs[0], xs[1:], xd, ys[1:], yd)


def _plain_offset(d) -> int | None:
    """The file offset of a low-level dataset stored as plain native bytes, else None."""
    try:
        plist = d.get_create_plist()
        if (plist.get_layout() != h5d.CONTIGUOUS or plist.get_nfilters() or plist.get_external_count()
                or not d.dtype.isnative or d.dtype.kind not in "biuf"):
            return None
        return d.get_offset()
    except Exception:  # noqa: BLE001 - HDF5 reads it then
        return None


def read_one_sample(path: str, named: str, x_name: str, y_name: str, ref: Meta, ref_path: str,
                    x_out, y_out, at: int, offsets: bool = False) -> tuple[int, int] | None:
    """A one-sample file through HDF5's low-level calls (a few times cheaper than h5py.File),
    checked against `ref`, into x_out[at] (None: skipped) and y_out[at]; returns the datasets'
    file offsets (`offsets=True`) when both are plain bytes (a later read may pread them), else
    None. A file
    the low-level calls cannot open or lacks a dataset gets the full description's message."""
    try:
        fid = h5f.open(os.fsencode(path), h5f.ACC_RDONLY, fapl=_FAPL)
    except Exception:  # noqa: BLE001
        fid = None
    if fid is None:
        describe(path, x_name, y_name, True)      # raises the message (missing, not HDF5, ...)
        raise DataError(f"cannot open data file {named!r}")
    try:
        try:
            dx, dy = h5d.open(fid, x_name.encode()), h5d.open(fid, y_name.encode())
        except Exception:  # noqa: BLE001
            meta_of(_describe_open_path(path, named, x_name, y_name))     # raises the message
            raise
        got = Meta(1, tuple(dx.shape), np.dtype(dx.dtype).newbyteorder("="), tuple(dy.shape),
                   np.dtype(dy.dtype).newbyteorder("="))
        check_like(got, ref, named, ref_path, x_name, y_name)
        for d, out, stored in ((dx, x_out, got.x_dtype), (dy, y_out, got.y_dtype)):
            if out is None:
                continue
            view = out[at:at + 1]
            if out.dtype == stored:
                d.read(h5s.create_simple(view.shape), h5s.ALL, view)
            else:     # a cast: NumPy's, as every other path casts
                tmp = np.empty(view.shape, stored)
                d.read(h5s.create_simple(tmp.shape), h5s.ALL, tmp)
                view[...] = tmp
        xo, yo = (_plain_offset(dx), _plain_offset(dy)) if offsets else (None, None)
        return None if xo is None or yo is None else (xo, yo)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"reading data file {named!r} failed: {e}") from None
    finally:
        fid.close()


def read_whole(path: str, name: str) -> np.ndarray:
    """One dataset of a file, whole, through HDF5's low-level calls (a one-sample file's label);
    a file or dataset they cannot open gets h5py's message."""
    try:
        fid = h5f.open(os.fsencode(path), h5f.ACC_RDONLY, fapl=_FAPL)
    except Exception:  # noqa: BLE001
        open_dataset_file(path).close()         # raises the message (missing, not HDF5, ...)
        raise DataError(f"cannot open data file {path!r}") from None
    try:
        d = h5d.open(fid, name.encode())
        out = np.empty(tuple(d.shape), np.dtype(d.dtype).newbyteorder("="))
        d.read(h5s.create_simple(out.shape) if out.shape else h5s.create(h5s.SCALAR), h5s.ALL, out)
        return out
    except KeyError:
        raise DataError(f"data file {path!r} has no dataset {name!r}") from None
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"reading {name!r} of {path!r} failed: {e}") from None
    finally:
        fid.close()


def _describe_open_path(path: str, named: str, x_name: str, y_name: str) -> DatasetInfo:
    with open_dataset_file(path) as f:
        return describe_open_file(f, named, x_name, y_name, True)


def file_meta(path: str, x_name: str, y_name: str, one_sample: bool = False) -> Meta:
    """One file's Meta, metadata only; DataError naming the file when it is not a data file."""
    got = _fast_meta(path, x_name, y_name, one_sample)
    if got is None:     # the full description has the message (missing dataset, empty, ...)
        got = meta_of(describe(path, x_name, y_name, one_sample))
    return got


def check_like(meta: Meta, ref: Meta, path: str, ref_path: str, x_name: str, y_name: str) -> None:
    """DataError naming `path` and how it differs from `ref_path`, if it does."""
    for role, name, have, want in (("input", x_name, meta.x_shape, ref.x_shape),
                                   ("label", y_name, meta.y_shape, ref.y_shape)):
        if tuple(have) != tuple(want):
            raise DataError(f"data file {path!r} differs from {ref_path!r}: {role} {name!r} has "
                            f"per-sample shape {tuple(have)} there, {tuple(want)} in {ref_path!r}")
    for role, name, have, want in (("input", x_name, meta.x_dtype, ref.x_dtype),
                                   ("label", y_name, meta.y_dtype, ref.y_dtype)):
        if np.dtype(have) != np.dtype(want):
            raise DataError(f"data file {path!r} differs from {ref_path!r}: {role} {name!r} has dtype "
                            f"{np.dtype(have)} there, {np.dtype(want)} in {ref_path!r}")


def describe_set(spec, x_name: str, y_name: str, one_sample: bool = False,
                 key: str = "data.path") -> tuple[DatasetInfo, FileSet]:
    """Rank 0 before planning: (the set described as one file, the FileSet). The first file is
    described in full (its attributes: num_classes); with several samples a file, every file's
    count is read and its datasets checked against the first (metadata only); with one sample a
    file the counts are known and each rank checks the files it reads at load."""
    paths = resolve(spec, key)
    first = describe(paths[0], x_name, y_name, one_sample)
    if one_sample:
        counts = [1] * len(paths)
    else:
        ref, counts = meta_of(first), [first.n]
        for p in paths[1:]:
            m = file_meta(p, x_name, y_name)
            check_like(m, ref, p, paths[0], x_name, y_name)
            counts.append(m.n)
    files = FileSet(tuple(paths), tuple(counts), one_sample)
    info = first if len(paths) == 1 and not one_sample else replace(first, path=os.fspath(spec), n=files.n,
                                                                      files=files)
    return info, files


def check_unchanged(meta: Meta, files: FileSet, k: int, ref: Meta, ref_path: str, x_name: str, y_name: str) -> None:
    """File k of `files`, read as `meta`, still holds datasets like `ref` and the sample count the
    run was planned with: one DataError naming it otherwise."""
    check_like(meta, ref, files.named(k), ref_path, x_name, y_name)
    if meta.n != files.counts[k]:
        raise DataError(f"data file {files.named(k)!r} holds {meta.n} samples, {files.counts[k]} when the "
                        f"run started (the file changed?)")


def check_files(files: FileSet, indices, x_name: str, y_name: str, ref: Meta, ref_path: str) -> None:
    """Every file of `indices` holds datasets like `ref` (metadata only): one DataError naming
    the first that does not."""
    for f in indices:
        check_unchanged(file_meta(files.opened(f), x_name, y_name, files.one_sample), files, f, ref, ref_path,
                        x_name, y_name)


def plan_files(d) -> tuple[FileSet, FileSet, tuple[Meta, str]]:
    """From a spec's data plan: (the training set, the validation set, (the Meta every file
    must match, the file it was read from)). A plan without a file list (one written before
    data sets) is its one file."""
    one = bool(getattr(d, "one_sample", False))
    pairs = getattr(d, "files", None) or [[d.path, d.val_stop if d.val_path in (None, d.path) else d.n_train]]
    files = FileSet.from_plan(pairs, one)
    if d.val_path and d.val_path != d.path:
        vpairs = getattr(d, "val_files", None) or [[d.val_path, d.val_stop]]
        val = FileSet.from_plan(vpairs, one)
    else:
        val = files
    ref = Meta(1, tuple(d.sample_shape), np.dtype(d.x_dtype).newbyteorder("="), tuple(d.y_shape or ()),
               np.dtype(d.y_dtype).newbyteorder("="))
    return files, val, (ref, files.paths[0])
