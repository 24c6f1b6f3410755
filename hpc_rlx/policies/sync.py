"""`policy=sync`: one fused gradient Allreduce per step.

Per step every lane writes its sample-weighted gradient into the fused bucket, the policy
writes the sample count, loss sum and correct count into the bucket's tail and the loop its
control flags, one Allreduce sums all of it, and every rank divides by the global sample count and applies
the same optimizer step. With ``comm.overlap=true`` (one CPU lane, host path) the chunks that
backward finished start reducing during backward and the Allreduce finishes them
(`hpc_rlx.comm.overlap`); the chunk with the tail is started last.
"""

from __future__ import annotations

import math
import time

from hpc_rlx.base import trace

from .base import EpochTotals, Policy, StepResult
from .loop_contract import Loop, LoopWorker
from .loss_weight import WEIGHT_FIELDS, is_weighted, mean_scale


class SyncPolicy(Policy):
    name = "sync"
    defaults = {}
    steps_are_batches = True
    shards_optimizer_state = True

    def __init__(self, spec):
        super().__init__(spec)
        # a weighted loss: its global denominator travels in the bucket too (loss_weight.py)
        self.weighted = is_weighted(spec)
        self.bucket_fields = self.bucket_fields + (WEIGHT_FIELDS if self.weighted else ())

    def step_label(self, worker: LoopWorker) -> str:
        return f"step {worker.step_in_epoch}/{worker.steps_per_epoch}"

    def epoch_record(self, totals: EpochTotals) -> dict:
        # The same record keys as the windowed policies: every step is a sync.
        return dict(totals.extra, syncs=totals.steps, K=1,
                    comm_share=(totals.comm_s / totals.compute_s) if totals.compute_s else None)

    def step(self, loop: Loop) -> StepResult | None:
        worker, bucket = loop.worker, loop.worker.bucket
        s = worker.step_in_epoch
        if s >= worker.steps_per_epoch:
            return None
        t_step = time.perf_counter()
        xb, yb = worker.batch(worker.epoch * worker.steps_per_epoch + s)
        t_data = time.perf_counter()
        tr = trace.ACTIVE       # spans reuse the step's own clock reads
        if tr is not None:
            tr.add("data.batch", "data", trace.MAIN, t_step, t_data)
        loop.hooks.fail_at("step", worker.step)
        # comm.overlap: chunks finished by backward start reducing during it (else None)
        ready = bucket.begin_overlap(worker.comm) if loop.lanes.overlap_capable else None
        n, loss_sum, correct, compute = loop.lanes.step(xb, yb, loop.dropout_seed(), on_grad_ready=ready)
        loop.hooks.slowdown.after_step(compute)
        compute = time.perf_counter() - t_data
        bucket.zero_tail()
        bucket["samples"], bucket["loss_sum"], bucket["correct"] = n, loss_sum, correct
        if self.weighted:
            bucket["loss_weight"], bucket["labelled"] = loop.lanes.counted
        if loop.hooks.poisons_gradient(worker.step):
            bucket.memory.payload_to_host()     # GPU-only lanes left the gradient on the GPU
            bucket.payload[0] = float("nan")    # debug.nan_*: a non-finite gradient, on purpose
        bad = not math.isfinite(loss_sum) or not bucket.payload_finite()   # on the GPU for a device bucket
        flags, comm_s = loop.reduce(nonfinite=bad)
        mine = loop.lanes.counted[0] if self.weighted else n     # this rank's mean's denominator
        result = StepResult(flags=flags, rank_samples=n, rank_loss=loss_sum / mine if mine else 0.0,
                            compute_s=compute, comm_s=comm_s, data_s=t_data - t_step)
        if flags["nonfinite"] and loop.on_nonfinite == "stop":
            return result           # the loop stops the run; the parameters stay as they were
        total_n = bucket["samples"]
        if flags["nonfinite"]:
            worker.note_skip()      # a skipped step's loss may be NaN: kept out of the epoch's means
        else:
            if total_n > 0:
                bucket.memory.payload_to_host()      # a CUDA-aware Allreduce leaves the sum on the GPU
                scale = (mean_scale(bucket.payload, worker.n_trainable, bucket["loss_weight"], total_n)
                         if self.weighted else 1.0 / total_n)
                with trace.span("optimizer", "optim"):
                    # comm.shard=optimizer: the parameters' allgather is part of the step's communication
                    result.comm_s += worker.apply_gradient(bucket.payload, worker.lr_at(worker.step),
                                                           grad_scale=scale)
                worker.apply_gradient_ok()
            result.samples, result.loss_sum, result.correct = total_n, bucket["loss_sum"], bucket["correct"]
            if self.weighted:
                result.sums.update({k: bucket[k] for k in WEIGHT_FIELDS})
        worker.state.step_taken(s + 1)
        t_end = time.perf_counter()
        result.wall_s = t_end - t_step
        if tr is not None:
            tr.add("step", "step", trace.MAIN, t_step, t_end, {"step": worker.step})
        return result
