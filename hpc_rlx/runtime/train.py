"""The training loop: `train(spec, comm) -> result`. Importable and testable without Hydra.

`Run` sets up a rank (data, lanes, checkpoints, outputs: its `RunContext`, which a recovery
after a dead rank replaces), then trains epoch by epoch:
`train_epoch` asks the policy (`policies/`: how steps become synchronised parameters) for one
step at a time and owns everything around it (the control flags, the epoch's totals, the
records and display, checkpoints, stopping); `_end_epoch` validates and records. Policies see
the run only through `policies.base.Loop`.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.checkpoint.runtime import RuntimeCheckpoints
from hpc_rlx.checkpoint.triggers import INTERVAL_REASON
from hpc_rlx.comm import collective
from hpc_rlx.comm.bucket_layout import flag_values
from hpc_rlx.base.topology import hostname
from hpc_rlx.comm.watchdog import StallWatchdog
from hpc_rlx.config.spec import TrainSpec
from hpc_rlx.device.lane_plan import inventory
from hpc_rlx.device.threads import limit_threads, thread_lanes
from hpc_rlx.base.errors import CheckpointError, ConfigError, phase
from hpc_rlx.injection import DebugHooks
from hpc_rlx.base import trace
from hpc_rlx.observe.display import RunDisplay, Where
from hpc_rlx.observe.metrics import Window, epoch_values
from hpc_rlx.observe.metrics.validation import PER_CLASS, VAL_KEYS
from hpc_rlx.observe.outputs import RunOutputs
from hpc_rlx.observe.progress import end_line
from hpc_rlx.policies.base import EpochTotals, dropout_seed
from hpc_rlx.policies.registry import make_policy
from hpc_rlx.runtime import pipelined
from hpc_rlx.resilience.failure import FINISH, SETUP, TRAINING, RunFailed, RunFailure
from hpc_rlx.resilience.in_run import FailureHandling, Survives
from hpc_rlx.runtime.context import RunContext, set_up_lanes
from hpc_rlx.runtime.rank_stats import RankStats
from hpc_rlx.runtime.worker import Worker
from hpc_rlx.runtime.signals import SIGNALS


# --------------------------------------------------------------------------------------
# The run: setup, epochs, checkpoints, outputs.
# --------------------------------------------------------------------------------------

def _part(get) -> property:
    """A part of the run's context (`RunContext`), or what set-up has built of it so far."""
    return property(lambda run: get(run.ctx if run.ctx is not None else run.building))


class Run(Survives):
    comm, rank, is_root = _part(lambda c: c.comm), _part(lambda c: c.rank), _part(lambda c: c.is_root)
    worker, lanes, policy = _part(lambda c: c.worker), _part(lambda c: c.lanes), _part(lambda c: c.policy)
    checkpoints, outputs, display = _part(lambda c: c.checkpoints), _part(lambda c: c.outputs), \
        _part(lambda c: c.display)

    def __init__(self, spec: TrainSpec, comm, earlier=None):
        self.spec = spec
        self.on_nonfinite = spec.train["on_nonfinite"]
        try:
            # debug.*, by the job's rank numbers (a start over after a dead rank renumbers comm)
            self.hooks = DebugHooks.for_rank(spec, earlier.world_ranks[comm.rank] if earlier else comm.rank, comm.size)
        except ConfigError as e:
            # every rank checks the same broadcast spec: already agreed, no collective needed
            raise collective.CollectiveError(str(e), kind="ConfigError", origin=0) from None
        self.stop_flag = SIGNALS     # a signal only sets a flag, carried in the next step's bucket
        self.failure = FailureHandling(spec, comm, earlier)     # comm.on_failure
        self.phase = SETUP           # TRAINING from the first step: a dead rank before it starts the run over
        self.stop_reason: str | None = None
        self.resumed_from: str | None = None
        self.carried_totals: dict | None = None     # a mid-epoch checkpoint's running totals
        self.current_totals: EpochTotals | None = None
        self.t_start = time.perf_counter()
        self.partial_metrics: dict | None = None     # the validation of a run ending mid-epoch
        self.tracer = None
        self.threads: int | None = None
        self.place = None       # pipelined.RankPlace: this rank's stage, if pipelined
        self.stats: RankStats | None = None
        # the context the epochs run on, once `_set_up` made it; until then what it has built
        self.ctx: RunContext | None = None
        self.building = SimpleNamespace(comm=comm, rank=comm.rank, is_root=comm.rank == 0,
                                        display=RunDisplay(spec, comm.rank == 0, self.t_start), policy=None,
                                        worker=None, lanes=None, checkpoints=None, outputs=None)

    # ---- logging ----------------------------------------------------------------------
    def log(self, msg: str) -> None:
        self.display.log(msg)

    def _check_params_finite(self) -> None:
        """Never checkpoint a NaN model (e.g. an overflow that train.on_nonfinite=skip kept
        skipping past): fail instead, and the last good checkpoint stays the newest."""
        if not np.isfinite(self.worker.params).all():
            bad = int(np.count_nonzero(~np.isfinite(self.worker.params)))
            raise CheckpointError(f"{bad} parameter value(s) on rank {self.rank} are NaN/Inf at step "
                                  f"{self.worker.step}: not writing a checkpoint; the newest one on disk "
                                  f"is the last good state (lower optim.lr or set optim.clip_grad_norm)")

    @property
    def world_size(self) -> int:
        """The ranks that train (comm.on_failure=spare's spares left out)."""
        return self.comm.size - self.failure.spares

    def dropout_seed(self) -> int:
        return dropout_seed(self.spec.train["seed"], self.worker.step, self.rank)

    # ---- the step's collective: flags in the bucket's tail ---------------------------------
    def reduce(self, nonfinite: bool, reduction=None) -> tuple[dict, float]:
        """`policies.base.Loop.reduce`."""
        self.write_flags(nonfinite)
        bucket = self.worker.bucket
        seconds = bucket.allreduce(self.worker.comm, reduction)
        return bucket.flags(), seconds

    def write_flags(self, nonfinite: bool) -> None:
        """`policies.base.Loop.write_flags`: the only writer of the control flags."""
        bucket = self.worker.bucket
        for key, value in self._control_flags(nonfinite).items():
            if not (self.worker.is_spare and key in bucket.layout.rank_fields):  # a spare has no slot there
                bucket.put(key, value, self.worker.rank)
        self.hooks.fail_at("allreduce", self.worker.step)

    def _control_flags(self, nonfinite: bool) -> dict:
        """This rank's control flags for the next sync (`bucket_layout.CONTROL_FLAGS`)."""
        return flag_values(stop=self.stop_flag.raised, nonfinite=nonfinite,
                           ckpt_due=self.is_root and self.checkpoints.minutes_due())

    # ---- one epoch -----------------------------------------------------------------------
    def train_epoch(self) -> EpochTotals:
        """The policy's steps until the epoch ends or the run stops (`stop_reason`)."""
        worker, policy = self.worker, self.policy
        policy.begin_epoch(self, worker.step_in_epoch)
        totals = self._epoch_totals()
        while True:
            result, totals = self._survive(lambda: policy.step(self), totals)
            if result is None:
                break                                   # the epoch has no step left
            if result.flags["nonfinite"] and self.on_nonfinite == "stop":
                self.stop_reason = "nonfinite"
                break
            totals.add(result)
            self.stats.add_step(result)
            self.display.after_step(worker, totals, self._where)
            if self._checkpoint_or_stop(result.flags):
                break
        policy.end_epoch(self, totals, stopping=self.stop_reason is not None)
        return totals

    def _evaluate(self) -> dict:
        self.hooks.fail_at("validation", self.worker.step)
        return self.worker.evaluate(self.lanes)

    def _where(self) -> Where:
        """Where the epoch is, for the display (asked only when it draws or records)."""
        policy, worker = self.policy, self.worker
        return Where(policy.epoch_fraction(worker), policy.step_label(worker), policy.current_lr(worker))

    def _checkpoint_or_stop(self, flags: dict) -> bool:
        """After a step: checkpoint if due; whether the run stops here (`stop_reason` set)."""
        worker = self.worker
        if flags["stop"]:
            self.stop_reason = "signal"
            return True
        if flags["ckpt_due"] or self.checkpoints.steps_due(worker.step):
            if self.policy.steps_are_batches and worker.step_in_epoch >= worker.steps_per_epoch:
                # The epoch's last step: save once its validation is done (see execute), so a
                # resume does not redo the epoch's end.
                self.checkpoints.deferred = True
            else:
                self.save_checkpoint(reason=INTERVAL_REASON)
        if worker.total_steps and worker.step >= worker.total_steps:
            self.stop_reason = "max_steps"
            return True
        return False

    def close_displays(self) -> None:
        self.display.close()

    # ---- checkpoints --------------------------------------------------------------------
    def _epoch_totals(self) -> EpochTotals:
        """The running totals of the epoch about to be trained. After a mid-epoch resume they
        start from the checkpoint's, so the epoch's train_loss covers all its steps."""
        carried, self.carried_totals = self.carried_totals, None
        t = self.current_totals = EpochTotals.from_carried(carried)
        self.display.epoch_start(self.worker, self._where(), t)
        return t

    def save_checkpoint(self, reason: str, metric: float | None = None) -> None:
        self._survive(lambda: self._save_checkpoint(reason, metric), self.current_totals)

    def _save_checkpoint(self, reason: str, metric: float | None) -> None:
        with phase("checkpointing"):
            self.hooks.fail_at("checkpoint")
            collective.agree(self.comm, self._check_params_finite)
            t0 = time.perf_counter()
            with trace.span("checkpoint", "io", args={"reason": reason}):
                self.checkpoints.save(reason, metric)
        self.stats.add_checkpoint(time.perf_counter() - t0, self.worker.epoch)

    # ---- main -------------------------------------------------------------------------
    def execute(self) -> dict:
        self.ctx = self._set_up()
        self.phase = TRAINING
        spec, worker = self.spec, self.worker
        self._epochs()
        if self.stop_reason == "signal" and self.comm.allreduce(int(self.stop_flag.interrupted)):
            self.stop_reason = "interrupted"   # Ctrl-C reached some rank: exit 130, no requeue
        if self.stop_reason in (None, "max_steps") and self.checkpoints.enabled:
            # The end of a run is always resumable (e.g. with more epochs).
            self.save_checkpoint("final", self._last_metric())
        result = self._finish()
        if self.stop_reason == "interrupted" and self.is_root:
            self.log(f"interrupted at step {worker.step}; checkpoint "
                     f"{self.checkpoints.manager.path_for(self.checkpoints.saved_step)}; "
                     f"continue with hydra.run.dir={spec.run_dir}")
        if self.stop_reason == "signal":
            self.stop_flag.stop_served()
            self.checkpoints.maybe_requeue()   # last: Slurm ends the job right away
        return result

    def _set_up(self) -> RunContext:
        """Everything before the first step; returns the context the epochs run on."""
        spec, comm, parts = self.spec, self.comm, self.building
        # Early, so a signal during startup becomes a stop at the first step, not a dead rank.
        self.stop_flag.install(self.rank)
        self.hooks.fail_at("startup")
        self.failure.start(comm)
        self.threads = limit_threads(comm, spec.train["threads_per_rank"],
                                     lanes=thread_lanes(spec.device["cpu_lanes"]))
        self.tracer = trace.start(comm, bool(spec.trace["enabled"]), host=hostname(),
                                  max_events=spec.trace["max_events"])
        parts.policy = policy = make_policy(spec)
        # a pipelined rank's Worker holds its stage, among the stage's replicas (else: as given)
        self.place = place = pipelined.for_rank(spec, comm)
        self.hooks.fail_at("broadcast")     # the initial weights' broadcast follows
        parts.worker = worker = Worker(place.spec, place.comm, log=self.log, fields=policy.bucket_fields,
                                          rank_fields=policy.bucket_rank_fields, fail_at=self.hooks.fail_at)
        self.log(spec.plan)
        cpu_mark = time.process_time()
        with phase("data loading"), trace.span("data.load", "data",
                                               args={"distribution": spec.data.distribution}):
            # before the feed's collectives: a failure takes the abort path, not a hang
            self.hooks.fail_at("data")
            worker.load_data()
        parts.lanes = set_up_lanes(spec, comm, place, worker, self.threads, self.log)
        self.log(self.failure.describe())
        self.stats = RankStats(lanes=self.lanes.names, inventory=inventory(), threads=self.threads)
        self.stats.start_clock(cpu_mark)
        parts.checkpoints = RuntimeCheckpoints(spec, comm, worker, policy, self.log,
                                                  lambda: self.current_totals, pipeline=place.comms)
        self._resume(worker)
        # Ctrl-C now stops at the next step, with a checkpoint: from here on the run writes its
        # segment (config, metrics records), which an exit on the spot would leave half-made.
        self.stop_flag.training_started()
        parts.outputs = RunOutputs(spec, worker, self.log, self.lanes.names) if self.is_root else None
        if self.outputs:
            self.outputs.start(self.resumed_from, self.checkpoints.resumed_config_yaml, self.world_size)
            self.display.open_step_log(worker.steps_per_epoch, worker.step if self.resumed_from else None)
        spares = f" and {self.failure.spares} spare(s)" if self.failure.spares else ""
        self.log(f"{self.world_size} ranks{spares}, lanes on rank 0: {self.lanes.names}, "
                 f"{worker.layout.size} parameters, {worker.steps_per_epoch} steps/epoch")
        self.checkpoints.training_starts()
        return RunContext(**vars(parts))

    def _resume(self, worker) -> None:
        """From the newest checkpoint, where there is one to resume."""
        spec = self.spec
        with phase("resume from a checkpoint"):
            resumed = self.checkpoints.maybe_resume()
        if resumed is not None:
            self.resumed_from, self.carried_totals = resumed.path, resumed.carried_totals
            self.lanes.refresh_device_params()     # device lanes hold a copy of the parameters
        if worker.total_steps and worker.step >= worker.total_steps:
            self.stop_reason = "max_steps"     # resumed at or past train.max_steps: no step to take
        if self.resumed_from and worker.epoch >= int(spec.train["epochs"]):
            self.log(f"the checkpoint is at epoch {worker.epoch}, train.epochs={spec.train['epochs']}: "
                     f"nothing to train (raise train.epochs to train on)")

    def _epochs(self) -> None:
        """Epoch by epoch until train.epochs or a stop: validation, records, checkpoints."""
        spec, worker = self.spec, self.worker
        epochs = int(spec.train["epochs"])
        while worker.epoch < epochs and self.stop_reason is None:
            t_epoch = time.perf_counter()
            with phase("a training step"):
                totals = self.train_epoch()
            epoch_done = (self.stop_reason is None or worker.step_in_epoch >= worker.steps_per_epoch
                          or totals.complete)
            if self.stop_reason == "nonfinite":
                break
            metrics = None
            if not epoch_done and self.stop_reason == "max_steps" and totals.steps:
                # train.max_steps ended the run mid-epoch: validate and record what was trained
                # (marked partial); the epoch stays open, so a resume finishes it
                metrics = self._end_epoch(totals, time.perf_counter() - t_epoch, partial=True)
            if epoch_done:
                metrics = self._end_epoch(totals, time.perf_counter() - t_epoch)
                worker.state.epoch_ended()
                epoch_due = self.checkpoints.epoch_due(worker.epoch)
                if (epoch_due or self.checkpoints.deferred) and self.stop_reason is None:
                    self.save_checkpoint("epoch" if epoch_due else INTERVAL_REASON,
                                         metrics.get(spec.checkpoint["metric"]))
                if self.stop_reason is None:    # else the final or preemption save follows here
                    self.checkpoints.epoch_ended(metrics.get(spec.checkpoint["metric"]))
                if self.tracer is not None:
                    self.tracer.add(f"epoch {worker.epoch}", "epoch", trace.MAIN, t_epoch, time.perf_counter())
            if self.stop_reason == "signal":
                self.log(f"stop requested (signal) at step {worker.step}: writing a checkpoint")
                self.save_checkpoint("preempt", metrics.get(spec.checkpoint["metric"]) if metrics else None)

    def _last_metric(self) -> float | None:
        """The metric of the current parameters: only if they are those of the last validation."""
        hist = self.worker.history
        if not hist or hist[-1].get("step") != self.worker.step:
            return None
        return hist[-1].get(self.spec.checkpoint["metric"])

    def _end_epoch(self, totals: EpochTotals, wall: float, partial: bool = False) -> dict:
        worker = self.worker
        t_eval = time.perf_counter()
        with phase("validation"), trace.span("evaluate", "eval"):
            val, _ = self._survive(self._evaluate, totals)
        sent = worker.bucket.sent.epoch()       # this rank's bytes on the wire, summed over ranks:
        wire, _ = self._survive(lambda: collective.watched_call("wire bytes", self.comm.allreduce, sent), totals)
        self.stats.record_epoch(worker.epoch + 1, totals, wall, time.perf_counter() - t_eval, worker.data_s, sent)
        metrics = epoch_values(Window(dict(totals.counts(), wire_bytes=wire), seconds=totals.step_wall_s,
                                      lr=self.policy.current_lr(worker), per_sample=worker.per_sample))
        worker.check_validation_finite(val["val_loss"], metrics.get("train_loss"))
        rec = {
            "epoch": worker.epoch + 1,
            "step": worker.step,
            **metrics,
            **val,      # val_loss, val_accuracy, val_iou, val_mae: what the model reports
            "compute_s": totals.compute_s,
            "comm_s": totals.comm_s,
            "data_s": worker.data_s if worker.epoch == 0 else 0.0,
            "epoch_s": wall,
            "steps": totals.steps,
            "skipped_steps": worker.skipped_steps,
            "policy": self.policy.name,
        }
        rec.update(self.policy.epoch_record(totals))
        if not worker.has_accuracy:      # regression: no accuracy at all rather than a 0.0
            rec.pop("train_accuracy", None)
            rec.pop("val_accuracy", None)
        if partial:
            rec.update(partial=True, epoch_fraction=round(self.policy.epoch_fraction(worker), 6))
        entry = {k: rec[k] for k in ("epoch", "step", *VAL_KEYS, PER_CLASS, "train_loss") if k in rec}
        if partial:
            # summary.json's final metrics, but not the history: a resume trains the epoch to its
            # end, and the best checkpoint is ranked by whole epochs only
            self.partial_metrics = dict(entry, partial=True)
        else:
            worker.history.append(entry)
        if self.outputs:
            self.outputs.epoch(rec)
        self.display.epoch_end(rec, totals.comm_s, totals.steps, partial)
        return rec

    def _finish(self) -> dict:
        self.phase = FINISH
        worker, st = self.worker, self.stats
        trace_path = Path(self.spec.run_dir) / names.TRACE
        st.lane_samples = {ln.name: ln.samples for ln in self.lanes.lanes}
        st.lane_busy_s = {ln.name: ln.busy_s for ln in self.lanes.lanes}
        st.data_s = worker.data_s
        st.wire_bytes += worker.bucket.sent.epoch()     # sent after the last epoch's record
        def gather_ranks():   # redone over the survivors of a dead rank, who write model and summary
            self.hooks.fail_at("finish")     # debug.fail_point=finish: after the last step
            doc = trace.finish(self.comm, self.tracer, trace_path if self.is_root else None)
            if doc is not None:
                self.log(f"trace: {trace_path} ({len(doc['traceEvents'])} events; open in https://ui.perfetto.dev)")
            worker.close_data()      # collective: stream's rounds in flight complete; staged copies go
            mine = dict(st.report(), rank=self.rank, host=hostname(), wall_s=time.perf_counter() - self.t_start,
                        **worker.feed.report(),    # peak_rss_bytes next to shard_bytes: what data costs
                        # what this rank holds of the model (a pipelined rank: its stage's share)
                        param_bytes=worker.held_param_bytes, optimizer_bytes=worker.optimizer.nbytes(),
                        **({"spare": worker.is_spare} if self.failure.has_spares else {}))
            ranks = self.comm.gather(mine, root=0)
            if self.failure.active:     # a rank lost here: every survivor learns it (gather alone told rank 0)
                self.comm.Barrier()
            return mine, ranks

        (mine, ranks), _ = self._survive(gather_ranks, self.current_totals)
        pipelined.send_final_params(self.place, worker)
        self.lanes.close()
        final = self.partial_metrics or (worker.history[-1] if worker.history else {})
        result = {
            "status": self.stop_reason or "completed",
            "epochs_completed": worker.epoch,
            "steps": worker.step,
            "skipped_steps": worker.skipped_steps,
            "final": final,
            "world_size": self.world_size,
            "resumed_from": self.resumed_from,
            "trace": str(trace_path) if self.tracer is not None else None,
            "ranks": ranks,
        }
        if self.failure.active:
            result["failures"] = self.failure.failures
        if self.failure.has_spares:
            result["spares_left"] = self.failure.spares
        if self.is_root:
            self.close_displays()
            params = pipelined.final_params(self.place, worker, self.spec.graph)
            self.outputs.finish(result, params)
            for _ in params:    # what finish did not write (a non-finite model): received all the same
                pass
            if self.stop_reason not in ("nonfinite", "interrupted"):   # those end with their own line
                self.log(end_line(result["status"], mine["wall_s"], final, self.spec.run_dir)
                         + self.failure.end_note(self.world_size))
        if self.stop_reason == "nonfinite":
            # Decided from the bucket, so every rank raises this same error in the same step.
            raise collective.CollectiveError(kind="NonFiniteError", message=
                f"non-finite loss or gradient at step {worker.step} (train.on_nonfinite=stop); "
                f"no checkpoint was written from that state. If the data may hold NaN or Inf, "
                f"data.check_finite=true names the first such row at load time; else lower optim.lr, "
                f"set optim.clip_grad_norm, or train.on_nonfinite=skip")
        return result


def train(spec: TrainSpec, comm, earlier=None) -> dict:
    """Train on every rank of `comm`; returns the run result (same on every rank except
    `ranks`, which only rank 0 holds). `earlier`: what failed starts left
    (`resilience.startup`). An error leaves as `RunFailed`: its `RunFailure` names the step,
    the run's phase and the way to abandon the node's shared window."""

    run = Run(spec, comm, earlier)

    def position() -> int | None:
        worker = run.worker
        return None if worker is None else worker.step

    with StallWatchdog.from_spec(spec, comm, position, stall=run.hooks.stall):
        try:
            return run.execute()
        except Exception as exc:
            run.close_displays()       # no half-drawn bar above the error message
            if run.worker is not None:     # the reader stops, the staged copies go; MPI only if all are here
                run.worker.close_data(collective_ok=isinstance(exc, collective.CollectiveError))
            abandon = None if run.worker is None else run.worker.bucket.abandon_node_memory
            raise RunFailed(RunFailure(exc, position(), run.phase, abandon)) from exc
        finally:
            run.failure.close()      # the watchdog a recovery started over the survivors
