"""The windowed policies' streaming sync (`policy.fragments`, `policy.fragment_delay`): the
schedule is `fragments.py`'s, the sum in flight `comm.fragment_sync`'s; this module runs one
sub-window and applies a fragment when its sum arrives.

One sub-window (K / F local steps), on every rank:

    [ tau local steps | wait for the fragment in flight, apply it | the other steps ]
    -> stage fragment j mod F and the report, start its sum (in flight during the next
       sub-window's first tau steps; at once when tau = 0 or the epoch ends here)

Applying fragment f: the consensus of its sum (`consensus.consensus_into`), the outer optimizer
on the fragment's trainable part (`outer.OuterOptimizer.step` with `part`, `fragment`), the new
global fragment into `global_params`, and the rank's own copy merged with it
(`policy.fragment_mix`). The report that rode with the fragment feeds the epoch log and the
loop's flags as a whole sync's does; the cursors and the epoch's samples move when a sub-window
is sent, from the planned counts every rank knows (async: the same on every rank), so the next
sub-window is planned without waiting for the sum.
"""

from __future__ import annotations

import time

import numpy as np

from hpc_rlx.comm.fragment_sync import FragmentSync

from .base import StepResult
from .consensus import consensus_into, weigh_into
from .fragments import Streaming, fragment_bounds


class StreamingSync:
    """The fragment syncs of one windowed policy (built at its setup)."""

    def __init__(self, policy, worker, streaming: Streaming, path):
        self.policy = policy
        self.streaming = streaming
        n = policy.layout.n_params
        self.bounds = fragment_bounds(n, streaming.fragments)
        self.n_trainable = int(worker.n_trainable)
        tail = policy.bucket.layout.tail_size
        self.sync = FragmentSync(path, policy.bucket.chunk_elems, self.bounds, tail, worker.params.dtype)
        self.consensus = np.empty(max(hi - lo for lo, hi in self.bounds), worker.params.dtype)
        self.started = 0            # fragment syncs started since the run began
        self.lr_at_send = None      # the inner LR of the sub-window the fragment in flight ended

    # ---- one sub-window --------------------------------------------------------------------
    def window(self, loop, counts: list[int], k: int) -> StepResult:
        policy, worker = self.policy, loop.worker
        lr = policy._lr = worker.lr_at(policy._lr_step(worker))
        t_window = time.perf_counter()
        mine = counts[loop.rank]
        early = min(self.streaming.delay, mine) if self.sync.in_flight else 0
        work = policy._local_steps(loop, early, lr)
        done = []
        if self.sync.in_flight:
            done.append(self.finish(loop, k))
        if not work.bad:                      # a non-finite step ends the rank's window
            # the cursors move at the send: the second part starts after the early steps' batches
            work = _merge(work, policy._local_steps(loop, mine - early, lr, first=early))
        t_send = time.perf_counter()
        self._send(loop, work, counts, lr)
        last = not any(policy._next_window()[1])
        if last or self.streaming.delay == 0:
            done.append(self.finish(loop, k))
        send_s = time.perf_counter() - t_send
        return self._result(work, done, send_s, t_window)

    def _send(self, loop, work, counts, lr: float) -> None:
        policy, worker = self.policy, loop.worker
        j = self.streaming.fragment_of(self.started)
        lo, hi = self.bounds[j]
        staged = self.sync.stage(j)
        bad, weight = policy.weight_of(work, worker.params)
        ref = None if policy.coded is None else policy.global_params[lo:hi]
        # the report and the flags go into the bucket's tail (its one layout), then with the
        # weighted fragment into the staging array
        policy.layout.pack_tail(policy.buf, weight, worker.rank, policy.report_of(work, bad))
        loop.write_flags(nonfinite=bad)
        staged.tail[...] = policy.bucket.tail
        weigh_into(worker.params[lo:hi], weight, staged.payload, ref)
        self.sync.start(worker.comm, j)
        self.started += 1
        self.lr_at_send = lr
        for r, c in enumerate(counts):           # planned, known to every rank: no need to wait
            policy.cursors[r] += c
            policy.epoch_consumed += c * policy.batches[r]
        if bad:
            worker.optimizer.reset()             # its state may hold the non-finite values

    def finish(self, loop, k: int):
        """Wait for the fragment in flight and apply it; returns (its report, flags, seconds)."""
        policy, worker = self.policy, loop.worker
        j, staged, done, wait_s = self.sync.wait(worker.comm)
        worker.bucket.sent.add(done.wire_bytes)
        lo, hi = self.bounds[j]
        policy.bucket.tail[...] = staged.tail
        report = policy.layout.read(policy.buf)
        flags = worker.bucket.flags()
        total = report.total_weight
        new = self.consensus[:hi - lo]
        ref = None if policy.coded is None else policy.global_params[lo:hi]
        if flags["nonfinite"] and loop.on_nonfinite == "stop":
            worker.params[lo:hi] = policy.global_params[lo:hi]
            return report, flags, wait_s, done
        if consensus_into(staged.payload, total, new, ref):
            top = min(hi, self.n_trainable)
            if top > lo:
                lr = self.lr_at_send
                policy.outer.step(new[:top - lo], inner_lr=lr if lr and lr > 0 else worker.base_lr,
                                  part=slice(lo, top), fragment=j)
            policy.global_params[lo:hi] = new
            mix = self.streaming.mix
            local = worker.params[lo:hi]
            if mix == 0:
                local[...] = new
            else:             # the steps since the send stay, in part (Streaming DiLoCo's merge)
                local *= mix
                local += (1.0 - mix) * new
            if policy.outer.resets_inner:
                worker.optimizer.reset()
        loop.lanes.refresh_device_params()
        policy._prev_sync_ms = wait_s * 1e3
        policy.note_sync(worker, report, k, policy._log)
        return report, flags, wait_s, done

    def _result(self, work, done, send_s: float, t_window: float) -> StepResult:
        flags = {"stop": False, "nonfinite": False, "ckpt_due": False}
        result = StepResult(flags=flags, rank_samples=work.samples,
                            rank_loss=work.loss_sum / max(work.samples, 1), compute_s=work.compute,
                            comm_s=send_s + sum(d[2] for d in done), data_s=work.data_s)
        for report, reduced, _, _ in done:
            for key in flags:
                flags[key] = flags[key] or bool(reduced[key])
            samples, loss_sum, correct = report.counted()
            result.samples += samples
            result.loss_sum += loss_sum
            result.correct += correct
        result.wall_s = time.perf_counter() - t_window
        return result

    # ---- checkpoints -----------------------------------------------------------------------
    def rank_state(self) -> dict:
        """This rank's part of a checkpoint: the fragment in flight, as it was sent."""
        if not self.sync.in_flight:
            return {}
        j = self.sync.fragment
        lo, hi = self.bounds[j]
        return {"in_flight_sent": self.sync.sent[:hi - lo + self.sync.tail_size].copy()}

    def meta(self) -> dict:
        return {"started": self.started, "in_flight": self.sync.fragment, "lr_at_send": self.lr_at_send}

    def load(self, meta: dict, rank_arrays: dict | None, comm) -> None:
        """Resume: the sync count, and on the same world size the fragment in flight, started
        again from what this rank had sent (another world size drops it)."""
        self.started = int(meta.get("started", 0))
        self.lr_at_send = meta.get("lr_at_send")
        j = meta.get("in_flight")
        if j is not None and rank_arrays and "in_flight_sent" in rank_arrays:
            self.sync.restart(comm, int(j), np.asarray(rank_arrays["in_flight_sent"]))

    def stop(self) -> None:
        """The run stops with a fragment in flight: complete MPI's side, drop the result."""
        self.sync.cancel()


def _merge(a, b):
    """Two parts of one sub-window's local work, as one."""
    a.steps += b.steps
    a.samples += b.samples
    a.loss_sum += b.loss_sum
    a.correct += b.correct
    a.compute += b.compute
    a.measured += b.measured
    a.data_s += b.data_s
    a.bad = a.bad or b.bad
    return a
