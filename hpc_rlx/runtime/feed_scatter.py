"""`data.cache=stream` with `data.distribution=scatter`: rank 0 streams every rank its windows.

Rank 0's background thread reads each window's rows of all ranks (sorted, so rank-major:
the shards are contiguous and in rank order) into a ring of send buffers; the main threads
hand them out with non-blocking `Iscatterv` on a communicator of their own, one round per
window, the next round in flight while the current window trains. Every MPI call is on the
main thread and the reader thread only touches HDF5, so MPI_THREAD_FUNNELED suffices: mpi4py
asks for MPI_THREAD_MULTIPLE (MPICH 5.0 and Open MPI 5.0 grant it here), but builds that grant
less, or pay for MULTIPLE with locks, are fine. Progress: MPICH advances a non-blocking
collective only inside MPI calls; each step's Allreduce is one, so a round completes behind
the window's steps.

Rounds are collective, so every rank must ask for the same positions in the same order:
true of policy=sync (every step a sync). The windowed policies' ranks walk their shards at
their own pace; the spec refuses them with this mode (`config/spec.py`).
Validation: blocking `Scatterv` rounds of whole evaluation batches at the epoch's end, rank 0
reading the next round while the ranks evaluate the current one.
"""

from __future__ import annotations

import math
import time

import numpy as np

from hpc_rlx.comm import collective
from hpc_rlx.data.plan import window_of, window_steps
from hpc_rlx.data.set_source import SetSource
from hpc_rlx.data.stream import Prefetcher, Slot, scan_rows
from hpc_rlx.base.errors import DataError
from hpc_rlx.runtime.feed import RING, SLOT_BYTES, StreamFeed, row_bytes

AHEAD = 1            # rounds in flight beyond the window in use
_INT_MAX = 2**31 - 1  # MPI counts and displacements are C ints


class _Round:
    def __init__(self, key, slot, reqs):
        self.key, self.slot, self.reqs = key, slot, reqs


class ScatterStreamFeed(StreamFeed):
    """Rank 0 reads, everyone receives its window by Iscatterv; batches as in StreamFeed."""

    dcomm = None

    def load(self) -> None:
        from mpi4py import MPI
        from mpi4py.util.dtlib import from_numpy_dtype

        d, comm, t0 = self.d, self.comm, time.perf_counter()
        empty = [(0, 0)] * self.world
        # rank 0 checks the files; every rank learns the shapes and stored dtypes
        x0, y0 = self._load(self.files, empty, mode="scatter")
        self.row_bytes = row_bytes(x0.dtype, x0.shape[1:], y0)
        self._geometry(x0, y0)
        # one window size for all: rank 0's send buffer holds the whole global batch's rows
        self.w = window_steps(self.steps, self.plan.global_batch * self.row_bytes, SLOT_BYTES)
        self.root = self.rank == 0
        self.slot_rows = self.w * (self.plan.global_batch if self.root else self.plan.rank_batch(self.rank))
        self.val_rows = min(max(1, SLOT_BYTES // max(1, self.world * self.row_bytes) // self.eval_batch) * self.eval_batch,
                            max(1, max(b - a for a, b in self.val_bounds)))
        self.x_elems, self.y_elems = math.prod(x0.shape[1:]), math.prod(y0.shape[1:])
        elems = self.w * self.plan.global_batch * max(self.x_elems, self.y_elems)
        val_elems = self.world * self.val_rows * max(self.x_elems, self.y_elems)
        if max(elems, val_elems) > _INT_MAX:
            raise DataError(f"one window of {self.w} step(s) is {elems} elements, past MPI's count "
                            f"limit: use data.distribution=read with data.cache=stream")
        self.buffer_bytes = ((RING if self.root else AHEAD + 1) * self.slot_rows
                             + 2 * self.val_rows * (self.world if self.root else 1)) * self.row_bytes
        collective.agree(comm, self._scan_all)
        if self.root:
            self._warn_if_compressed(self.slot_rows, self.plan.n_samples)
        self.types = (from_numpy_dtype(x0.dtype), from_numpy_dtype(y0.dtype))
        self.MPI = MPI
        self.dcomm = comm.Dup()       # data rounds never interleave with the training collectives
        self._inflight: list[_Round] = []
        self._free = [] if self.root else self._slots(self.slot_rows, AHEAD + 1)
        self.announce(t0)

    def _scan_all(self) -> None:
        """Rank 0 checks every rank's rows (the others may not see the file)."""
        if not self.root:
            return
        d = self.d
        for files, bounds in ((self.files, self.train_bounds), (self.val_files, self.val_bounds)):
            if bounds[-1][1] > bounds[0][0]:
                src = self.source(files)
                try:
                    src.check(bounds[0][0], bounds[-1][1])   # every file's datasets (metadata only)
                    scan_rows(src, bounds[0][0], bounds[-1][1], self.num_classes, d.check_finite,
                              self.vocab, SLOT_BYTES)
                finally:
                    src.close()

    # ---- rank 0's reader: every rank's rows of a window ----------------------------------
    def _all_windows(self, p: int, start: int):
        while True:
            orders = [self.order(p, r) for r in range(self.world)]
            for a in range(start, self.steps, self.w):
                b = min(a + self.w, self.steps)
                yield p, [o.window(a, b) for o in orders]
            p, start = p + 1, 0

    def _fill_round(self, source: SetSource, job, slot: Slot):
        _, wins = job
        rows = np.concatenate([w.rows + self.train_bounds[r][0] for r, w in enumerate(wins)])
        source.read(rows, slot.x, slot.y)
        slot.counts = [len(w.rows) for w in wins]
        return wins[0]

    # ---- rounds (main thread, every rank in the same order) ---------------------------------
    def _next_key(self, key):
        p, a = key
        return (p, a + self.w) if a + self.w < self.steps else (p + 1, 0)

    def _post(self, key) -> None:
        p, a = key
        self.fail_at("scatter", p * self.steps + a)     # the round of the window from that step
        tx, ty = self.types
        if self.root:
            slot = self._pre.next()
            if slot is None or slot.job[0] != p or slot.info.start != a:
                raise DataError(f"data stream out of order: expected window {key}")
            offs = np.concatenate(([0], np.cumsum(slot.counts)[:-1])).tolist()
            reqs = [self.dcomm.Iscatterv([buf, [c * e for c in slot.counts], [o * e for o in offs], t],
                                         self.MPI.IN_PLACE, root=0)
                    for buf, e, t in ((slot.x, self.x_elems, tx), (slot.y, self.y_elems, ty))]
        else:
            win = self._cached_order(p).window(a, min(a + self.w, self.steps))
            slot = self._free.pop()
            slot.job, slot.info = (p, win), win
            n = len(win.rows)
            reqs = [self.dcomm.Iscatterv(None, [slot.x[:n].reshape(-1), tx], root=0),
                    self.dcomm.Iscatterv(None, [slot.y[:n].reshape(-1), ty], root=0)]
        self._inflight.append(_Round(key, slot, reqs))

    def _give_back(self, slot: Slot) -> None:
        if self.root:
            self._pre.release(slot)
        else:
            slot.job = slot.info = None
            self._free.append(slot)

    def _wait(self, rnd: _Round) -> None:
        collective.watched_call("data stream Iscatterv", self.MPI.Request.Waitall, rnd.reqs)

    def _drain(self) -> None:
        for rnd in self._inflight:
            self._wait(rnd)
            self._give_back(rnd.slot)
        self._inflight = []

    def _advance(self, p: int, s: int) -> Slot:
        key = (p, window_of(s, self.steps, self.w)[0])
        if self._cur is not None:
            self._give_back(self._cur)
            self._cur = None
        if self._inflight and self._inflight[0].key == key:
            rnd = self._inflight.pop(0)
        else:
            # the first window, or a jump (a resume): every rank does this at the same batch
            self._drain()
            if self.root:
                self._stop_reader()
                self._pre = Prefetcher(self._all_windows(*key), self._fill_round,
                                       self._slots(self.slot_rows), opener=self._opener(self.files))
            self._post(key)
            rnd = self._inflight.pop(0)
        self._wait(rnd)
        self._cur = rnd.slot
        last = key
        while len(self._inflight) < AHEAD:
            last = self._next_key(self._inflight[-1].key if self._inflight else last)
            self._post(last)
        return self._cur

    # ---- validation -----------------------------------------------------------------------
    def val_batches(self):
        lens = [b - a for a, b in self.val_bounds]
        rounds = max((-(-n // self.val_rows) for n in lens), default=0)
        if rounds == 0:
            return
        c = self.val_rows
        pre = None
        if self.root:
            jobs = [[(a + k * c, min(b, a + (k + 1) * c)) for a, b in self.val_bounds] for k in range(rounds)]
            pre = Prefetcher(jobs, self._fill_val, self._slots(self.world * c, 2), name="hpc_rlx-val",
                             opener=self._opener(self.val_files))
        mine = self._slots(c, 1)[0] if not self.root else None
        tx, ty = self.types
        try:
            for k in range(rounds):
                counts = [max(0, min(c, n - k * c)) for n in lens]
                offs = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
                n = counts[self.rank]
                slot = pre.next() if self.root else mine
                for buf, e, t in ((slot.x, self.x_elems, tx), (slot.y, self.y_elems, ty)):
                    send = [buf, [q * e for q in counts], [o * e for o in offs], t] if self.root else None
                    recv = self.MPI.IN_PLACE if self.root else [buf[:n].reshape(-1), t]
                    collective.watched_call("validation Scatterv", self.comm.Scatterv, send, recv, root=0)
                for lo in range(0, n, self.eval_batch):
                    hi = min(n, lo + self.eval_batch)
                    yield self.cast(slot.x[lo:hi]), self.target(slot.y[lo:hi])
                if self.root:
                    pre.release(slot)
        finally:
            if pre is not None:
                pre.close()

    def _fill_val(self, source: SetSource, job, slot: Slot):
        at = 0
        for a, b in job:
            source.read_range(a, b, slot.x, slot.y, at=at)
            at += b - a

    # ---- the end ----------------------------------------------------------------------------
    def close(self, collective_ok: bool = True) -> None:
        """Collective (every rank, at the same point): completes the rounds in flight. With
        collective_ok=False (a failure on this rank only) it stops the reader and nothing else."""
        if collective_ok and self.dcomm is not None:
            self._drain()
        self._stop_reader()
        if collective_ok and self.dcomm is not None:
            self.dcomm.Free()
            self.dcomm = None
