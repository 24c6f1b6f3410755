"""The windowed policies' streaming sync (`policy.fragments`, `policy.fragment_delay`): the
schedule is `fragments.py`'s, the sum in flight `comm.fragment_sync`'s; this module runs one
sub-window and applies a fragment when its sum arrives.

One sub-window (K / F local steps), on every rank:

    [ tau local steps | wait for the fragment in flight, apply it | the other steps ]
    -> stage fragment j mod F and the report, start its sum (in flight during the next
       sub-window's first tau steps; at once when tau = 0 or the epoch ends here)

Applying fragment f is the policy's `apply_consensus`, as for a whole sync: the consensus of
its sum, the outer optimizer on the fragment's trainable part (`outer.OuterOptimizer.step` with
`part`, `fragment`), the new global fragment into `global_params`, and the rank's own copy
merged with it (`policy.fragment_mix`). The report that rode with the fragment feeds the epoch
log and the loop's flags as a whole sync's does; the cursors and the epoch's samples move when
a sub-window is sent, from the planned counts every rank knows (async: the same on every rank),
so the next sub-window is planned without waiting for the sum.

The policy is seen only through `WindowHost`: its window state (positions, LR, timings) and a
few public methods.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from hpc_rlx.comm.fragment_sync import FragmentSync

from .base import Loop, StepResult
from .consensus import weigh_into
from .fragment_schedule import cycle_order
from .fragments import Streaming, fragment_bounds
from .sync_slots import SyncReport
from .window import LocalWork, WindowState


class WindowHost(Protocol):
    """What `StreamingSync` uses of its windowed policy (`windowed.WindowedPolicy`)."""

    window: WindowState     # the positions move at the send, the LR and timings per sub-window

    def next_window(self) -> tuple[list[int], list[int]]:
        """(planned, counts) of the next sub-window; counts all zero: the epoch is over."""

    def local_steps(self, loop: Loop, count: int, lr: float, first: int = 0) -> LocalWork:
        """This rank's local steps, from step `first` of the sub-window on."""

    def stage_report(self, loop: Loop, work: LocalWork) -> tuple[bool, float]:
        """(bad, weight); the weight, the report and the flags into the bucket's tail."""

    def reference(self, part: slice):
        """What the coded wire sends differences from in `part`, None uncoded."""

    def read_report(self) -> SyncReport:
        """Every rank's report, from the bucket's reduced tail."""

    def restore_agreed(self, worker, part: slice) -> None:
        """`part` of the rank's parameters back to the last agreed model."""

    def apply_consensus(self, worker, payload, total: float, part: slice, inner_lr: float | None,
                        fragment: int = 0, mix: float = 0.0, out=None) -> bool:
        """The summed `payload` of `part` made the agreed model; False when nobody worked."""

    def note_sync(self, worker, report: SyncReport, k: int, fragment: int | None = None) -> None:
        """A sync done: skips, the step count, the epoch log (a fragment's: which one)."""


class StreamingSync:
    """The fragment syncs of one windowed policy (built at its setup)."""

    def __init__(self, policy: WindowHost, worker, streaming: Streaming, path):
        self.policy = policy
        self.streaming = streaming
        bucket = worker.bucket      # the policy's sync bucket: its report rides in the tail
        self.bounds = fragment_bounds(bucket.layout.payload_size, streaming.fragments)
        self.order = cycle_order(streaming.schedule, self.bounds)   # the fragments of one cycle of syncs
        self.sync = FragmentSync(path, bucket.settings.chunk_elems, self.bounds, bucket.layout.tail_size,
                                 worker.params.dtype)
        self.consensus = np.empty(max(hi - lo for lo, hi in self.bounds), worker.params.dtype)
        self.started = 0            # fragment syncs started since the run began
        self.lr_at_send = None      # the inner LR of the sub-window the fragment in flight ended

    # ---- one sub-window --------------------------------------------------------------------
    def window(self, loop: Loop, counts: list[int], k: int) -> StepResult:
        policy, worker = self.policy, loop.worker
        lr = policy.window.begin(worker)
        t_window = time.perf_counter()
        mine = counts[loop.rank]
        early = min(self.streaming.delay, mine) if self.sync.in_flight else 0
        work = policy.local_steps(loop, early, lr)
        done = []
        if self.sync.in_flight:
            done.append(self.finish(loop, k))
        if not work.bad:                      # a non-finite step ends the rank's window
            # the cursors move at the send: the second part starts after the early steps' batches
            work = _merge(work, policy.local_steps(loop, mine - early, lr, first=early))
        t_send = time.perf_counter()
        self._send(loop, work, counts, lr)
        last = not any(policy.next_window()[1])
        if last or self.streaming.delay == 0:
            done.append(self.finish(loop, k))
        send_s = time.perf_counter() - t_send
        return self._result(work, done, send_s, t_window)

    def _send(self, loop: Loop, work: LocalWork, counts: list[int], lr: float) -> None:
        policy, worker = self.policy, loop.worker
        j = self.order[self.started % len(self.order)]
        lo, hi = self.bounds[j]
        staged = self.sync.stage(j)
        # the report and the flags go into the bucket's tail (its one layout), then with the
        # weighted fragment into the staging array
        bad, weight = policy.stage_report(loop, work)
        staged.tail[...] = worker.bucket.tail
        weigh_into(worker.params[lo:hi], weight, staged.payload, policy.reference(slice(lo, hi)))
        self.sync.start(worker.comm, j)
        self.started += 1
        self.lr_at_send = lr
        policy.window.advance_planned(counts)    # planned, known to every rank: no need to wait
        if bad:
            worker.optimizer.reset()             # its state may hold the non-finite values

    def finish(self, loop: Loop, k: int):
        """Wait for the fragment in flight and apply it; returns (its report, flags, seconds)."""
        policy, worker = self.policy, loop.worker
        j, staged, done, wait_s = self.sync.wait(worker.comm)
        worker.bucket.sent.add(done.wire_bytes)
        lo, hi = self.bounds[j]
        worker.bucket.tail[...] = staged.tail
        report = policy.read_report()
        flags = worker.bucket.flags()
        if flags["nonfinite"] and loop.on_nonfinite == "stop":
            policy.restore_agreed(worker, slice(lo, hi))
            return report, flags, wait_s, done
        policy.apply_consensus(worker, staged.payload, report.total_weight, slice(lo, hi), self.lr_at_send,
                               fragment=j, mix=self.streaming.mix, out=self.consensus[:hi - lo])
        loop.lanes.refresh_device_params()
        policy.window.waited(wait_s)
        policy.note_sync(worker, report, k, fragment=j)
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
