"""`policy=sync`: one fused gradient Allreduce per step.

Per step every lane writes its sample-weighted gradient into the fused bucket, the policy
writes the sample count, loss sum, correct count and control flags into the bucket's tail,
one Allreduce sums all of it, and every rank divides by the global sample count and applies
the same optimizer step. With ``comm.overlap=true`` (one CPU lane, host path) the chunks that
backward finished start reducing during backward and the Allreduce finishes them
(`hpc_rlx.comm.overlap`); the chunk with the tail is started last.
"""

from __future__ import annotations

import time

from hpc_rlx.observe import trace

from .base import EpochTotals, Policy, TrainingLoop


class SyncPolicy(Policy):
    name = "sync"
    defaults = {}
    steps_are_batches = True

    def step_label(self, worker) -> str:
        return f"step {worker.step_in_epoch}/{worker.steps_per_epoch}"

    def epoch_record(self, totals: EpochTotals) -> dict:
        # The same record keys as the windowed policies: every step is a sync.
        return dict(totals.extra, syncs=totals.steps, K=1,
                    comm_share=(totals.comm_s / totals.compute_s) if totals.compute_s else None)

    def run_epoch(self, loop: TrainingLoop, epoch: int, first_step: int) -> EpochTotals:
        worker, lanes, bucket = loop.worker, loop.lanes, loop.worker.bucket
        totals = loop.epoch_totals()
        for s in range(first_step, worker.steps_per_epoch):
            t_step = time.perf_counter()
            xb, yb = worker.batch(epoch * worker.steps_per_epoch + s)
            t_data = time.perf_counter()
            totals.data_s += t_data - t_step
            tr = trace.ACTIVE       # spans reuse the loop's own clock reads
            if tr is not None:
                tr.add("data.batch", "data", trace.MAIN, t_step, t_data)
            loop.faults.at("step", worker.step)
            # comm.overlap: chunks finished by backward start reducing during it (else None)
            ready = bucket.begin_overlap(worker.comm) if lanes.overlap_capable else None
            n, loss_sum, correct, compute = lanes.step(xb, yb, loop.dropout_seed(), on_grad_ready=ready)
            loop.slowdown(compute)
            compute = time.perf_counter() - t_data
            bucket.zero_tail()
            bucket["samples"] = n
            bucket["loss_sum"] = loss_sum
            bucket["correct"] = correct
            loop.fill_flags(loss_sum)
            dt_comm = bucket.allreduce(worker.comm)
            total_n = bucket["samples"]
            flags = loop.read_flags()
            if flags["nonfinite"] and loop.on_nonfinite == "stop":
                loop.stop("nonfinite")
                break
            skipped = flags["nonfinite"]
            if skipped:
                worker.note_skip()
            elif total_n > 0:
                bucket.payload_to_host()      # a CUDA-aware Allreduce leaves the sum on the GPU
                with trace.span("optimizer", "optim"):
                    worker.apply_gradient(bucket.payload, worker.lr_at(worker.step), grad_scale=1.0 / total_n)
                worker.apply_gradient_ok()
            worker.state.step_taken(s + 1)
            if not skipped:     # a skipped step's loss may be NaN: keep it out of the epoch's means
                totals.samples += total_n
                totals.loss_sum += bucket["loss_sum"]
                totals.correct += bucket["correct"]
            totals.steps += 1
            totals.compute_s += compute
            totals.comm_s += dt_comm
            t_end = time.perf_counter()
            totals.step_wall_s += t_end - t_step
            if tr is not None:
                tr.add("step", "step", trace.MAIN, t_step, t_end, {"step": worker.step})
            loop.after_step(n, loss_sum / max(n, 1), compute, dt_comm)
            if loop.should_stop_after_step(flags):
                break
        return totals
