"""A file set's rows read into caller-owned buffers, for `data.cache=stream` (no MPI).

:class:`SetSource` has :class:`~hpc_rlx.data.stream.RowSource`'s reading interface over a
:class:`~hpc_rlx.data.fileset.FileSet`: sorted global rows are split by file and each file's
part read by that file's RowSource. A few files stay open (a window draws from neighbouring
files); each file is checked against the set's datasets when it is opened.

One-sample files (`data.one_sample_per_file`) are many and small: they go through
:class:`~hpc_rlx.data.one_sample.OneSampleReader`, which opens HDF5 only for a file unlike those
it has read, and reads the others with one `preadv` (a few microseconds instead of a few hundred).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from hpc_rlx.data.files import Meta, check_unchanged
from hpc_rlx.data.fileset import FileSet
from hpc_rlx.data.one_sample import OneSampleReader
from hpc_rlx.data.stream import RowSource

__all__ = ["SetSource"]

_KEEP_OPEN = 8      # multi-sample files held open at once


class SetSource:
    """Rows of a file set, each file's datasets like `ref` (else one DataError naming it). Not
    shared between threads: each thread that reads opens its own."""

    def __init__(self, files: FileSet, x_name: str, y_name: str, ref: Meta, ref_path: str,
                 offsets: dict | None = None):
        self.files, self.x_name, self.y_name, self.ref, self.ref_path = files, x_name, y_name, ref, ref_path
        self.path = files.paths[0] if len(files) == 1 else ref_path
        self.n = files.n
        self.x_shape, self.y_shape = tuple(ref.x_shape), tuple(ref.y_shape)
        self.x_dtype, self.y_dtype = np.dtype(ref.x_dtype), np.dtype(ref.y_dtype)
        self.x_bytes = self.x_dtype.itemsize * int(np.prod(self.x_shape, dtype=np.int64))
        self.y_bytes = self.y_dtype.itemsize * int(np.prod(self.y_shape, dtype=np.int64))
        self.row_bytes = self.x_bytes + self.y_bytes
        self._open: OrderedDict[int, RowSource] = OrderedDict()
        # one-sample files: `offsets` (path -> (x, y) offsets, or None: HDF5 reads it) may be
        # shared between the sources of one run, so the start-up check's opens serve every later
        # read (entries are only ever added: safe across the reader threads)
        self._one = OneSampleReader(x_name, y_name, ref, ref_path, offsets)

    def empty(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return (np.empty((rows,) + self.x_shape, dtype=self.x_dtype),
                np.empty((rows,) + self.y_shape, dtype=self.y_dtype))

    def source(self, k: int) -> RowSource:
        """File k's RowSource, opened (and checked) if it is not open."""
        src = self._open.get(k)
        if src is not None:
            self._open.move_to_end(k)
            return src
        files = self.files
        src = RowSource(files.opened(k), self.x_name, self.y_name, files.one_sample)
        try:
            got = Meta(src.n, src.x_shape, src.x_dtype, src.y_shape, src.y_dtype)
            check_unchanged(got, files, k, self.ref, self.ref_path, self.x_name, self.y_name)
        except BaseException:
            src.close()
            raise
        self._open[k] = src
        while len(self._open) > (1 if files.one_sample else _KEEP_OPEN):
            self._open.popitem(last=False)[1].close()
        return src

    def check(self, start: int, stop: int) -> None:
        """Open (metadata only) and check every file holding rows [start, stop)."""
        for k in self.files.files_in(start, stop):
            self._probe(k) if self.files.one_sample else self.source(k)

    def _probe(self, k: int) -> None:
        """A one-sample file's first open, its labels read: checked, its layout learnt for later reads."""
        self._read_one(k, None, np.empty((1,) + self.y_shape, self.y_dtype), 0)

    def _read_one(self, k: int, x_out, y_out, at: int) -> None:
        self._one.read(self.files.opened(k), self.files.named(k), x_out, y_out, at)

    def read(self, rows: np.ndarray, x_out: np.ndarray, y_out: np.ndarray, at: int = 0) -> None:
        """Global rows `rows` (sorted, distinct) into x_out/y_out[at : at + len(rows)]."""
        for k, local, a, b in self.files.split(rows):
            if self.files.one_sample:
                self._read_one(k, x_out, y_out, at + a)
            else:
                self.source(k).read(local, x_out, y_out, at + a)

    def read_range(self, start: int, stop: int, x_out, y_out: np.ndarray, at: int = 0) -> None:
        """Global rows [start, stop) into x_out/y_out[at:]; x_out None: the labels alone."""
        for p in self.files.pieces(start, stop):
            if self.files.one_sample:
                self._read_one(p.file, x_out, y_out, at + p.at)
            else:
                self.source(p.file).read_range(p.lo, p.hi, x_out, y_out, at + p.at)

    def decode_factor(self, window_rows: int, span_rows: int) -> float:
        """As RowSource's, for the first file (the files are alike)."""
        return self.source(0).decode_factor(window_rows, span_rows)

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()
