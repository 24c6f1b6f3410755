"""Entry point: every rank runs this.

    mpirun -n 4 python -m hpc_rlx                                  # default job
    mpirun -n 4 python -m hpc_rlx model=cnn optim=adamw optim.lr=3e-3
    mpirun -n 4 python -m hpc_rlx -m optim.lr=0.1,0.05 policy=sync,cadence   # sweep, in lockstep
    sbatch slurm/train.sh model=cnn train.epochs=20

MPI starts before Hydra so that all ranks agree on one run directory (a known trap: each
process computing its own timestamped directory), and so that only rank 0 writes Hydra's
files. The Hydra task is a thin wrapper: the work is `hpc_rlx.train.train(spec, comm)`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

_CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def _run_id(comm) -> str:
    """One run id for all ranks: the Slurm job id when there is one, else rank 0's clock."""
    rid = None
    if comm.rank == 0:
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            rid = f"slurm-{job}"
            if os.environ.get("SLURM_ARRAY_TASK_ID"):
                rid += f"_{os.environ['SLURM_ARRAY_TASK_ID']}"
        else:
            base = time.strftime("%Y-%m-%d_%H-%M-%S")
            rid, k = base, 1
            # Two jobs started in the same second must not share (and resume from) one dir.
            while Path("outputs", rid).exists() or Path("multirun", rid).exists():
                rid, k = f"{base}-{k}", k + 1
    return comm.bcast(rid, root=0)


def _rank_overrides(rank: int) -> list[str]:
    # Non-root ranks compose the same config but write nothing: no logs, no .hydra dir.
    if rank == 0:
        return []
    return ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled", "hydra.output_subdir=null"]


def _error_exit(comm, exc: BaseException, where: str) -> None:
    """User errors (agreed on every rank) print once and exit 2; anything else aborts the job."""
    from .comm import CollectiveError, abort, hostname
    from .errors import HpcRlxError

    if isinstance(exc, CollectiveError) or (isinstance(exc, HpcRlxError) and getattr(exc, "agreed", False)):
        origin = getattr(exc, "origin", 0)
        if comm.rank == 0:
            kind = getattr(exc, "kind", type(exc).__name__)
            sys.stderr.write(f"hpc_rlx: error ({kind}, reported by rank {origin}): {exc}\n")
            sys.stderr.flush()
        sys.stdout.flush()
        raise SystemExit(2)
    step = getattr(exc, "step", None)
    detail = str(exc) if isinstance(exc, HpcRlxError) else "".join(traceback.format_exception(exc)).rstrip()
    abort(comm, f"hpc_rlx: rank {comm.rank} on {hostname()} failed during {where}"
                f"{'' if step is None else f' at step {step}'}: {detail}\n"
                f"hpc_rlx: aborting all {comm.size} ranks", code=1)


def run_job(cfg, comm) -> float | None:
    """Compose the spec on rank 0, ship it, train. Returns the final val_loss (for sweeps)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from . import comm as mpi
    from .spec import TrainSpec, build_spec
    from .train import maybe_fail, train

    run_dir = HydraConfig.get().runtime.output_dir
    where = "startup"
    try:
        def _spec():
            container = OmegaConf.to_container(cfg, resolve=True)
            return build_spec(container, run_dir, comm.size,
                              config_yaml=OmegaConf.to_yaml(cfg, resolve=True)).to_dict()
        spec = TrainSpec.from_dict(mpi.root_computes(comm, _spec))
        mpi.agree(comm, lambda: maybe_fail(spec, comm.rank, "startup"))
        where = "training"
        result = train(spec, comm)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must end the whole job
        if isinstance(exc, KeyboardInterrupt):
            raise
        _error_exit(comm, exc, where)
        raise
    final = result.get("final") or {}
    return final.get("val_loss")


def main() -> None:
    from mpi4py import MPI
    from omegaconf import OmegaConf

    comm = MPI.COMM_WORLD
    rid = _run_id(comm)
    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: rid)
    sys.argv.extend(_rank_overrides(comm.rank))

    import hydra

    @hydra.main(config_path=_CONFIG_DIR, config_name="config", version_base="1.3")
    def _task(cfg):
        return run_job(cfg, comm)

    _task()


if __name__ == "__main__":
    main()
