"""A rank's training batches and validation data.

`data.cache=memory` holds the rank's shard and validation slice (read or scattered once,
`data/distribute.py`); `data.cache=stream` holds a bounded ring of buffers that a background
thread fills from the file a few windows of steps ahead (`data/stream.py`). Both hand out the
same bytes for the same position: a window's rows are the samples its steps use
(`plan.EpochOrder.window`), read sorted in a few calls, and each step gathers its batch from
them in the order the plan gives, as memory mode gathers from the shard.

A position is `pass * steps_per_epoch + step` (policy=sync: pass = epoch; the windowed policies
walk their shard in successive passes).
"""

from __future__ import annotations

import resource
import time

import numpy as np

from hpc_rlx.comm import collective
from hpc_rlx.base.topology import hostname, ranks_per_node
from hpc_rlx.data.distribute import load_shard
from hpc_rlx.data.files import plan_files
from hpc_rlx.data.hdf5 import Classes, TokenVocab, check_values
from hpc_rlx.data.memory_room import rank_room, shard_problem
from hpc_rlx.data.model_inputs import PackedSource, load_packed
from hpc_rlx.data.plan import EpochOrder, eval_batch_rows, window_of, window_steps
from hpc_rlx.data.stage_plan import rank_ranges, read_places
from hpc_rlx.data.set_source import SetSource
from hpc_rlx.data.stream import Prefetcher, Slot, scan_rows
from hpc_rlx.base.errors import DataError
from hpc_rlx.graph.loss_options import loss_head
from hpc_rlx.graph.onnx.packed_inputs import input_vocabs
from hpc_rlx.graph.shapes import FLOAT

CACHES = ("memory", "stream")
SLOT_BYTES = 8 << 20     # one buffer of the ring: a window of steps, or a validation chunk
RING = 3                 # buffers per reader: the window in use, one ready, one being read


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def feed_eval_batch(spec, plan) -> int:
    """`data.plan.eval_batch_rows` for this run: a data-parallel step splits a rank's batch into
    `train.accumulate` micro-batches, a pipelined one into `parallel.microbatches`."""
    stages = int((spec.parallel or {}).get("pipeline_stages", 1))
    splits = (int(spec.train.get("accumulate") or 1) if stages == 1
              else int(spec.parallel.get("microbatches") or 1))
    return eval_batch_rows(plan.global_batch, plan.world_size, splits, spec.train.get("eval_batch_size"))


def even_bounds(start: int, stop: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) cut into `world` contiguous ranges, the first ones one row longer."""
    per, more = divmod(stop - start, world)
    out, lo = [], start
    for r in range(world):
        hi = lo + per + (1 if r < more else 0)
        out.append((lo, hi))
        lo = hi
    return out


def with_empty_ranks(bounds: list[tuple[int, int]], ranks: int) -> list[tuple[int, int]]:
    """`bounds`, one range per rank that holds rows, then empty ranges up to `ranks`."""
    end = bounds[-1][1] if bounds else 0
    return list(bounds) + [(end, end)] * (ranks - len(bounds))


def _no_failure(point: str, step: int | None = None) -> None:
    """No failure injected (debug.fail_point unset)."""


class Feed:
    """What both caches share: the plan's orders, the per-batch cast, validation bounds."""

    cache = "memory"

    def __init__(self, spec, comm, graph, plan, fail_at=None):
        self.spec, self.comm, self.d = spec, comm, spec.data
        # debug.fail_point=scatter: where rank 0 sends the ranks their rows (`DebugHooks.fail_at`)
        self.fail_at = fail_at or _no_failure
        # ranks past the plan's (comm.on_failure=spare's spares) hold no rows
        self.rank, self.world = comm.rank, plan.world_size
        self.plan, self.steps = plan, plan.steps_per_epoch
        self.dtype = np.dtype(spec.train["dtype"])
        # validation is evaluated, and summed, per batch of this many rows (whatever data.cache)
        self.eval_batch = feed_eval_batch(spec, plan)
        x_in = graph.input("x")     # a pipeline stage answers for the whole model
        # integer data feeding a float model (uint8 images) stays as stored; each batch is cast
        self.float_input = x_in.dtype == FLOAT
        n = getattr(graph, "num_classes", None)      # model.ignore_index: a label exempt from the range
        self.num_classes = None if n is None else Classes(n, loss_head(graph).ignore_index)
        # token ids index an embedding: out-of-range ids would be used silently. The vocabulary
        # is the embedding table's size, not the head's classes (a token classifier has both).
        token = None if self.float_input else graph.token_vocab
        self.vocab = TokenVocab(*token) if token else None
        if getattr(self.d, "inputs", None) and not self.float_input:    # each packed input: its own table
            self.vocab = [TokenVocab(rows, table, (a, b)) for a, b, rows, table in input_vocabs(graph)] or None
        self.seed, self.shuffle = int(spec.train["seed"]), bool(self.d.shuffle)
        self.train_bounds = with_empty_ranks(plan.all_bounds(), comm.size)
        # the files of data.path / data.val_path as one set each, and what every file must hold
        self.files, self.val_files, self.expect = plan_files(self.d)
        self._offsets: dict = {}
        self.val_bounds = with_empty_ranks(even_bounds(self.d.val_start, self.d.val_stop, self.world), comm.size)
        self._order: tuple[int, EpochOrder] | None = None
        self.row_bytes = 0
        self.buffer_bytes = 0

    def read_from(self, mapping) -> None:
        """Read the files from other places (staged copies): `mapping` original path -> path to
        open (a dict or a function). Before `load`; the order and the samples do not change."""
        same = self.val_files is self.files      # validation from the tail of the same set
        self.files = self.files.remapped(mapping)
        self.val_files = self.files if same else self.val_files.remapped(mapping)

    def announce(self, t0: float) -> None:
        """Rank 0's start-up line for a data set of many files: files, samples, and the time the
        ranks took to check (and with data.cache=memory, read) them."""
        if self.rank != 0 or (len(self.files) == 1 and not self.files.one_sample):
            return
        val = ("" if self.val_files is self.files else
               f"; validation: {self.val_files.describe()} ({self.d.val_path})")
        print(f"[hpc_rlx] data: {self.files.describe()} ({self.d.path}){val}; checked"
              f"{' and read' if self.cache == 'memory' else ''} in {time.perf_counter() - t0:.2f} s", flush=True)

    def source(self, files) -> SetSource | PackedSource:
        """A reader of `files` (this feed's training or validation set) for one thread; the
        one-sample files' offsets that any of them found serve them all (`SetSource`)."""
        if getattr(self.d, "inputs", None):
            return PackedSource(files, self.d.inputs, self.d.y, *self.expect)
        return SetSource(files, self.d.x, self.d.y, *self.expect, offsets=self._offsets)

    def _load(self, files, bounds, want=None, mode: str | None = None) -> tuple:
        """This rank's (x, y) of `files`; a model of several inputs gets them packed (data/model_inputs.py)."""
        d, mode = self.d, mode or self.d.distribution
        if getattr(d, "inputs", None):
            return load_packed(self.comm, mode, files, d.inputs, d.y, bounds, self.expect)
        return load_shard(self.comm, mode, files, d.x, d.y, bounds, x_dtype=want, expect=self.expect)

    def order(self, epoch: int, rank: int | None = None) -> EpochOrder:
        return EpochOrder(self.plan, self.rank if rank is None else rank, epoch, self.seed, self.shuffle)

    def _cached_order(self, p: int) -> EpochOrder:
        if self._order is None or self._order[0] != p:
            self._order = (p, self.order(p))
        return self._order[1]

    def cast(self, x: np.ndarray) -> np.ndarray:
        if self.float_input and x.dtype != self.dtype:
            return x.astype(self.dtype)
        return x

    def target(self, y: np.ndarray) -> np.ndarray:
        """Float targets (regression: CosmoFlow's float32 parameters) in the compute dtype, as
        the graph's float label input takes them; integer labels stay as stored."""
        if y.dtype.kind == "f" and y.dtype != self.dtype:
            return y.astype(self.dtype)
        return y

    def _n_rows(self, bounds) -> int:
        a, b = bounds[self.rank]
        return b - a

    def report(self) -> dict:
        """This rank's data figures for summary.json."""
        rows = self._n_rows(self.train_bounds) + self._n_rows(self.val_bounds)
        return {"data_cache": self.cache, "shard_bytes": int(rows * self.row_bytes),
                "buffer_bytes": int(self.buffer_bytes), "peak_rss_bytes": peak_rss_bytes(),
                "eval_batch_rows": int(self.eval_batch), **self._read_places()}

    def _read_places(self) -> dict:
        """data.stage_dir: how many of the files this rank reads come from the node's copies."""
        mine = rank_ranges(self.rank, self.world, self.train_bounds, self.val_bounds,
                           self.d.distribution == "scatter")
        return read_places(list(zip((self.files, self.val_files), mine)))

    def close(self, collective_ok: bool = True) -> None:
        """Release what the feed holds; collective_ok: every rank is here (the run's end)."""


class MemoryFeed(Feed):
    """The whole shard and validation slice in memory, x already in the compute dtype when the
    file holds floats of another width (cast while reading: the shard is never held twice)."""

    def load(self) -> None:
        d, comm, t0 = self.d, self.comm, time.perf_counter()
        stored = np.dtype(d.x_dtype)
        want = self.dtype if (self.float_input and stored.kind == "f" and stored != self.dtype) else None
        # before any read: a shard over the rank's memory is killed by the kernel mid-read, with
        # no message; the same error on every rank instead
        on_node = ranks_per_node(comm)
        collective.agree(comm, lambda: self._check_room(want or stored, on_node))

        def _train():
            if d.distribution == "scatter":
                self.fail_at("scatter", 0)       # the load's scatter: before the first step
            x, y = self._load(self.files, self.train_bounds, want)
            check_values(x, y, self.num_classes, d.check_finite, first_row=self.train_bounds[self.rank][0],
                         vocab=self.vocab)
            return x, y
        # load_shard agrees on read errors itself; the value checks are agreed here
        self.x, self.y = collective.agree(comm, _train)
        self.row_bytes = row_bytes(stored, self.x.shape[1:], self.y)

        def _val():
            if d.val_stop == d.val_start:
                return self.x[:0], self.y[:0]
            x, y = self._load(self.val_files, self.val_bounds, want)
            check_values(x, y, self.num_classes, d.check_finite, first_row=self.val_bounds[self.rank][0],
                         vocab=self.vocab)
            return x, y
        self.vx, self.vy = collective.agree(comm, _val)
        self.announce(t0)

    def _check_room(self, x_dtype: np.dtype, on_node: int) -> None:
        """DataError where this rank's shard and validation slice, as held, exceed its room."""
        d = self.d
        per_row = (x_dtype.itemsize * int(np.prod(d.sample_shape, dtype=np.int64))
                   + np.dtype(d.y_dtype).itemsize * int(np.prod(d.y_shape, dtype=np.int64)))
        train, val = self._n_rows(self.train_bounds), self._n_rows(self.val_bounds)
        rows = f"{train:,} training" + (f" and {val:,} validation" if val else "") + f" rows of {per_row:,} bytes"
        problem = shard_problem((train + val) * per_row, rank_room(on_node, hostname()), rows, d.path)
        if problem:
            raise DataError(problem)

    def batch(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        p, s = divmod(position, self.steps)
        idx = self._cached_order(p).step_indices(s)
        return self.cast(self.x[idx]), self.target(self.y[idx])

    def no_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """A batch of no rows (a spare's), shaped as every batch is."""
        return self.cast(self.x[:0]), self.target(self.y[:0])

    def val_batches(self):
        step = self.eval_batch
        for lo in range(0, len(self.vx), step):
            yield self.cast(self.vx[lo:lo + step]), self.target(self.vy[lo:lo + step])


def row_bytes(x_dtype, x_shape, y: np.ndarray) -> int:
    return (np.dtype(x_dtype).itemsize * int(np.prod(x_shape, dtype=np.int64))
            + y.dtype.itemsize * int(np.prod(y.shape[1:], dtype=np.int64)))


class StreamFeed(Feed):
    """data.distribution=read: each rank reads its own windows, a background thread ahead."""

    cache = "stream"
    _pre: Prefetcher | None = None
    _cur: Slot | None = None

    def load(self) -> None:
        comm, t0 = self.comm, time.perf_counter()
        empty = [(0, 0)] * self.world
        # the shapes and stored dtypes; the files are opened and checked by _scan_mine
        x0, y0 = self._load(self.files, empty, mode="read")
        self.row_bytes = row_bytes(x0.dtype, x0.shape[1:], y0)
        self._geometry(x0, y0)
        collective.agree(comm, self._scan_mine)
        if self.rank == 0:
            self._warn_if_compressed(self.slot_rows, self._n_rows(self.train_bounds))
        self.announce(t0)

    def _scan_mine(self) -> None:
        """The value checks of memory mode, block by block from the file (labels are small;
        inputs are read only when check_finite or a token model asks)."""
        d = self.d
        for files, bounds in ((self.files, self.train_bounds), (self.val_files, self.val_bounds)):
            a, b = bounds[self.rank]
            if b > a:
                src = self.source(files)
                try:
                    src.check(a, b)     # every file this rank reads: its datasets (metadata only)
                    scan_rows(src, a, b, self.num_classes, d.check_finite, self.vocab, SLOT_BYTES)
                finally:
                    src.close()

    def _warn_if_compressed(self, window_rows: int, span_rows: int) -> None:
        """A shuffled window draws from every chunk of the shard: with compressed chunks each
        window decodes most of the shard. Said once, with the way out."""
        src = self.source(self.files)
        try:
            factor = src.decode_factor(window_rows, span_rows)
        finally:
            src.close()
        if factor > 4:
            print(f"[hpc_rlx] data.cache=stream: {self.d.path}'s inputs are compressed in chunks, and "
                  f"each window of {window_rows} shuffled rows decodes about {factor:.0f}x its size; "
                  f"for streaming, rewrite the file contiguous (h5repack -l CONTI in.h5 out.h5), or use "
                  f"data.cache=memory", flush=True)

    def _geometry(self, x0, y0) -> None:
        batch = self.plan.rank_batch(self.rank)
        self.w = window_steps(self.steps, batch * self.row_bytes, SLOT_BYTES)
        self.slot_rows = self.w * batch
        # a whole number of evaluation batches per chunk (the sums' order), or the whole slice
        self.val_rows = min(max(1, SLOT_BYTES // max(1, self.row_bytes) // self.eval_batch) * self.eval_batch,
                            max(1, max(b - a for a, b in self.val_bounds)))
        self._shapes = (x0.shape[1:], x0.dtype, y0.shape[1:], y0.dtype)
        self.buffer_bytes = (RING * self.slot_rows + 2 * self.val_rows) * self.row_bytes

    def _slots(self, rows: int, count: int = RING) -> list[Slot]:
        xs, xd, ys, yd = self._shapes
        return [Slot(np.empty((rows,) + tuple(xs), dtype=xd), np.empty((rows,) + tuple(ys), dtype=yd))
                for _ in range(count)]

    def _opener(self, files):
        return lambda: self.source(files)

    def _windows(self, p: int, start: int, rank: int):
        """(pass, Window) from window `start` of pass `p` on, for ever (runs on the reader)."""
        while True:
            order = self.order(p, rank)
            for a in range(start, self.steps, self.w):
                yield p, order.window(a, min(a + self.w, self.steps))
            p, start = p + 1, 0

    def _fill_window(self, source: SetSource, job, slot: Slot):
        p, win = job
        source.read(win.rows + self.train_bounds[self.rank][0], slot.x, slot.y)
        return win

    def batch(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        p, s = divmod(position, self.steps)
        cur = self._cur
        if cur is None or cur.job[0] != p or not cur.info.start <= s < cur.info.stop:
            cur = self._advance(p, s)
        pos = cur.info.positions(s)
        return self.cast(cur.x[pos]), self.target(cur.y[pos])

    def _advance(self, p: int, s: int) -> Slot:
        start = window_of(s, self.steps, self.w)[0]
        if self._cur is not None:
            self._pre.release(self._cur)
            self._cur = None
        slot = self._pre.next() if self._pre is not None else None
        if slot is None or slot.job[0] != p or slot.info.start != start:
            # the first batch, or a jump (a resume): read ahead from here
            self._stop_reader()
            self._pre = Prefetcher(self._windows(p, start, self.rank), self._fill_window,
                                   self._slots(self.slot_rows), opener=self._opener(self.files))
            slot = self._pre.next()
        self._cur = slot
        return slot

    def _stop_reader(self) -> None:
        if self._pre is not None:
            self._pre.close()
        self._pre, self._cur = None, None

    def val_batches(self):
        a, b = self.val_bounds[self.rank]
        if b <= a:
            return
        jobs = [(lo, min(b, lo + self.val_rows)) for lo in range(a, b, self.val_rows)]
        pre = Prefetcher(jobs, lambda src, job, slot: src.read_range(*job, slot.x, slot.y),
                         self._slots(min(self.val_rows, b - a), 2), name="hpc_rlx-val",
                         opener=self._opener(self.val_files))
        try:
            while (slot := pre.next()) is not None:
                n = slot.job[1] - slot.job[0]
                for lo in range(0, n, self.eval_batch):
                    hi = min(n, lo + self.eval_batch)
                    yield self.cast(slot.x[lo:hi]), self.target(slot.y[lo:hi])
                pre.release(slot)
        finally:
            pre.close()

    def close(self, collective_ok: bool = True) -> None:
        self._stop_reader()

