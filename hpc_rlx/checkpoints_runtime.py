"""Checkpoints in a running job: cadence, what goes in, collective save/resume, requeue.

The storage layer (atomic HDF5 files, checksums, retention) is `hpc_rlx.checkpoint`; this
module decides *when* (identically on every rank), gathers *what*, and moves it over MPI:
rank 0 writes and reads, everybody else receives by buffer Bcast.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from . import comm as mpi
from .errors import CheckpointError


class RuntimeCheckpoints:
    def __init__(self, run):
        from .checkpoint import CheckpointManager

        self.run = run
        cfg = run.spec.checkpoint
        self.every_steps = cfg.get("every_steps")
        self.every_epochs = cfg.get("every_epochs")
        self.every_minutes = cfg.get("every_minutes")
        self.directory = Path(run.spec.run_dir) / "checkpoints"
        self.manager = CheckpointManager(self.directory, keep_last=int(cfg["keep_last"]),
                                         metric=cfg["metric"]) if run.is_root else None
        self._last_save = time.monotonic()
        self.saved_step = None
        self.enabled = bool(self.every_steps or self.every_epochs or self.every_minutes)

    # ---- cadence (all ranks evaluate these on the same agreed numbers) -------------------
    def steps_due(self, step: int) -> bool:
        return bool(self.every_steps) and step % int(self.every_steps) == 0

    def epoch_due(self, epoch: int) -> bool:
        return bool(self.every_epochs) and epoch % int(self.every_epochs) == 0

    def minutes_due(self) -> bool:
        """Only rank 0's answer counts: it travels in the bucket's `ckpt_due` slot."""
        return bool(self.every_minutes) and time.monotonic() - self._last_save >= 60 * float(self.every_minutes)

    # ---- save -------------------------------------------------------------------------
    def _state(self):
        from .checkpoint import CheckpointState

        run, ctx = self.run, self.run.ctx
        opt = ctx.optimizer.state_dict()
        arrays = {"params": np.asarray(ctx.params)}
        for k, v in opt["arrays"].items():
            arrays[f"opt/{k}"] = np.asarray(v)
        pstate = run.policy.state_dict()
        for k, v in pstate.get("arrays", {}).items():
            arrays[f"policy/{k}"] = np.asarray(v)
        meta = {
            "epoch": ctx.epoch,
            "step": ctx.step,
            "step_in_epoch": ctx.step_in_epoch,
            "skipped_steps": ctx.skipped_steps,
            "optimizer": {"name": run.spec.optim["name"], "scalars": opt["scalars"]},
            "policy": {"name": run.policy.name, "state": pstate.get("meta", {})},
            # Shuffling and dropout are pure functions of (seed, epoch, step, rank): the seed
            # and the position are the whole RNG state.
            "rng": {"seed": int(run.spec.train["seed"]), "epoch": ctx.epoch, "step": ctx.step},
            "shard_positions": {"scheme": "rows", "epoch": ctx.epoch, "step_in_epoch": ctx.step_in_epoch,
                                "per_rank": pstate.get("meta", {}).get("positions")},
            "history": ctx.history,
            "world_size": run.comm.size,
            "graph_fingerprint": ctx.graph.fingerprint(),
            "config_yaml": run.spec.config_yaml,
            "dtype": run.spec.train["dtype"],
        }
        return CheckpointState(arrays=arrays, meta=meta)

    def save(self, run, reason: str, metric: float | None) -> None:
        ctx = run.ctx
        if self.saved_step == ctx.step:
            return
        t0 = time.perf_counter()

        def _write():
            path = self.manager.save(self._state(), step=ctx.step, metric_value=metric)
            return str(path)
        # A failed write (disk full ...) raises the same CheckpointError on every rank.
        path = mpi.root_computes(run.comm, _write)
        self.saved_step = ctx.step
        self._last_save = time.monotonic()
        run.log(f"checkpoint ({reason}) at step {ctx.step}: {path} "
                f"[{time.perf_counter() - t0:.2f}s]")

    # ---- resume -----------------------------------------------------------------------
    def _find(self) -> str | None:
        choice = self.run.spec.resume
        if choice in ("none", "null", "None", "", "false", "False"):
            return None
        if choice == "auto":
            p = self.manager.latest_valid(warn=lambda m: self.run.log(f"warning: {m}"))
            return str(p) if p else None
        if not Path(choice).exists():
            raise CheckpointError(f"resume={choice}: no such checkpoint file")
        return choice

    def maybe_resume(self) -> None:
        from .checkpoint import check_compatible, read_checkpoint

        run, ctx, comm = self.run, self.run.ctx, self.run.comm
        holder = {}

        def _load():
            path = self._find()
            if path is None:
                return None
            state = read_checkpoint(path)
            check_compatible(state, ctx.graph.fingerprint())
            if state.meta.get("dtype", run.spec.train["dtype"]) != run.spec.train["dtype"]:
                raise CheckpointError(f"checkpoint {path} was written with train.dtype="
                                      f"{state.meta.get('dtype')}, this run uses {run.spec.train['dtype']}")
            holder["state"] = state
            if run.spec.resume == "auto":
                self.manager.restore_history(path)
            shapes = {k: (v.shape, v.dtype.str) for k, v in state.arrays.items()}
            return {"path": path, "meta": state.meta, "shapes": shapes}
        info = mpi.root_computes(comm, _load)
        if info is None:
            return
        arrays = {}
        for name, (shape, dt) in sorted(info["shapes"].items()):
            arr = holder["state"].arrays[name] if comm.rank == 0 else np.empty(shape, dtype=np.dtype(dt))
            arr = np.ascontiguousarray(arr)
            comm.Bcast(arr, root=0)
            arrays[name] = arr
        meta = info["meta"]
        ctx.params[...] = arrays["params"]
        ctx.optimizer.load_state_dict({
            "arrays": {k[4:]: v for k, v in arrays.items() if k.startswith("opt/")},
            "scalars": meta["optimizer"]["scalars"]})
        run.policy.load_state_dict({
            "arrays": {k[7:]: v for k, v in arrays.items() if k.startswith("policy/")},
            "meta": meta["policy"]["state"], "world_size": meta["world_size"]})
        ctx.epoch, ctx.step = int(meta["epoch"]), int(meta["step"])
        ctx.step_in_epoch = int(meta["step_in_epoch"])
        ctx.skipped_steps = int(meta.get("skipped_steps", 0))
        ctx.history = list(meta.get("history", []))
        self.saved_step = ctx.step
        run.resumed_from = info["path"]
        run.log(f"resumed from {info['path']} (epoch {ctx.epoch}, step {ctx.step}, "
                f"written on {meta['world_size']} ranks)")

    # ---- Slurm requeue ------------------------------------------------------------------
    def maybe_requeue(self) -> None:
        run = self.run
        job = os.environ.get("SLURM_JOB_ID")
        if not (run.is_root and run.spec.checkpoint.get("requeue") and job):
            return
        try:
            out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
            run.log(f"scontrol requeue {job}: rc={out.returncode} {out.stderr.strip()}")
        except (OSError, subprocess.TimeoutExpired) as e:
            run.log(f"warning: scontrol requeue {job} failed: {e}")


def state_summary(state) -> str:
    return json.dumps({k: (v.shape, str(v.dtype)) for k, v in state.arrays.items()})
