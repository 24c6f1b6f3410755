"""``model.sync_batch_norm``: batch norm's sums over every lane and rank (PyTorch's SyncBatchNorm).

A training batch-norm layer hands its per-channel sums to the executor's ``sync`` hook and gets
them back summed over the global batch (``graph/ops/norm.py``: one call in its forward, one in
its backward). A rank's lanes are threads that run the same graph at the same time: each puts
its part in its slot, the last to arrive adds the slots in lane order (the same order every
step: reproducible), sums that over the ranks with one Allreduce on a communicator of its own,
and every lane takes the total.

Every lane of every rank must call the hook equally often, in the same order, or the lanes wait
forever. They do, because they run one graph: a lane runs all of a step's micro-batches
(``train.accumulate``), and a micro-batch that has no rows on a lane runs as a one-row stand-in
whose sums count as zeros (``run_stand_in``); its gradient and outputs go nowhere. A lane that
fails breaks the barrier (``abort``), so the others raise instead of waiting.
"""

from __future__ import annotations

import threading
from concurrent.futures import wait

import numpy as np

from hpc_rlx.comm.collective import watched_call


class BatchStatSum:
    """Sums small arrays over the ``lanes`` lanes of this rank, then over the ranks of ``comm``
    (a communicator used for nothing else; None or True: this rank alone). ``hook(i)`` is lane i's."""

    def __init__(self, lanes: int, comm=None):
        self.comm = None if comm is True else comm
        self._parts: list = [None] * lanes
        self._total = None
        self._barrier = threading.Barrier(lanes, action=self._reduce)
        self.calls = 0      # sums taken on this rank (the tests count them)

    def hook(self, index: int, xp) -> "LaneHook":
        return LaneHook(self, index, xp)

    def _reduce(self) -> None:
        """Run by the last lane to arrive, while the others wait."""
        total = self._parts[0].copy()
        for part in self._parts[1:]:
            total += part
        if self.comm is not None:
            summed = np.empty_like(total)
            watched_call("sync batch norm Allreduce", self.comm.Allreduce, total, summed)   # op: SUM
            total = summed
        self._total = total
        self.calls += 1

    def contribute(self, index: int, part: np.ndarray) -> np.ndarray:
        """Lane ``index``'s part in; once every lane's is in, their sum over the ranks out."""
        self._parts[index] = part
        self._barrier.wait()
        return self._total

    def start_step(self) -> None:
        """Before a step: a barrier a failed step broke is whole again."""
        if self._barrier.broken:
            self._barrier.reset()

    def abort(self) -> None:
        """A lane failed: the lanes waiting for it raise ``threading.BrokenBarrierError``."""
        self._barrier.abort()


class LaneHook:
    """Lane ``index``'s ``sync``: its part in, the sum over the global batch out (on its own
    array module). While ``idle`` (a stand-in micro-batch) its part counts as zeros."""

    __slots__ = ("owner", "index", "xp", "idle")

    def __init__(self, owner: BatchStatSum, index: int, xp):
        self.owner, self.index, self.xp, self.idle = owner, index, xp, False

    def __call__(self, part):
        part = np.array(part, dtype=np.float64)      # a copy the other lanes may read
        if self.idle:
            part[...] = 0.0
        return self.xp.array(self.owner.contribute(self.index, part))      # each lane its own copy

    def abort(self) -> None:
        self.owner.abort()


def run_stand_in(lane, x, y, seed: int) -> None:
    """Micro-batch without rows on ``lane``: one row of zeros runs the graph so that the lane takes
    part in every batch-norm sum, contributing zeros; its gradient goes to scratch arrays and its
    outputs are dropped (a zero row may give a NaN loss: never seen)."""
    if lane.scratch_grads is None:
        lane.scratch_grads = {name: lane.xp.zeros_like(v) for name, v in lane.grad_views.items()}
    xs = lane.xp.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype)
    ys = lane.xp.zeros((1,) + tuple(y.shape[1:]), dtype=y.dtype)
    lane.sync.idle = True
    try:
        with np.errstate(all="ignore"):
            lane.executor.forward_backward(lane.param_views, lane.scratch_grads, {"x": xs, "y": ys},
                                           train=True, seed=seed, grad_scale=0.0, sync=lane.sync)
    finally:
        lane.sync.idle = False


def results_of(futures) -> list:
    """The lanes' results in order, once all finished. A lane's own error is raised in
    preference to the barrier errors it caused in the lanes that waited for it."""
    wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return [f.result() for f in futures]
