"""The windowed policies (`cadence`, `async`): local steps, then one fused sync.

This module holds what they share; `cadence.py` and `asynchronous.py` what differs (the
step-count controller, its config keys and what the epoch record shows).

A window: every rank runs its share of local optimizer steps on its own shard (no
communication), then all ranks issue ONE in-place Allreduce(SUM) of the worker's bucket (the
one the local steps write their gradients into, laid out with this policy's slots)

    [ w_i * W_i ... | w_i | steps | samples | compute_ms | sync_ms | divergence | loss_sum
      | correct | stop | nonfinite | ckpt_due ]      (each report field: one slot per rank)

which yields the work-weighted consensus and every rank's report at once. Every decision
after it (skip on zero weight, next window's step counts, K, the end of the epoch, stop,
non-finite, checkpoint) is a function of that reduced buffer, so ranks never disagree and
never wait on a collective the others will not issue.

- cadence: the ElChe scheduler gives each rank steps in proportion to its measured speed, so
  a slow rank runs fewer steps and everyone reaches the sync at about the same time.
- async: every rank runs K steps; K keeps the sync cost near `overhead_target` of compute
  and the divergence guard cuts it when the ranks' models drift apart.

Epoch accounting: an epoch ends when the cluster has consumed the samples of one sync-policy
epoch (`plan.samples_per_epoch`), counted from the reports; each rank walks its own shard in
successive local passes (`worker.batch(pass * steps + step)`), with a cursor per rank that every
rank tracks from the reported step counts. Fast ranks therefore see their shard more often
than slow ranks within an epoch: the sample count is exact, per-sample coverage is not.

Clocks: `worker.step` counts syncs (checkpoint intervals and `train.max_steps` use it) and
`worker.step_in_epoch` the syncs of this epoch; the learning rate follows data progress in global
batches, as with policy=sync, so both walk the same LR curve over an epoch.

Checkpoints are only taken right after a sync, when every rank holds the same parameters;
the optimizer state saved is rank 0's (each rank's own inner state differs under local
steps), so a resumed run starts every rank from rank 0's momentum.

Limits: the bucket is in the compute dtype, so per-window step and sample counts must stay
below 2**24 in float32 (far above any real window).
"""

from __future__ import annotations

import math
import time

import numpy as np

from hpc_rlx.comm import collective
from hpc_rlx.comm.bucket_layout import CONTROL_FLAGS
from hpc_rlx.comm.feedback_wire import FeedbackWireSum
from hpc_rlx.comm.quant_codec import outer_codec_for
from hpc_rlx.comm.reduce import HostSum, OrderedSum
from hpc_rlx.base import trace

from hpc_rlx.base.errors import ConfigError
from .base import EpochTotals, Loop, Policy, StepResult, dropout_seed
from .consensus import consensus_into, work_weight
from .epochlog import EpochLog
from .fragments import Streaming, check_streaming
from .keys import SHARED_DEFAULTS, SHARED_DOCS, check_outer_keys, integer_key, number_key
from .loss_weight import is_weighted, local_mean
from .outer import outer_from_config
from .streaming import StreamingSync
from .sync_slots import REPORT_FIELDS, SUMMED_FIELDS, SyncLayout, SyncReport
from .window import LocalWork, WindowState
from .windowed_state import WindowedState

FIELDS = REPORT_FIELDS + ("loss_sum", "correct") + CONTROL_FLAGS     # per-rank slots of the sync


class WindowedPolicy(WindowedState, Policy):
    """Local steps, then one fused sync. Subclasses provide the step-count controller:
    `build_controller`, `k`, `planned_counts`, `window_k`, `_observe`, `_controller_record`."""

    defaults = SHARED_DEFAULTS
    key_docs = SHARED_DOCS
    bucket_fields = SUMMED_FIELDS
    bucket_rank_fields = FIELDS
    own_optimizer_state = True

    @classmethod
    def check_config(cls, cfg: dict) -> dict:
        out = {"name": cls.name}
        out["anchor"] = integer_key("anchor", cfg["anchor"])
        out["max_anchor"] = integer_key("max_anchor", cfg["max_anchor"])
        out["overhead_target"] = number_key("overhead_target", cfg["overhead_target"])
        out["gamma"] = number_key("gamma", cfg["gamma"])
        out.update(check_outer_keys(cfg))
        out.update(cls.check_own_keys(cfg))
        out.update(check_streaming(dict(cfg, **out), cls.name))
        # The objects that enforce the ranges; built once here only for their checks.
        work_weight(1, out["gamma"])
        cls.build_controller(out, world_size=1)
        return out

    @classmethod
    def check_own_keys(cls, cfg: dict) -> dict:
        """The subclass's own keys, checked."""
        return {}

    def __init__(self, spec):
        super().__init__(spec)
        try:
            self.cfg = self.complete_config(spec.policy)
            self.window = WindowState(int(spec.world_size))     # the positions, LR, timings, record
            self._start_fresh(int(spec.world_size))
        except ConfigError as e:
            # Every rank checks the same broadcast spec, so every rank fails here with this
            # same message: it is already agreed, and needs no collective to say so.
            raise collective.CollectiveError(str(e), kind="ConfigError", origin=0) from None
        self.gamma = float(self.cfg["gamma"])
        self._pending = None                     # loaded state waiting for the arrays to exist
        self._ready = False
        self.streaming = Streaming(self.cfg["fragments"], self.cfg["fragment_delay"],
                                   self.cfg["fragment_mix"], self.cfg["fragment_schedule"])
        self.stream: StreamingSync | None = None    # the fragment syncs, when they stream
        self._loop: Loop | None = None      # the run it was set up in: `rebuild` sets it up again there

    def _start_fresh(self, world: int) -> None:
        """The controls of a process that starts (or, after a dead rank, restarts) on `world`
        ranks: a new controller and outer optimizer, no position and no measurements yet; a
        checkpoint's state (`load_state_dict`) goes over them."""
        self.window.restart(world)
        self.controller = self.build_controller(self.cfg, self.world)
        self.outer = outer_from_config(self.cfg)
        self._rank_pending = None                   # this rank's own checkpointed state

    @property
    def world(self) -> int:
        """The ranks that train (the window state's)."""
        return self.window.world

    # ---- the controller behind one small interface (the subclasses) ------------------------
    @property
    def k(self) -> int:
        """The K the epoch record shows."""
        raise NotImplementedError

    def planned_counts(self) -> list[int]:
        """Local steps per rank for the next full window."""
        raise NotImplementedError

    def window_k(self, planned: list[int]) -> int:
        """The K a window planned as `planned` ran with (the epoch log's k_trace)."""
        return self.k

    def _observe(self, report, trimmed: bool) -> None:
        """Feed the controller what the sync reported (`trimmed`: cut short by the epoch's end)."""
        raise NotImplementedError

    def _controller_record(self, metrics: dict) -> dict:
        """The controller's keys in the epoch record."""
        return {}

    # ---- setup on first use (needs the worker) ------------------------------------------
    def _setup(self, loop: Loop) -> None:
        worker = loop.worker
        # The worker's one bucket, laid out with this policy's slots (`bucket_fields`,
        # `bucket_rank_fields`): the local steps' gradients and the sync share it. The sync
        # sums it exactly (never the step's 16-bit wire or device path), picked once here.
        self.bucket = worker.bucket
        self.layout = SyncLayout.inside(self.bucket.layout, FIELDS)
        self.reduction = self.bucket.exact_reduction()
        codec = outer_codec_for(self.cfg["outer_wire_dtype"])
        self.coded = None           # the coded outer wire, which sends differences from global_params
        if codec is not None:
            self.coded = self.reduction = FeedbackWireSum(
                codec, self.bucket.settings.chunk_elems, self.layout.n_params, worker.params.dtype,
                self.bucket.settings.deterministic)
        self.buf = self.bucket.buffer
        self.global_params = worker.params.copy()   # the last agreed model (restore point)
        if self.streaming.active:
            settings = self.bucket.settings
            path = self.coded or (OrderedSum if settings.deterministic else HostSum)(settings.chunk_elems)
            self.stream = StreamingSync(self, worker, self.streaming, path)
        self.outer.begin(worker.params[:worker.n_trainable])   # buffers: the plain average
        if self._pending is not None:
            arrays = self._pending.get("arrays") or {}
            outer_meta = dict((self._pending.get("meta") or {}).get("outer") or {})
            if outer_meta.get("name") == self.outer.name and "outer_prev" in arrays:
                outer_meta.update(prev=arrays["outer_prev"], buf=arrays["outer_buf"])
                self.outer.load_state_dict(outer_meta)
            self._resume_streams(loop, arrays, (self._pending.get("meta") or {}).get("streaming"))
            self._pending = None
        w = self.window
        w.batches = [worker.plan.rank_batch(r) for r in range(self.world)]
        w.epoch_samples = int(worker.plan.samples_per_epoch)
        if w.adopt_position and worker.step_in_epoch:
            # a policy=sync checkpoint mid-epoch: every rank stopped at the same step of its
            # rows, each step having used a global batch (exact with data.leftover=drop)
            w.epoch_consumed = min(w.epoch_samples, worker.step_in_epoch * int(worker.plan.global_batch))
            w.cursors = [worker.epoch * worker.steps_per_epoch + worker.step_in_epoch] * self.world
        if w.cursors is None:
            w.cursors = [worker.epoch * worker.steps_per_epoch] * self.world
        self.slow = loop.hooks.slowdown      # debug.slowdown: owed per step, slept before the sync
        loop.restore_point(self.global_params)      # the ranks agree: what a recovery goes back to
        self._loop, self._ready = loop, True

    def epoch_fraction(self, worker) -> float:
        """How much of the current epoch is trained: samples consumed over the epoch's."""
        if not self._ready:
            return worker.step_in_epoch / max(1, worker.steps_per_epoch)
        return self.window.fraction()

    def current_lr(self, worker) -> float | None:
        """The learning rate of the last window (it follows data progress, `WindowState.lr_step`)."""
        return self.window.lr

    # ---- one epoch: windows until the epoch's samples are consumed ---------------------------
    def begin_epoch(self, loop: Loop, first_step: int) -> None:
        if not self._ready:
            self._setup(loop)
        w = self.window
        w.epoch_over = False
        if w.log is None or first_step == 0:
            w.log = EpochLog(self.world)
        w.epoch_log = w.log      # the record of the epoch, kept past its end

    def next_window(self) -> tuple[list[int], list[int]]:
        """(planned, counts): the next full window's step counts and those trimmed to what is
        left of the epoch (all zero when nothing is left)."""
        planned = self.planned_counts()
        if self.stream is not None:          # sub-windows of K / F steps (fragments.py)
            planned = [self.streaming.sub_window(self.k)] * self.world
        return planned, self.window.trim(planned)

    def step(self, loop: Loop) -> StepResult | None:
        if self.window.epoch_over:
            return None
        planned, counts = self.next_window()
        if not any(counts):
            # the epoch is over, decided from the bucket: identically on every rank
            self.window.end_epoch()
            return None
        if self.stream is not None:
            return self.stream.window(loop, counts, self.window_k(planned))
        return self._window(loop, counts, counts != planned, self.window_k(planned))

    def end_epoch(self, loop: Loop, totals: EpochTotals, stopping: bool) -> None:
        w = self.window
        if stopping and self.stream is not None:
            self.stream.stop()       # a fragment in flight: the checkpoint keeps what was sent
        if stopping and w.log is not None and not any(self.next_window()[1]):
            # the run stops exactly where the epoch ends: the epoch is complete
            w.end_epoch()
            totals.complete = True
        extra = {"outer": self.outer.name, "lr": w.lr}
        extra.update(self._controller_record(self.controller.metrics()))
        totals.extra = w.epoch_log.record(self.k, self.planned_counts(), **extra)

    def _window(self, loop: Loop, counts, trimmed: bool, k: int) -> StepResult:
        """Local steps, then the sync."""
        worker = loop.worker
        lr = self.window.begin(worker)
        t_window = time.perf_counter()
        # a spare (comm.on_failure=spare) trains nothing until it takes a dead rank's shard
        work = LocalWork() if worker.is_spare else self.local_steps(loop, counts[loop.rank], lr)
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("window", "step", trace.MAIN, t_window, time.perf_counter(),
                             {"steps": work.steps, "sync": worker.step})
        t_sync = time.perf_counter()
        flags, report = self._sync(loop, work, lr)
        sync_s = time.perf_counter() - t_sync
        result = StepResult(flags=flags, rank_samples=work.samples,
                            rank_loss=work.loss_sum / max(work.samples, 1), compute_s=work.compute,
                            comm_s=sync_s, data_s=work.data_s)
        if report is None:
            return result          # non-finite with train.on_nonfinite=stop: the loop stops
        self.window.timed_sync(sync_s)
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("sync", "comm", trace.MAIN, t_sync, t_sync + sync_s,
                             {"sync": worker.step + 1, "applied": report.applied})
        self._account(loop, report, k, trimmed)
        # A bad window's loss is left out, so its samples are too: the epoch's mean stays honest.
        result.samples, result.loss_sum, result.correct = report.counted()
        result.wall_s = time.perf_counter() - t_window
        return result

    def local_steps(self, loop: Loop, count: int, lr: float, first: int = 0) -> LocalWork:
        """This rank's `count` local optimizer steps on its own shard (no communication), from
        step `first` of the window on (a streaming sub-window runs in two parts)."""
        worker, lanes, rank = loop.worker, loop.lanes, loop.rank
        seed, weighted = worker.spec.train["seed"], is_weighted(worker.spec)
        work = LocalWork()
        cold_s = None
        position = self.window.cursors[rank] + first
        for _ in range(count):
            t = time.perf_counter()
            loop.hooks.fail_at("step", worker.step)
            with trace.span("data.batch", "data"):
                xb, yb = worker.batch(position + work.steps)
            work.data_s += time.perf_counter() - t
            n, ls, corr, _ = lanes.step(xb, yb, dropout_seed(seed, position + work.steps, rank))
            work.steps += 1
            work.samples += n
            if n:
                if not math.isfinite(ls):
                    work.bad = True
                else:
                    worker.bucket.memory.payload_to_host()      # GPU-only lanes sum on the GPU
                    scale = 1.0 / n
                    if weighted:        # a weighted loss: this rank's own batch mean (loss_weight.py)
                        scale, ls, corr = local_mean(worker.bucket.payload, worker.n_trainable, lanes.counted,
                                                     n, ls, corr, worker.per_sample)
                    work.loss_sum += ls
                    work.correct += corr
                    with trace.span("optimizer", "optim"):
                        worker.apply_gradient(worker.bucket.payload, lr, grad_scale=scale)
                    lanes.refresh_device_params()
            dt = time.perf_counter() - t
            # slowdown: (f - 1) x the whole step, slept once before the sync
            self.slow.owe(dt)
            work.compute += dt
            if self.window.cold:
                cold_s, self.window.cold = dt, False
            if work.bad:
                break   # the window is lost anyway; report what was consumed
        if self.slow.active:
            t = time.perf_counter()
            with trace.span("slowdown", "debug"):
                self.slow.flush()
            work.compute += time.perf_counter() - t
        # The run's first step pays one-off costs (allocation, page faults): it would read as
        # a slow rank, so the speed estimate extrapolates from the window's other steps.
        work.measured = work.compute
        if cold_s is not None and work.steps > 1:
            work.measured = max(0.0, work.compute - cold_s * self.slow.factor) * work.steps / (work.steps - 1)
        return work

    def _sync(self, loop: Loop, work: LocalWork, lr: float):
        """The one collective of the window, and the consensus it gives: (flags, report);
        the report is None when the run stops on a non-finite window."""
        worker = loop.worker
        bad, weight = self.weight_of(work, worker.params)
        whole = slice(0, self.layout.n_params)
        ref = self.reference(whole)
        if worker.is_spare:
            self.buf[...] = 0       # no weight, no report slot: it adds nothing to the sums
        else:
            self.layout.pack(self.buf, worker.params[whole], weight, worker.rank, self.report_of(work, bad),
                             reference=ref)
        flags, _ = loop.reduce(nonfinite=bad, reduction=self.reduction)
        report = self.read_report()
        if flags["nonfinite"] and loop.on_nonfinite == "stop":
            self.restore_agreed(worker, whole)      # the last agreed model, not this rank's window
            return flags, None
        self.window.divergence = self.layout.divergence(worker.params[whole], self.buf, weight, reference=ref)
        payload, total = self.layout.bucket.payload_of(self.buf), self.layout.total_weight(self.buf)
        if not self.apply_consensus(worker, payload, total, whole, lr):
            self.restore_agreed(worker, whole)      # nobody worked: the model stays as it was
        if bad:
            worker.optimizer.reset()                     # its state may hold the non-finite values
        loop.restore_point(self.global_params)
        loop.lanes.refresh_device_params()
        return flags, report

    # ---- the consensus: the whole sync's and each streaming fragment's --------------------
    def apply_consensus(self, worker, payload, total: float, part: slice, inner_lr: float | None,
                        fragment: int = 0, mix: float = 0.0, out=None) -> bool:
        """The summed `payload` of the parameters' `part` becomes the agreed model there: the
        consensus (`payload / total`, from `global_params` with the coded wire), the outer
        optimizer's step on its trainable part, then the rank's own copy, which takes it (mix 0)
        or keeps `mix` of its steps since the send (a streaming fragment). `out`: where the
        consensus is made (None: in the rank's parameters, which then take it as it is). False,
        nothing changed, when every rank was idle (`total` 0)."""
        local = worker.params[part]
        new = local if out is None else out
        if not consensus_into(payload, total, new, self.reference(part)):
            return False
        top = min(part.stop, worker.n_trainable)
        if top > part.start:
            self.outer.step(new[:top - part.start], part=slice(part.start, top), fragment=fragment,
                            inner_lr=inner_lr if inner_lr and inner_lr > 0 else worker.base_lr)
        self.global_params[part] = new
        if out is not None:
            if mix == 0:
                local[...] = new
            else:             # the steps since the send stay, in part (Streaming DiLoCo's merge)
                local *= mix
                local += (1.0 - mix) * new
        if self.outer.resets_inner:
            worker.optimizer.reset()
        return True

    def restore_agreed(self, worker, part: slice) -> None:
        """The rank's parameters in `part` back to the last agreed model."""
        worker.params[part] = self.global_params[part]

    def reference(self, part: slice):
        """What the coded wire sends differences from (`global_params`), None uncoded."""
        return None if self.coded is None else self.global_params[part]

    def stage_report(self, loop: Loop, work: LocalWork) -> tuple[bool, float]:
        """(bad, weight) of this rank's window; its weight, report and flags into the bucket's
        tail (a streaming sync stages the payload's fragment itself)."""
        bad, weight = self.weight_of(work, loop.worker.params)
        self.layout.pack_tail(self.buf, weight, loop.worker.rank, self.report_of(work, bad))
        loop.write_flags(nonfinite=bad)
        return bad, weight

    def read_report(self) -> SyncReport:
        """Every rank's report, from the bucket's reduced tail."""
        return self.layout.read(self.buf)

    def weight_of(self, work: LocalWork, params) -> tuple[bool, float]:
        """(whether this rank's window went bad, its consensus weight: 0 when it did)."""
        bad = work.bad or not math.isfinite(float(np.sum(params, dtype=np.float64)))
        return bad, 0.0 if bad else work_weight(work.steps, self.gamma)

    def report_of(self, work: LocalWork, bad: bool) -> dict:
        """This rank's report slots for the sync that ends `work`."""
        return {"steps": work.steps, "samples": work.samples, "compute_ms": work.measured * 1e3,
                "sync_ms": self.window.sync_ms, "divergence": self.window.divergence,
                "loss_sum": 0.0 if bad else work.loss_sum, "correct": 0.0 if bad else work.correct}

    def _account(self, loop: Loop, report, k: int, trimmed: bool) -> None:
        """What every rank learns from the reduced report: skips, cursors, the position, the
        epoch log and the controller."""
        self.window.advance(report.steps, report.total_samples)
        self.note_sync(loop.worker, report, k)
        self._observe(report, trimmed)

    def note_sync(self, worker, report, k: int, fragment: int | None = None) -> None:
        """A sync done (a whole one, or `fragment`'s): skips, the step count, the epoch log."""
        bad_ranks = int(np.count_nonzero(report["nonfinite"] > 0))
        if bad_ranks:
            worker.note_skip()          # counts, and stops after train.max_consecutive_skips in a row
        elif report.applied:
            worker.apply_gradient_ok()
        worker.state.step_taken()
        self.window.log.add(report, k, bad_ranks, fragment)
