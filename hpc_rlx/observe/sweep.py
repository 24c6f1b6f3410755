"""Sweep summary: after a Hydra multirun, rank 0 writes one table of every point's
overrides and final metrics (`sweep_summary.md` and `sweep_summary.json` in the sweep dir,
built by `sweep_table`). This module is Hydra's callback, so only rank 0 imports Hydra."""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.observe.sweep_table import collect, render, write_summary  # noqa: F401 - re-exported


def _is_rank0() -> bool:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return os.environ[var] == "0"
    try:
        from mpi4py import MPI
        if MPI.Is_initialized():
            return MPI.COMM_WORLD.rank == 0
    except ImportError:
        pass
    return True


class SweepSummary(Callback):
    def on_job_start(self, config, **kwargs) -> None:
        # Record each point's overrides in its own directory (rank 0 only).
        if not _is_rank0():
            return
        try:
            hc = HydraConfig.get()
            if hc.mode is not None and str(hc.mode).endswith("MULTIRUN"):
                out = Path(hc.runtime.output_dir)
                out.mkdir(parents=True, exist_ok=True)
                (out / names.OVERRIDES).write_text(" ".join(hc.overrides.task) + "\n")
        except Exception:  # noqa: BLE001 - bookkeeping must never break a run
            pass

    def on_multirun_end(self, config, **kwargs) -> None:
        if not _is_rank0():
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            out = write_summary(sweep_dir)
            print(f"[hpc_rlx] sweep summary: {out}")
            print(out.read_text())
