"""The pipelined step behind the interface the loop already drives: ``PipelineLanes`` stands
where ``device.lanes.LaneSet`` stands (``step``, ``evaluate``, ...), ``PipelineBucket`` where
the fused bucket stands, so ``policy=sync`` runs a pipelined job unchanged.

One step, policy ``sync``, on a rank of stage s:

1. ``PipelineLanes.step`` runs the stage's micro-batches (``engine.StageEngine``); the stage's
   sample-weighted gradients land in the bucket's payload; it returns the replica's rows, loss
   sum and correct count (the last stage's, passed down with the gradients).
2. The policy writes the tail (samples, loss sum, correct, this rank's flags) as today.
3. ``PipelineBucket.allreduce``: the flags that came down the pipeline are raised in the tail
   (stage 0 then holds every flag of its replica), one fused Allreduce sums gradients and tail
   over the stage's replicas (the data-parallel communicator of the stage), then stage 0's
   reduced tail is broadcast up each pipeline (``Bcast`` on the pipeline communicator, a few
   numbers). This Bcast is the one message per step beyond the activations, their gradients
   and the stage's Allreduce: stage 0 is the only stage that has heard every stage (flags
   travel down with the gradients), and the stages above it have sent their last message
   before stage 0's own checks (its gradients' finiteness, rank 0's checkpoint clock) are
   known. After it every rank holds the same tail, so stop, skip-non-finite and
   checkpoint-due are decided the same way on every rank in the same step, and the samples,
   loss and accuracy every rank reads are the job's.
"""

from __future__ import annotations

import time

import numpy as np

from hpc_rlx.observe import trace


class _StageLane:
    """What the loop reads of a lane (``name``, ``samples``, ``busy_s``)."""

    def __init__(self, name: str):
        self.name, self.samples, self.busy_s = name, 0, 0.0


class PipelineLanes:
    overlap_capable = False

    def __init__(self, engine, params_flat, layout, bucket, stop_raised=lambda: False):
        self.engine, self.layout = engine, layout
        self.params = params_flat
        self.param_views = layout.views(params_flat)
        self.bucket = bucket
        self.grad_views = layout.views(bucket.payload)
        self.stop_raised = stop_raised
        name = f"cpu0 (stage {engine.stage}/{engine.stages})"
        self.lanes = [_StageLane(name)]
        self.names = [name]
        self.bucket_path = (f"pipeline stage {engine.stage} of {engine.stages}, {engine.schedule}, "
                            f"{engine.micro} micro-batches, {engine.slots} buffer slot(s) per direction")

    def step(self, x, y, seed: int, on_grad_ready=None):
        t0 = time.perf_counter()
        feeds = {"x": x, "y": y}
        n, loss_sum, correct = self.engine.step(self.param_views, self.bucket.payload, self.grad_views,
                                                feeds, seed, self.stop_raised())
        dt = time.perf_counter() - t0
        ln = self.lanes[0]
        ln.samples += n
        ln.busy_s += dt
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("pipeline step", "compute", trace.MAIN, t0, t0 + dt, {"n": n})
        return n, loss_sum, correct, dt

    def evaluate(self, x, y, batch: int = 1024):
        return self.engine.evaluate(self.param_views, {"x": x, "y": y})

    def refresh_device_params(self) -> None:
        pass

    def close(self) -> None:
        pass


class PipelineBucket:
    """The stage's fused bucket, reduced over the stage's replicas, its tail then agreed along
    the pipeline (see the module docstring). Everything else is the wrapped bucket's."""

    def __init__(self, bucket, comms, engine):
        self._bucket, self._comms, self._engine = bucket, comms, engine

    def __getattr__(self, name):
        return getattr(self._bucket, name)

    def __getitem__(self, field):
        return self._bucket[field]

    def __setitem__(self, field, value) -> None:
        self._bucket[field] = value

    def allreduce(self, comm=None, reduction=None) -> float:
        b = self._bucket
        for flag, raised in self._engine.upstream.items():
            if raised:
                b[flag] = max(b[flag], 1.0)
        dt = b.allreduce(self._comms.data, reduction)
        t0 = time.perf_counter()
        self._comms.pipe.Bcast(b.tail, root=0)
        t1 = time.perf_counter()
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("tail bcast", "comm", trace.MAIN, t0, t1)
        return dt + (t1 - t0)


def gather_evaluation(comms, buf: np.ndarray) -> np.ndarray:
    """Validation sums live on the last stage: after the stage's Allreduce, every rank takes
    the last stage's (one Bcast on the pipeline communicator)."""
    comms.pipe.Bcast(buf, root=comms.stages - 1)
    return buf
