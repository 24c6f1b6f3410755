"""Reading ahead for ``data.cache=stream`` (HDF5 only, no MPI: MPI stays on the main thread).

- :class:`RowSource` reads sorted row lists and row ranges of x and y into given buffers, in
  pieces, so one call never holds the GIL (h5py keeps it during a read) for long;
- :class:`Prefetcher` runs read jobs in order on one background thread, each into a free slot
  of a fixed ring: memory is the ring's, whatever the dataset's size;
- :func:`scan_rows` checks values the way ``check_values`` does, block by block from the file.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable, Iterable

import numpy as np
from h5py import h5d

from hpc_rlx.data.hdf5 import TokenVocab, check_values, open_dataset_file
from hpc_rlx.base.errors import DataError

__all__ = ["RowSource", "Prefetcher", "Slot", "scan_rows"]

# one h5py call reads at most this many bytes: the main thread waits at most about that long
# for the GIL while the reader works
_PIECE_BYTES = 1 << 20
# raw reads: a gap up to this many bytes is read through (a syscall costs about as much as
# copying 10-20 KiB from the page cache); spans read through gaps stay under _SPAN_BYTES
_GAP_BYTES = 16 << 10
_SPAN_BYTES = 1 << 20


def _row_nbytes(out: np.ndarray) -> int:
    return out.itemsize * int(np.prod(out.shape[1:], dtype=np.int64))


def _spans(rows: np.ndarray, rb: int) -> list[tuple[int, int, bool]]:
    """Sorted rows -> (a, b, gappy) spans for one pread each: neighbours join a span when the
    gap between them is under _GAP_BYTES (reading through it is cheaper than a syscall) and
    the span stays under _SPAN_BYTES (the scratch buffer)."""
    gap_rows = _GAP_BYTES // max(1, rb)
    span_rows = max(1, _SPAN_BYTES // max(1, rb))
    cut = np.flatnonzero(np.diff(rows) - 1 > gap_rows) + 1
    first = np.concatenate(([0], cut))
    stop = np.concatenate((cut, [len(rows)]))
    width = rows[stop - 1] - rows[first] + 1
    out = []
    for a, b, wd in zip(first.tolist(), stop.tolist(), width.tolist()):
        if wd <= span_rows:
            out.append((a, b, wd != b - a))
            continue
        while a < b:      # wider than the scratch buffer: cut where the span fills it
            e = max(a + 1, min(b, a + int(np.searchsorted(rows[a:b], rows[a] + span_rows))))
            out.append((a, e, int(rows[e - 1]) - int(rows[a]) + 1 != e - a))
            a = e
    return out


def _raw_offset(d) -> int | None:
    """The file offset of a dataset stored as plain native bytes, else None (chunked,
    filtered, external, not yet written, or another byte order: HDF5 must read it)."""
    try:
        plist = d.id.get_create_plist()
        if (d.chunks is not None or plist.get_layout() != h5d.CONTIGUOUS or plist.get_nfilters()
                or plist.get_external_count() or not d.dtype.isnative or d.dtype.kind not in "biuf"):
            return None
        return d.id.get_offset()
    except (AttributeError, OSError, ValueError, TypeError):
        return None


class RowSource:
    """One open HDF5 file's x and y, read into caller-owned buffers (native byte order, as
    stored). Not shared between threads: each thread that reads opens its own."""

    def __init__(self, path, x_name: str, y_name: str, one_sample: bool = False):
        self.path = os.fspath(path)
        self.file = open_dataset_file(self.path)
        # one_sample: the datasets are one sample without a sample axis (read as row 0)
        self.one_sample = one_sample
        try:
            self.dx, self.dy = self.file[x_name], self.file[y_name]
        except KeyError as e:
            self.file.close()
            raise DataError(f"data file {self.path!r} has no dataset {e}") from None
        self.n = 1 if one_sample else int(self.dx.shape[0])
        lead = 0 if one_sample else 1
        self.x_shape, self.y_shape = tuple(self.dx.shape[lead:]), tuple(self.dy.shape[lead:])
        self.x_dtype = self.dx.dtype.newbyteorder("=")
        self.y_dtype = self.dy.dtype.newbyteorder("=")
        self.row_bytes = (self.x_dtype.itemsize * int(np.prod(self.x_shape, dtype=np.int64))
                          + self.y_dtype.itemsize * int(np.prod(self.y_shape, dtype=np.int64)))
        self.piece = max(1, _PIECE_BYTES // max(1, self.row_bytes))
        self._fd = None
        self._scratch = None
        self._raw = [_raw_offset(self.dx), _raw_offset(self.dy)]
        if None not in self._raw and not one_sample:
            self._fd = os.open(self.path, os.O_RDONLY)
            if not self._raw_matches():
                self._close_fd()

    def empty(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return (np.empty((rows,) + self.x_shape, dtype=self.x_dtype),
                np.empty((rows,) + self.y_shape, dtype=self.y_dtype))

    def _read_one(self, x_out, y_out, at: int) -> None:
        try:
            # a (1, *shape) slice: HDF5 needs equal element counts, and out[at] of a 1-d
            # buffer is a NumPy scalar, not a view
            if x_out is not None:
                self.dx.read_direct(x_out[at:at + 1])
            self.dy.read_direct(y_out[at:at + 1])
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"reading {self.path!r} failed: {e}") from None

    def read(self, rows: np.ndarray, x_out: np.ndarray, y_out: np.ndarray, at: int = 0) -> None:
        """File rows `rows` (sorted, distinct) into x_out/y_out[at : at + len(rows)]."""
        if self.one_sample:
            return self._read_one(x_out, y_out, at) if len(rows) else None
        if self._fd is not None and len(rows):
            for off, out in zip(self._raw, (x_out, y_out)):
                self._pread(off, rows, _spans(rows, _row_nbytes(out)), out, at)
            return
        try:
            for a in range(0, len(rows), self.piece):
                part = rows[a:a + self.piece]
                lo, hi = int(part[0]), int(part[-1]) + 1
                # a run of neighbours is one hyperslab; else one point list (HDF5 merges reads)
                src = np.s_[lo:hi] if hi - lo == len(part) else np.s_[part]
                dst = np.s_[at + a:at + a + len(part)]
                self.dx.read_direct(x_out, source_sel=src, dest_sel=dst)
                self.dy.read_direct(y_out, source_sel=src, dest_sel=dst)
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"reading {len(rows)} rows of {self.path!r} failed: {e}") from None

    def read_range(self, start: int, stop: int, x_out, y_out: np.ndarray, at: int = 0) -> None:
        """Rows [start, stop) into x_out/y_out[at:]; x_out None: the labels alone."""
        if self.one_sample:
            return self._read_one(x_out, y_out, at) if stop > start else None
        if self._fd is not None and stop > start and x_out is None:
            self._pread(self._raw[1], np.arange(start, stop), [(0, stop - start, False)], y_out, at)
            return
        if self._fd is not None and stop > start:
            rows = np.arange(start, stop)
            for off, out in zip(self._raw, (x_out, y_out)):
                self._pread(off, rows, [(0, stop - start, False)], out, at)
            return
        try:
            for a in range(start, stop, self.piece):
                b = min(stop, a + self.piece)
                dst = np.s_[at + a - start:at + b - start]
                if x_out is not None:
                    self.dx.read_direct(x_out, source_sel=np.s_[a:b], dest_sel=dst)
                self.dy.read_direct(y_out, source_sel=np.s_[a:b], dest_sel=dst)
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"reading rows [{start}, {stop}) of {self.path!r} failed: {e}") from None

    def decode_factor(self, window_rows: int, span_rows: int) -> float:
        """Bytes HDF5 decodes per byte used when a window reads `window_rows` rows spread over
        `span_rows`: 1 unless x is compressed in chunks, then the chunks a window touches
        (a shuffled step draws from every part of the shard) over what it uses."""
        try:
            filtered = self.dx.chunks is not None and self.dx.id.get_create_plist().get_nfilters() > 0
        except (AttributeError, OSError, ValueError):
            return 1.0
        if not filtered or window_rows <= 0:
            return 1.0
        per = int(self.dx.chunks[0])
        chunks = max(1, -(-span_rows // per))
        touched = chunks * (1.0 - (1.0 - 1.0 / chunks) ** window_rows)
        return max(1.0, touched * min(per, span_rows) / window_rows)

    # Contiguous, unfiltered, native-order datasets are plain bytes at a known offset of the
    # file: one pread per run of neighbouring rows, which releases the GIL and costs a
    # syscall, where an HDF5 point selection costs microseconds per row under the GIL.
    def _pread(self, off: int, rows: np.ndarray, spans, out: np.ndarray, at: int) -> None:
        """Rows into out[at:], one pread per span (a, b, gappy): rows[a:b] lie in the file
        between rows[a] and rows[b-1]; a gappy span is read whole into the scratch buffer and
        its rows picked out, cheaper than a syscall each when the gaps are small."""
        rb = _row_nbytes(out)
        view = memoryview(out.reshape(-1).view(np.uint8))
        for a, b, gappy in spans:
            lo, hi = int(rows[a]), int(rows[b - 1]) + 1
            if gappy:
                if self._scratch is None:
                    self._scratch = np.empty(_SPAN_BYTES, dtype=np.uint8)
                dst = memoryview(self._scratch)[:(hi - lo) * rb]
            else:
                dst = view[(at + a) * rb:(at + b) * rb]
            try:
                got = os.preadv(self._fd, [dst], off + lo * rb)
            except OSError as e:
                raise DataError(f"reading rows of {self.path!r} failed: {e}") from None
            if got != len(dst):
                raise DataError(f"short read of {self.path!r}: {got} of {len(dst)} bytes at row {lo} "
                                "(the file changed while training?)")
            if gappy:
                picked = self._scratch[:(hi - lo) * rb].reshape(hi - lo, rb)[rows[a:b] - lo]
                out.reshape(len(out), -1).view(np.uint8)[at + a:at + b] = picked

    def _raw_matches(self) -> bool:
        """The raw path reads what HDF5 reads (checked once, on the first and last rows)."""
        if self.n == 0:
            return False
        rows = np.array([0, self.n - 1]) if self.n > 1 else np.array([0])
        hx, hy = self.empty(len(rows))
        rx, ry = self.empty(len(rows))
        for i, r in enumerate(rows.tolist()):
            self.dx.read_direct(hx, source_sel=np.s_[r:r + 1], dest_sel=np.s_[i:i + 1])
            self.dy.read_direct(hy, source_sel=np.s_[r:r + 1], dest_sel=np.s_[i:i + 1])
        try:
            for off, out in zip(self._raw, (rx, ry)):
                self._pread(off, rows, [(i, i + 1, False) for i in range(len(rows))], out, 0)
        except DataError:
            return False
        return hx.tobytes() == rx.tobytes() and hy.tobytes() == ry.tobytes()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close_fd()
        try:
            self.file.close()
        except (OSError, ValueError):
            pass


class Slot:
    """One buffer of the ring: x and y for up to `rows` samples, and what the job put there."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y
        self.job = None
        self.info = None


_END = object()


class Prefetcher:
    """Runs `fill(job, slot)` for each job of `jobs`, in order, on a background thread, each
    into a free slot; `next()` hands (job, slot) over in the same order, `release(slot)` gives
    the slot back. At most len(slots) jobs are ever read ahead. Errors of the thread come out
    of `next()` as DataError."""

    def __init__(self, jobs: Iterable, fill: Callable, slots: list[Slot], name: str = "hpc_rlx-stream",
                 opener: Callable[[], RowSource] | None = None):
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        for s in slots:
            self._free.put(s)
        self._stop = threading.Event()
        self._jobs, self._fill, self._opener = jobs, fill, opener
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        source = None
        try:
            source = self._opener() if self._opener else None   # h5py handles stay in this thread
            for job in self._jobs:
                slot = self._free.get()
                if self._stop.is_set() or slot is None:
                    return
                slot.job = job
                slot.info = self._fill(source, job, slot)
                self._ready.put(slot)
            self._ready.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._ready.put(e)
        finally:
            if source is not None:
                source.close()

    def next(self) -> Slot | None:
        """The next filled slot, or None when the jobs are done."""
        item = self._ready.get()
        if item is _END:
            self._ready.put(_END)
            return None
        if isinstance(item, BaseException):
            self._ready.put(item)      # every later call fails the same way
            if isinstance(item, DataError):
                raise item
            raise DataError(f"reading ahead failed: {type(item).__name__}: {item}") from item
        return item

    def release(self, slot: Slot) -> None:
        slot.job = slot.info = None
        self._free.put(slot)

    def close(self) -> None:
        self._stop.set()
        self._free.put(None)       # wakes a thread waiting for a slot
        self._thread.join(timeout=30)


def scan_rows(source, start: int, stop: int, num_classes, check_finite: bool,
              vocab: TokenVocab | list | None, block_bytes: int) -> None:
    """check_values over rows [start, stop) of a RowSource or SetSource, read in blocks of about
    block_bytes; x is read only when a check needs it (labels alone are small)."""
    need_x = ((check_finite and source.x_dtype.kind == "f")
              or (vocab is not None and source.x_dtype.kind in "iu"))
    if num_classes is None and not need_x:
        return
    block = max(1, block_bytes // max(1, source.row_bytes))
    n = min(block, max(0, stop - start))
    x_buf = np.empty((n if need_x else 0,) + source.x_shape, dtype=source.x_dtype)
    y_buf = np.empty((n,) + source.y_shape, dtype=source.y_dtype)
    for a in range(start, stop, block):
        b = min(stop, a + block)
        source.read_range(a, b, x_buf if need_x else None, y_buf)
        check_values(x_buf[:b - a], y_buf[:b - a], num_classes, check_finite and need_x, first_row=a,
                     vocab=vocab if need_x else None)
