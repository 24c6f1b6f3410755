"""The pipelined step behind the interfaces the loop already drives: ``PipelineLaneSet`` stands
where ``runtime.lanes.LaneSet`` stands (``step``, ``evaluate``, ...: the stage's lanes, run by
the engine's schedule), ``PipelineBucket`` where the fused bucket stands, so ``policy=sync``
runs a pipelined job unchanged.

One step, policy ``sync``, on a rank of stage s:

1. ``PipelineLaneSet.step`` runs the stage's micro-batches (``engine.StageEngine``); the stage's
   sample-weighted gradients land in the bucket's payload; it returns the replica's rows, loss
   sum and correct count (the last stage's, passed down with the gradients).
2. The policy writes the tail (samples, loss sum, correct, this rank's flags) as today.
3. ``PipelineBucket.allreduce``: one fused Allreduce sums the stage's gradients and the tail
   over the stage's replicas (the stage's data-parallel communicator). The samples, loss sum
   and correct count are then the job's on every rank: every stage of a replica has the same
   rows, and the loss came down with the gradients (``engine``). The control flags (stop,
   non-finite, checkpoint due) are then agreed among the stage's replicas only; one more
   collective, an Allreduce of those three numbers over the pipeline communicator, makes
   them every rank's. That is the one message per step beyond the activations, their
   gradients and the stage's Allreduce, and it cannot ride on them: each rank's own checks
   -- its finished gradients' finiteness, a signal, rank 0's checkpoint clock -- are known
   only after its last message of the step left (its last backward produced that message
   and its gradients together), so the neighbours have nothing more of it to read in this
   step. After it stop, skip-non-finite and checkpoint-due are decided the same way on every
   rank in the same step.
"""

from __future__ import annotations

import time

import numpy as np

from hpc_rlx.comm.bucket_layout import CONTROL_FLAGS
from hpc_rlx.comm.collective import watched_call
from hpc_rlx.base import trace


class _StageLaneTotals:
    """The stage's lanes as the one entry the loop reads of a lane (``name``, ``samples``,
    ``busy_s``)."""

    def __init__(self, name: str):
        self.name, self.samples, self.busy_s = name, 0, 0.0


class PipelineLaneSet:
    """A pipelined rank's ``LaneSet``: its stage's lanes (``engine.lanes``, ``StageLanes``),
    stepped through the pipeline schedule."""

    overlap_capable = False

    def __init__(self, engine, params_flat, layout, bucket):
        self.engine, self.layout = engine, layout
        self.params = params_flat
        self.param_views = layout.views(params_flat)
        self.bucket = bucket
        self.grad_views = layout.grad_views(bucket.payload)
        k = len(engine.lanes)
        name = f"cpu{'0' if k == 1 else f'0-{k - 1}'} (stage {engine.stage}/{engine.stages})"
        self.lanes = [_StageLaneTotals(name)]
        self.names = [name]
        # lanes after the first: a gradient buffer each, added into the bucket after the step
        self._peers = [(buf, layout.grad_views(buf)) for buf in (np.zeros_like(bucket.payload) for _ in range(k - 1))]
        self.bucket_path = (f"pipeline stage {engine.stage} of {engine.stages}, {engine.schedule}, "
                            f"{engine.micro} micro-batches, {engine.slots} buffer slot(s) per direction"
                            + (f", {k} CPU lanes splitting each micro-batch" if k > 1 else "")
                            + (", state sliced among the stage's replicas, reduce-scatter (comm.shard=optimizer)"
                               if bucket.settings.shard is not None else ""))

    def step(self, x, y, seed: int, on_grad_ready=None):
        t0 = time.perf_counter()
        feeds = {"x": x, "y": y}
        n, loss_sum, correct = self.engine.step(self.param_views, self.bucket.payload, self.grad_views,
                                                feeds, seed, self._peers)
        dt = time.perf_counter() - t0
        sent, self.engine.sent_bytes = self.engine.sent_bytes, 0
        self.bucket.sent.add(sent)      # the point-to-point sends count as bytes on the wire
        ln = self.lanes[0]
        ln.samples += n
        ln.busy_s += dt
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("pipeline step", "compute", trace.MAIN, t0, t0 + dt, {"n": n})
        return n, loss_sum, correct, dt

    def evaluate(self, x, y, batch: int = 1024):
        """(loss_sum, correct) of a validation batch on every stage: the last stage's sums,
        broadcast along the pipeline (the caller then sums over the replicas)."""
        loss_sum, correct = self.engine.evaluate(self.param_views, {"x": x, "y": y})
        buf = np.array([loss_sum, correct], dtype=np.float64)
        self.engine.pipe.Bcast(buf, root=self.engine.stages - 1)
        return float(buf[0]), float(buf[1])

    def refresh_device_params(self) -> None:
        pass

    def close(self) -> None:
        self.engine.lanes.close()


class PipelineBucket:
    """The stage's fused bucket, reduced over the stage's replicas, its tail then agreed along
    the pipeline (see the module docstring). Everything else is the wrapped bucket's."""

    def __init__(self, bucket, comms):
        self._bucket, self._comms = bucket, comms
        self._flags = np.zeros(len(CONTROL_FLAGS), dtype=np.float64)
        self._agreed = np.zeros_like(self._flags)

    def __getattr__(self, name):
        return getattr(self._bucket, name)

    def __getitem__(self, field):
        return self._bucket[field]

    def __setitem__(self, field, value) -> None:
        self._bucket[field] = value

    def allreduce(self, comm=None, reduction=None) -> float:
        b = self._bucket
        dt = b.allreduce(self._comms.data, reduction)
        t0 = time.perf_counter()
        for i, flag in enumerate(CONTROL_FLAGS):
            self._flags[i] = b[flag]
        # summed: raised anywhere = > 0
        watched_call("flags allreduce", self._comms.pipe.Allreduce, self._flags, self._agreed)
        for i, flag in enumerate(CONTROL_FLAGS):
            b[flag] = float(self._agreed[i])
        t1 = time.perf_counter()
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("flags allreduce", "comm", trace.MAIN, t0, t1)
        return dt + (t1 - t0)
