"""Checkpoints in a running job: save triggers, what goes in, collective save/resume, requeue.
Storage (atomic HDF5 files, checksums, retention) is `hpc_rlx.checkpoint`; this module decides
*when* (identically on every rank), gathers *what*, and moves it over MPI: rank 0 writes and
reads, the others receive by buffer Bcast (what each rank holds alone: `rank_states.py`).
Every decision that leads to a collective is taken on numbers all ranks agree on (step, epoch,
the flags of the step's bucket), and a failure on rank 0 is broadcast as one error: no rank
waits in a collective the others skipped.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hpc_rlx.checkpoint import CheckpointManager, CheckpointState, check_compatible, checkpoints_dir, read_checkpoint
from hpc_rlx.checkpoint.data_files import check_data_files, data_files_record
from hpc_rlx.checkpoint.triggers import BestWatch, SaveTriggers
from hpc_rlx.checkpoint import rank_states
from hpc_rlx.checkpoint.graph_match import check_run_dir_graph, frozen_record
from hpc_rlx.checkpoint.staged_file import open_arrays
from hpc_rlx.checkpoint.stages import StagedCheckpoint
from hpc_rlx.comm import collective
from hpc_rlx.base.errors import CheckpointError
from hpc_rlx.policies.registry import POLICIES

log = logging.getLogger(__name__)

_NO_RESUME = ("none", "null", "", "false", "no", "off")
# What fixes which rows a step uses: if any of it differs, a mid-epoch position means nothing.
_PLAN_KEYS = ("n_samples", "global_batch", "leftover", "steps_per_epoch", "seed", "shuffle")


def bcast_arrays(comm, arrays: dict | None, shapes: dict) -> dict:
    """Rank 0's `arrays` on every rank, one buffer Bcast each (never pickled).

    shapes: name -> (shape, dtype.str), known to all ranks. Shapes are kept exactly, 0-d
    included (np.ascontiguousarray would make a 0-d array 1-d).
    """
    out = {}
    for name in sorted(shapes):
        shape, dt = shapes[name]
        if comm.rank == 0:
            arr = arrays[name]
            if not arr.flags.c_contiguous:
                arr = arr.copy(order="C")
        else:
            arr = np.empty(tuple(shape), dtype=np.dtype(dt))
        comm.Bcast(arr, root=0)
        out[name] = arr
    return out


@dataclass
class Resumed:
    """What a resume hands back to the loop."""
    path: str
    carried_totals: dict | None     # a mid-epoch checkpoint's running epoch totals


class RuntimeCheckpoints:
    """Checkpoints of one run. It sees the spec, the communicator, the rank's worker (params,
    optimizer, position), the policy (its state) and two callbacks, not the whole run.

    pipeline: a pipelined rank's ``PipelineComms`` (its worker holds one stage): the file is
    still the whole model's, moved one stage at a time (``checkpoint/stages.py``)."""

    def __init__(self, spec, comm, worker, policy, log: Callable[[str], None],
                 epoch_totals: Callable[[], object], pipeline=None):
        self.spec, self.comm, self.worker, self.policy = spec, comm, worker, policy
        self.staged = None if pipeline is None else StagedCheckpoint(
            spec.graph, pipeline, comm, spec.parallel.get("cut_points"))
        # the whole model's fingerprint, whichever share of it this rank holds
        self.fingerprint = worker.graph.fingerprint() if self.staged is None else self.staged.fingerprint
        self.is_root = comm.rank == 0
        self.log = log
        self._epoch_totals = epoch_totals    # the running totals of the epoch being trained
        cfg = spec.checkpoint
        self.triggers = SaveTriggers.from_config(cfg)
        self.directory = checkpoints_dir(spec.run_dir)
        self.manager = CheckpointManager(self.directory, keep_last=int(cfg["keep_last"]),
                                         metric=cfg["metric"]) if self.is_root else None
        self.saved_step: int | None = None
        self._saved_at: tuple | None = None     # (step, epoch, step_in_epoch) of the last save
        # An interval save that falls on the last step of an epoch waits for that epoch's
        # validation, so the file holds a finished epoch and its metric (see Run).
        self.deferred = False
        self.enabled = self.triggers.enabled
        # Rank 0: the best epoch end not yet on disk, (step, metric, state copy); written just
        # before the next save, so the best survives without a file per epoch.
        self.best = BestWatch(cfg["metric"])
        self._unsaved_best: tuple | None = None
        self.resumed_config_yaml: str | None = None   # what the resumed checkpoint trained with

    def rebuild(self, survivors) -> None:     # after a dead rank: resilience.hooks.RankLossHook
        """Where rank 0 died, the survivors' rank 0 writes the checkpoints from here on (the best
        epoch rank 0 held in memory only, not yet on disk, is lost with it)."""
        self.comm = survivors.comm
        if not survivors.new_writer:
            return
        cfg = self.spec.checkpoint
        self.is_root = True
        self.manager = CheckpointManager(self.directory, keep_last=int(cfg["keep_last"]), metric=cfg["metric"])

    # ---- save triggers (all ranks evaluate these on the same agreed numbers) -------------
    def steps_due(self, step: int) -> bool:
        return self.triggers.steps_due(step)

    def epoch_due(self, epoch: int) -> bool:
        return self.triggers.epoch_due(epoch)

    def minutes_due(self) -> bool:
        """Only rank 0's answer counts: it travels in the bucket's `ckpt_due` slot."""
        return self.triggers.minutes_due()

    def training_starts(self) -> None:
        """The minutes interval counts training time, not data loading or resume."""
        self.triggers.restart()
        self.log(f"checkpoints: {self.triggers.describe()}, keeping the best by "
                     f"{self.spec.checkpoint['metric']}")

    def epoch_ended(self, metric: float | None) -> None:
        """Rank 0, at an epoch boundary after validation: remember the state if it is the best
        so far. A save at this same step writes it anyway, with its metric."""
        step = self.worker.step
        if not (self.enabled and self.is_root) or not self.best.offer(step, metric):
            return
        if (self.saved_step == step or self.worker.epoch >= int(self.spec.train["epochs"])
                or self.staged is not None or self.worker.shard is not None):
            # a pipelined rank 0 holds one stage, and under comm.shard=optimizer one slice of the
            # optimizer state, so no copy of the whole state: its best is the best of the
            # checkpoints written
            self._unsaved_best = None       # this epoch's own save, or the final one, holds it
            return
        state = self._state()
        # a copy: training goes on changing the parameters, optimizer state and history
        state.arrays = {k: np.array(v, copy=True) for k, v in state.arrays.items()}
        state.meta = copy.deepcopy(state.meta)
        self._unsaved_best = (step, metric, state)
        log.debug("best %s so far at step %d (%s): kept in memory until the next save",
                  self.spec.checkpoint["metric"], step, metric)

    def _write_unsaved_best(self, step: int) -> None:
        """Rank 0, inside a save at `step`: first write the best epoch end since the last save."""
        best, self._unsaved_best = self._unsaved_best, None
        if best is None or best[0] >= step or (self.saved_step is not None and best[0] <= self.saved_step):
            return
        path = self.manager.save(best[2], step=best[0], metric_value=best[1])
        self.log(f"checkpoint (best) at step {best[0]}: {path}")

    # ---- what goes into a checkpoint ----------------------------------------------------
    def _plan(self) -> dict:
        worker, spec = self.worker, self.spec
        return {"n_samples": int(worker.plan.n_samples), "global_batch": int(worker.plan.global_batch),
                "leftover": worker.plan.leftover, "steps_per_epoch": int(worker.steps_per_epoch),
                "seed": int(spec.train["seed"]), "shuffle": bool(spec.data.shuffle)}

    def _totals(self) -> dict | None:
        t = self._epoch_totals()
        if not self.worker.step_in_epoch or t is None:
            return None
        return t.carried()

    def _state(self, opt: dict | None = None, staged=None):
        worker, spec = self.worker, self.spec
        opt = opt or worker.optimizer.state_dict()
        arrays = {"params": np.asarray(worker.params)}
        for k, v in opt["arrays"].items():
            arrays[f"opt/{k}"] = np.asarray(v)
        pstate = self.policy.state_dict()
        for k, v in pstate.get("arrays", {}).items():
            arrays[f"policy/{k}"] = np.asarray(v)
        if staged is not None:
            if pstate.get("arrays"):
                raise CheckpointError(f"policy={self.policy.name} keeps state arrays; a pipelined "
                                      f"checkpoint holds none")
            arrays = staged     # rank 0's stage, then the others as they arrive
        per_rank = pstate.get("meta", {}).get("positions")
        if per_rank is None:   # policy=sync: every rank is at the same step of its rows
            per_rank = [worker.step_in_epoch] * self.comm.size
        meta = {
            **worker.state.checkpoint_meta(),
            "optimizer": {"name": spec.optim["name"], "scalars": opt["scalars"]},
            "policy": {"name": self.policy.name, "state": pstate.get("meta", {})},
            # Shuffling and dropout are pure functions of (seed, epoch, step, rank): the seed
            # and the position are the whole RNG state.
            "rng": {"seed": int(spec.train["seed"]), "epoch": worker.epoch, "step": worker.step},
            "shard_positions": {"scheme": "rows", "epoch": worker.epoch, "step_in_epoch": worker.step_in_epoch,
                                "per_rank": per_rank},
            "plan": self._plan(),
            "data_files": data_files_record(spec.data),     # names and sample counts, checked at a resume
            "schedule_steps": worker.schedule_steps,
            "epoch_totals": self._totals(),
            "history": worker.history,
            "world_size": self.comm.size,
            "graph_fingerprint": self.fingerprint, **frozen_record(spec.graph),     # and its frozen parameters
            "config_yaml": spec.config_yaml,
            # which training this is (hpc_rlx.config.fingerprint): decides which runs continue it
            "config_fingerprint": spec.config_fingerprint,
            "dtype": spec.train["dtype"],
        }
        return CheckpointState(arrays=arrays, meta=meta)

    # ---- save (collective: every rank calls it at the same step) -------------------------
    def save(self, reason: str, metric: float | None) -> None:
        worker = self.worker
        at = (worker.step, worker.epoch, worker.step_in_epoch)
        self.deferred = False
        if self._saved_at == at:
            return          # e.g. the final save right after an epoch save: same state
        t0 = time.perf_counter()

        opt = staged = drain = None
        ranks = rank_states.gather(self.comm, self.policy, worker)
        if worker.shard is not None:
            # collective over the worker's ranks (a stage's replicas with pipeline stages):
            # its rank 0 gets the whole state, the others None
            opt = worker.optimizer_state_for_checkpoint()
        if self.staged is not None:
            if worker.shard is None:
                opt = worker.optimizer.state_dict()
            self.staged.send(worker.params, opt["arrays"] if opt else {})    # replica 0 of stages > 0
            if self.is_root:
                staged, drain = self.staged.staged(np.asarray(worker.params), opt["arrays"])

        def _write():
            try:
                self._write_unsaved_best(worker.step)
                state = self._state(opt, staged)
                rank_states.into_file(ranks, state.arrays, state.meta)
                return str(self.manager.save(state, step=worker.step, metric_value=metric))
            finally:
                if drain is not None:
                    drain()    # the stages a failed save did not receive: no sender waits
        # A failed write (disk full ...) raises the same CheckpointError on every rank; the
        # previous checkpoint and the `latest` pointer are then untouched.
        path = collective.root_computes(self.comm, _write)
        self.saved_step, self._saved_at = worker.step, at
        self.triggers.restart()
        held = (f", stages received one at a time: at most {self.staged.held_bytes} bytes held"
                if self.staged is not None and self.is_root else "")
        self.log(f"checkpoint ({reason}) at step {worker.step}: {path} "
                f"[{time.perf_counter() - t0:.2f}s{held}]")

    # ---- resume -----------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        self.log(f"warning: {message}")

    def _read_choice(self):
        """Rank 0: the checkpoint `resume=` asks for, read and verified, or None."""

        choice = str(self.spec.resume).strip()
        if choice.lower() in _NO_RESUME:
            self._refuse_to_start_over(choice)
            return None
        if choice == "auto":
            state = self.manager.load_latest(warn=self._warn, arrays=self.staged is None)
            present = self.manager.steps()
            log.debug("resume=auto: checkpoint steps in %s: %s; resuming %s", self.directory,
                      present, None if state is None else state.path)
            if state is None and present:
                # Never start over silently next to checkpoints that exist: a storage hiccup
                # would otherwise cost the whole run.
                names = ", ".join(self.manager.path_for(s).name for s in present)
                raise CheckpointError(
                    f"resume=auto: none of the checkpoints in {self.directory} can be read ({names}); "
                    f"see the warnings above. Use resume=PATH for a specific file, or start over in "
                    f"a new hydra.run.dir")
            return state
        path = Path(choice).expanduser()
        if path.is_dir():
            # a run directory or its checkpoints/ directory: the newest valid checkpoint there
            where = checkpoints_dir(path) if checkpoints_dir(path).is_dir() else path
            state = CheckpointManager(where).load_latest(warn=self._warn, arrays=self.staged is None)
            if state is None:
                raise CheckpointError(f"resume={choice}: no readable checkpoint (ckpt-<step>.h5) in {where}")
            return state
        if not path.exists():
            raise CheckpointError(f"resume={choice}: no such checkpoint file or directory")
        # a pipelined rank 0 leaves the arrays in the (verified) file: it reads one stage at a time
        return read_checkpoint(path, arrays=self.staged is None)

    def _refuse_to_start_over(self, choice: str) -> None:
        """resume=none starts from step 0, so it would overwrite the checkpoints (and `latest`)
        of a training in this directory, which resume=auto would continue: refused. A directory
        without checkpoints has nothing to continue; a run there starts a new segment either way."""
        steps = self.manager.steps()
        if not steps:
            return
        raise CheckpointError(
            f"resume={choice} starts over, but run directory {self.spec.run_dir} already holds a "
            f"training ({self.directory.name}/{self.manager.path_for(steps[-1]).name}), whose "
            f"checkpoints it would overwrite. Start over in a new directory (hydra.run.dir=...), "
            f"or leave out resume={choice} to continue that training")

    def _check(self, state) -> None:
        """Rank 0: refuse a checkpoint this run cannot continue exactly."""

        worker = self.worker
        check_compatible(state, self.fingerprint, frozen_record(self.spec.graph))
        check_data_files(state.meta, self.spec.data, state.path)
        if self.staged is not None:
            self.staged.check({name: tuple(shape) for name, _, shape in state.info["arrays"]},
                              worker.optimizer.state_dict()["arrays"], state.path)
        meta, where = state.meta, state.path
        if meta.get("dtype", self.spec.train["dtype"]) != self.spec.train["dtype"]:
            raise CheckpointError(f"checkpoint {where} was written with train.dtype={meta.get('dtype')}, "
                                  f"this run uses train.dtype={self.spec.train['dtype']}")
        opt = (meta.get("optimizer") or {}).get("name")
        if opt is not None and opt != self.spec.optim["name"]:
            raise CheckpointError(
                f"checkpoint {where} holds optim={opt} state, this run uses optim={self.spec.optim['name']}; "
                f"to start a new optimizer from those weights, use model.init_from=<run_dir>/model.h5")
        policy = (meta.get("policy") or {}).get("name")
        saved_policy = POLICIES.get(policy)
        if (saved_policy is not None and not saved_policy.steps_are_batches
                and self.policy.steps_are_batches and int(meta.get("step_in_epoch", 0)) > 0):
            # A windowed policy counts syncs, not sample steps: its mid-epoch position has no
            # meaning for sync.
            raise CheckpointError(
                f"checkpoint {where} stopped in the middle of an epoch under policy={policy}; "
                f"resume it with policy={policy}, or from an end-of-epoch checkpoint")
        if meta.get("schedule_steps") not in (None, worker.schedule_steps):
            self._warn(f"the LR schedule now spans {worker.schedule_steps} steps (train.epochs x steps/epoch), "
                       f"checkpoint {where} was on one of {meta['schedule_steps']}: the learning-rate curve "
                       f"changes from here on; to stop early and resume exactly, keep train.epochs and use "
                       f"train.max_steps")
        saved, now = meta.get("plan"), self._plan()
        if saved:
            changed = {k: (saved.get(k), now[k]) for k in _PLAN_KEYS if saved.get(k) != now[k]}
            if changed and int(meta.get("step_in_epoch", 0)) > 0:
                detail = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
                raise CheckpointError(
                    f"checkpoint {where} stopped in the middle of epoch {int(meta['epoch']) + 1} "
                    f"(step {meta['step_in_epoch']} of {saved.get('steps_per_epoch')}), but the data plan "
                    f"changed ({detail}), so that position means other samples now; resume with the same "
                    f"train.batch_size, train.seed and data settings, or from an end-of-epoch checkpoint")
            if changed:
                self._warn(f"the data plan differs from checkpoint {where} "
                           f"({', '.join(sorted(changed))}); continuing from its epoch boundary")

    def maybe_resume(self) -> Resumed | None:
        """Collective: rank 0 picks, reads and checks; everyone receives the arrays by Bcast (a
        pipelined rank: its stage's share, which rank 0 reads from the file stage by stage)."""
        with ExitStack() as files:
            return self._resume(files)

    def _resume(self, files: ExitStack) -> Resumed | None:
        worker, comm = self.worker, self.comm
        holder = {}

        def _load():
            state = self._read_choice()
            if state is not None:
                self._check(state)
            # with or without checkpoints, the run directory's graph.json is the model its
            # model.h5 and metrics belong to
            check_run_dir_graph(self.spec.run_dir, self.fingerprint)
            if state is None:
                return None
            # Best tracking from the recorded history, later checkpoints moved aside: only
            # now that the checkpoint has been accepted.
            self.manager.restore_history(state, warn=self._warn)
            self.best.seed(self.manager.best_step, self.manager.best_value)
            holder["state"] = state
            if self.staged is not None:     # opened here, so a failure is every rank's error
                holder["file"] = files.enter_context(open_arrays(state.path))
            state.arrays, holder["ranks"] = rank_states.split(state.arrays)
            shapes = {k: (list(v.shape), v.dtype.str) for k, v in state.arrays.items()}
            return {"path": str(state.path), "meta": state.meta, "shapes": shapes}
        info = collective.root_computes(comm, _load)
        if info is None:
            return None
        if self.staged is None:
            arrays = bcast_arrays(comm, holder["state"].arrays if comm.rank == 0 else None, info["shapes"])
        else:   # each stage its share, by name, read from the file (sync keeps no policy arrays)
            arrays = self.staged.scatter(holder.get("file"), worker.optimizer.state_dict()["arrays"],
                                         worker.params.dtype)
        own = rank_states.hand_back(comm, holder.get("ranks"), info["meta"])
        holder.clear()
        # Every rank holds the same data, so these checks fail everywhere or nowhere.
        collective.agree(comm, lambda: self._apply(info, arrays))
        self.policy.load_rank_state(own)
        meta = info["meta"]
        self.resumed_config_yaml = meta.get("config_yaml")
        where = (f"in epoch {worker.epoch + 1} at step {worker.step_in_epoch}/{worker.steps_per_epoch}"
                 if worker.step_in_epoch else f"after epoch {worker.epoch}")
        ranks = (f"written on {meta['world_size']} ranks, shards re-planned for {comm.size}"
                 if int(meta["world_size"]) != comm.size else f"written on {comm.size} ranks")
        self.log(f"resumed from {info['path']}: global step {worker.step}, {where} ({ranks})")
        return Resumed(info["path"], meta.get("epoch_totals") if worker.step_in_epoch else None)

    def _apply(self, info: dict, arrays: dict) -> None:
        worker = self.worker
        meta = info["meta"]
        params = arrays["params"]
        if params.shape != worker.params.shape:
            raise CheckpointError(f"checkpoint {info['path']} holds {params.size} parameters, "
                                  f"the model has {worker.params.size}")
        worker.set_params(params)
        worker.load_optimizer_state({
            "arrays": {k[4:]: v for k, v in arrays.items() if k.startswith("opt/")},
            "scalars": meta["optimizer"]["scalars"]})
        self.policy.load_state_dict({
            "arrays": {k[7:]: v for k, v in arrays.items() if k.startswith("policy/")},
            "meta": meta["policy"]["state"], "world_size": meta["world_size"]})
        worker.state.restore(meta, worker.steps_per_epoch, info["path"])
        worker.history = list(meta.get("history", []))
        self.saved_step = worker.step
        self._saved_at = (worker.step, worker.epoch, worker.step_in_epoch)

    # ---- Slurm requeue ------------------------------------------------------------------
    def maybe_requeue(self) -> None:
        """After a preemption checkpoint: `scontrol requeue $SLURM_JOB_ID` (rank 0 only).

        Collective when checkpoint.requeue is set. Called once the run's outputs are written,
        because Slurm ends the job right away. The requeued job keeps its id, so it finds the
        same run directory and resumes there. (slurm/train.sh requeues from the batch shell
        after every rank has exited instead, and turns this off.)
        """
        if not self.spec.checkpoint["requeue"]:
            return
        self.comm.Barrier()      # every rank has finished its work before Slurm ends the job
        if not self.is_root:
            return
        job = os.environ.get("SLURM_JOB_ID")
        if not job:
            self.log("checkpoint.requeue=true but this is not a Slurm job (no SLURM_JOB_ID): not requeued")
            return
        scontrol = shutil.which("scontrol") or "scontrol"
        try:
            out = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.log(f"warning: scontrol requeue {job} failed: {e}; resubmit the job to resume "
                    f"from its checkpoint")
            return
        if out.returncode == 0:
            self.log(f"requeued Slurm job {job}: it resumes from its latest checkpoint")
        else:
            self.log(f"warning: scontrol requeue {job} exited {out.returncode}: "
                    f"{(out.stderr or out.stdout).strip()}; resubmit the job to resume from its checkpoint")
