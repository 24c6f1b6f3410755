"""One-sample files (`data.one_sample_per_file`), read without opening HDF5 where that is safe
(no MPI).

Opening a small file through HDF5 costs a few hundred microseconds; its sample is a few
kilobytes to a few megabytes that one `pread` fetches in a few microseconds. Files written by
one program for one data set are laid out alike, byte for byte outside their samples (the same
superblock, object headers and dataset addresses). So:

- the first file of a given size is read through HDF5, which also gives its datasets' file
  offsets when they are stored as plain bytes (contiguous, no filters); its bytes outside the two
  datasets become a :class:`Layout`;
- a later file of that size is read with one `preadv` that puts its two datasets straight into
  the output and everything else into scratch buffers; when those bytes equal the layout's, the
  file's metadata is the same bytes HDF5 parsed for the first file, so its datasets, shapes,
  dtypes and offsets are the same too, and the read is done. Otherwise (another writer, per-file
  timestamps) HDF5 reads it as before: the fast path is a shortcut, never a second opinion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from hpc_rlx.data.files import Meta, read_one_sample
from hpc_rlx.base.errors import DataError

__all__ = ["Layout", "OneSampleReader"]

_MAX_LAYOUTS = 4        # distinct file sizes remembered
_GIVE_UP_AFTER = 16     # misses with no hit before a layout stops being tried
_MAX_FILE_BYTES = 1 << 30


@dataclass(frozen=True)
class Layout:
    """A one-sample file's bytes outside its two datasets, and where the datasets lie."""
    size: int
    x: tuple            # (offset, bytes)
    y: tuple
    gaps: tuple         # ((offset, bytes object), ...): every byte outside x and y, in file order

    @classmethod
    def of_file(cls, path: str, x: tuple, y: tuple) -> "Layout | None":
        """The layout of the file at `path` whose datasets HDF5 found at x and y; None when the
        file cannot be read or the ranges are odd (overlapping, past the end)."""
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_FILE_BYTES + 1)
        except OSError:
            return None
        first, second = sorted((tuple(x), tuple(y)))
        if first[0] + first[1] > second[0] or second[0] + second[1] > len(data) or len(data) > _MAX_FILE_BYTES:
            return None
        cuts = [(0, first[0]), (first[0] + first[1], second[0]), (second[0] + second[1], len(data))]
        gaps = tuple((a, data[a:b]) for a, b in cuts if b > a)
        return cls(len(data), tuple(x), tuple(y), gaps)

    def read_into(self, fd: int, x_bytes: memoryview, y_bytes: memoryview) -> bool:
        """Read the open file `fd` (already known to be `size` bytes) with its datasets into
        x_bytes and y_bytes; True when its other bytes equal the layout's."""
        pieces = sorted([(self.x[0], x_bytes), (self.y[0], y_bytes)]
                        + [(a, bytearray(len(g))) for a, g in self.gaps], key=lambda p: p[0])
        if os.preadv(fd, [buf for _, buf in pieces], 0) != self.size:
            return False
        scratch = {a: buf for a, buf in pieces if isinstance(buf, bytearray)}
        return all(scratch[a] == g for a, g in self.gaps)


def _bytes_of(out, at: int, dtype: np.dtype, shape: tuple):
    """(a writable byte view of out[at], the array to copy from afterwards or None). A dataset
    not wanted (out None) or stored in another dtype goes through a scratch array."""
    if out is not None and out.dtype == dtype and out[at:at + 1].flags.c_contiguous:
        return memoryview(out[at:at + 1].reshape(-1).view(np.uint8)), None
    tmp = np.empty((1,) + tuple(shape), dtype)
    return memoryview(tmp.reshape(-1).view(np.uint8)), (tmp if out is not None else None)


class OneSampleReader:
    """Reads one-sample files like `ref` into caller-owned buffers. `offsets` (path -> (x, y)
    offsets or None) may be shared by the readers of one run so that any reader's HDF5 open
    serves later reads; each reader thread has its own OneSampleReader (its layouts are its own)."""

    def __init__(self, x_name: str, y_name: str, ref: Meta, ref_path: str, offsets: dict | None = None):
        self.x_name, self.y_name, self.ref, self.ref_path = x_name, y_name, ref, ref_path
        self.x_dtype, self.y_dtype = np.dtype(ref.x_dtype), np.dtype(ref.y_dtype)
        self.x_nbytes = self.x_dtype.itemsize * int(np.prod(ref.x_shape, dtype=np.int64))
        self.y_nbytes = self.y_dtype.itemsize * int(np.prod(ref.y_shape, dtype=np.int64))
        self.offsets: dict = {} if offsets is None else offsets
        self._layouts: dict[int, Layout] = {}       # by file size
        self._misses: dict[int, int] = {}           # by file size; -1 once a layout has matched
        self.fast_reads = 0                         # files read through a layout (for tests/benchmarks)

    def read(self, path: str, named: str, x_out, y_out, at: int) -> None:
        """The file at `path` (`named` in messages) into x_out[at] (None: not wanted) and y_out[at]."""
        if path in self.offsets and self.offsets[path] is None:      # not plain bytes: HDF5 every time
            read_one_sample(path, named, self.x_name, self.y_name, self.ref, self.ref_path, x_out, y_out, at)
            return
        if self._read_by_layout(path, named, x_out, y_out, at):
            return
        if path in self.offsets:
            self._pread(path, named, self.offsets[path], x_out, y_out, at)
            return
        found = read_one_sample(path, named, self.x_name, self.y_name, self.ref, self.ref_path, x_out, y_out, at,
                                offsets=True)
        self.offsets[path] = found
        if found is not None:
            self._learn(path, found)

    def _learn(self, path: str, found: tuple) -> None:
        size = _size_of(path)
        if size is None or size in self._layouts or len(self._layouts) >= _MAX_LAYOUTS:
            return
        layout = Layout.of_file(path, (found[0], self.x_nbytes), (found[1], self.y_nbytes))
        if layout is not None:
            self._layouts[size] = layout

    def _read_by_layout(self, path: str, named: str, x_out, y_out, at: int) -> bool:
        if not self._layouts:
            return False
        fd = _open_fd(path, named)
        try:
            size = os.fstat(fd).st_size
            layout = self._layouts.get(size)
            if layout is None or self._misses.get(size, 0) >= _GIVE_UP_AFTER:
                return False
            xb, xtmp = _bytes_of(x_out, at, self.x_dtype, self.ref.x_shape)
            yb, ytmp = _bytes_of(y_out, at, self.y_dtype, self.ref.y_shape)
            if not layout.read_into(fd, xb, yb):
                if self._misses.get(size, 0) >= 0:
                    self._misses[size] = self._misses.get(size, 0) + 1
                return False
        except OSError as e:
            raise DataError(f"reading data file {named!r} failed: {e}") from None
        finally:
            os.close(fd)
        self._misses[size] = -1
        for tmp, out in ((xtmp, x_out), (ytmp, y_out)):
            if tmp is not None:
                out[at:at + 1] = tmp        # NumPy's cast, as the HDF5 path casts
        self.fast_reads += 1
        return True

    def _pread(self, path: str, named: str, found: tuple, x_out, y_out, at: int) -> None:
        """A file whose offsets an earlier HDF5 open recorded: one pread per dataset."""
        fd = _open_fd(path, named)
        try:
            for off, out, dtype, shape, nb in ((found[0], x_out, self.x_dtype, self.ref.x_shape, self.x_nbytes),
                                               (found[1], y_out, self.y_dtype, self.ref.y_shape, self.y_nbytes)):
                if out is None:
                    continue
                view, tmp = _bytes_of(out, at, dtype, shape)
                got = os.preadv(fd, [view], off)
                if got != nb:
                    raise DataError(f"short read of data file {named!r}: {got} of {nb} bytes (the file "
                                    f"changed while training?)")
                if tmp is not None:
                    out[at:at + 1] = tmp
        except OSError as e:
            raise DataError(f"reading data file {named!r} failed: {e}") from None
        finally:
            os.close(fd)


def _open_fd(path: str, named: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:       # the words HDF5's path uses (data/hdf5.py)
        raise DataError(f"dataset file {named!r} does not exist") from None
    except OSError as e:
        raise DataError(f"cannot open data file {named!r}: {e.strerror}") from None


def _size_of(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None
