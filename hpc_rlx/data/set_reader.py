"""Contiguous sample ranges of a file set read into memory (`data.cache=memory`, and rank 0's
reads under `data.distribution=scatter`); no MPI.

Multi-sample files go through h5py, one file open at a time; one-sample files through
:class:`~hpc_rlx.data.one_sample.OneSampleReader`, which skips HDF5 for files laid out like one
it has read.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.data.files import Meta, check_unchanged, meta_of
from hpc_rlx.data.fileset import FileSet
from hpc_rlx.data.hdf5 import describe_open_file, open_dataset_file
from hpc_rlx.data.one_sample import OneSampleReader
from hpc_rlx.base.errors import DataError

__all__ = ["SetReader", "read_set"]

_CAST_BYTES = 16 << 20     # a cast while reading goes through a buffer of about this size


def _read_piece(d, lo: int, hi: int, out: np.ndarray, at: int) -> None:
    stored = d.dtype.newbyteorder("=")
    if out.dtype == stored:
        d.read_direct(out, source_sel=np.s_[lo:hi], dest_sel=np.s_[at:at + hi - lo])
        return
    # a cast (float64 file, float32 run): through a bounded buffer, so the shard is never held
    # twice; NumPy's cast, the one the per-batch path of data.cache=stream uses
    row = stored.itemsize * int(np.prod(d.shape[1:], dtype=np.int64))
    block = max(1, _CAST_BYTES // max(1, row))
    buf = np.empty((min(block, hi - lo),) + tuple(d.shape[1:]), dtype=stored)
    for a in range(lo, hi, block):
        b = min(hi, a + block)
        d.read_direct(buf, source_sel=np.s_[a:b], dest_sel=np.s_[0:b - a])
        out[at + a - lo:at + b - lo] = buf[:b - a]


class SetReader:
    """Contiguous sample ranges of a set read with HDF5, one file open at a time; each file is
    checked against `ref` (its datasets, metadata only) when it is opened."""

    def __init__(self, files: FileSet, x_name: str, y_name: str, ref: Meta, ref_path: str):
        self.files, self.x_name, self.y_name, self.ref, self.ref_path = files, x_name, y_name, ref, ref_path
        self._cur = None        # (file index, h5py.File)
        self._one = OneSampleReader(x_name, y_name, ref, ref_path) if files.one_sample else None

    def _open_file(self, k: int):
        if self._cur is not None and self._cur[0] == k:
            return self._cur[1]
        self.close()
        files, named = self.files, self.files.named(k)
        f = open_dataset_file(files.opened(k))
        try:
            info = describe_open_file(f, named, self.x_name, self.y_name, files.one_sample)
            check_unchanged(meta_of(info), files, k, self.ref, self.ref_path, self.x_name, self.y_name)
        except BaseException:
            f.close()
            raise
        self._cur = (k, f)
        return f

    def read_range(self, start: int, stop: int, x_out: np.ndarray, y_out: np.ndarray, at: int = 0) -> None:
        for p in self.files.pieces(start, stop):
            if self.files.one_sample:
                self._one.read(self.files.opened(p.file), self.files.named(p.file), x_out, y_out, at + p.at)
                continue
            f = self._open_file(p.file)
            try:
                _read_piece(f[self.x_name], p.lo, p.hi, x_out, at + p.at)
                _read_piece(f[self.y_name], p.lo, p.hi, y_out, at + p.at)
            except (OSError, ValueError, TypeError) as e:
                where = (f"{self.files.named(p.file)!r}" if len(self.files) > 1
                         else f"{self.files.named(p.file)!r} rows [{p.lo}, {p.hi})")
                raise DataError(f"reading {where} failed: {e}") from None

    def close(self) -> None:
        if self._cur is not None:
            try:
                self._cur[1].close()
            except (OSError, ValueError):
                pass
            self._cur = None


def read_set(files: FileSet, x_name: str, y_name: str, start: int, stop: int, ref: Meta,
             ref_path: str, x_dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Samples [start, stop) of the set, x in `x_dtype` (else as stored)."""
    if not 0 <= start <= stop <= files.n:
        where = files.paths[0] if len(files) == 1 else f"the {len(files)} files of {ref_path!r}..."
        raise DataError(f"row range [{start}, {stop}) is outside dataset {where!r} with {files.n} rows")
    out_x = np.empty((stop - start,) + tuple(ref.x_shape), dtype=ref.x_dtype if x_dtype is None else x_dtype)
    out_y = np.empty((stop - start,) + tuple(ref.y_shape), dtype=ref.y_dtype)
    reader = SetReader(files, x_name, y_name, ref, ref_path)
    try:
        reader.read_range(start, stop, out_x, out_y)
    finally:
        reader.close()
    return out_x, out_y
