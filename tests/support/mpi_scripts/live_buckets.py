"""Trains in this process, then reports what it holds: the fused buckets alive and the host
arrays of the compute dtype as long as the parameter vector or longer.

Usage: mpirun -n N python live_buckets.py DATA.h5 RUN_DIR OUT.json [OVERRIDE ...]

Rank 0 writes OUT.json: {"buckets": live FusedBucket objects, "param_sized": one entry per
distinct memory block of at least the parameters' size in the compute dtype, "shared": whether
the policy's sync writes into the worker's bucket (null for a policy without a sync buffer)}.
Found by walking the garbage collector's objects after training, with the run still alive.
"""

import gc
import json
import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir
from mpi4py import MPI
from omegaconf import OmegaConf

from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.config.spec import build_spec
from hpc_rlx.runtime.train import Run

CONFIGS = Path(__file__).resolve().parents[3] / "hpc_rlx" / "configs"


def owner(a: np.ndarray):
    """The array that owns `a`'s memory (the end of its chain of views)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def main() -> None:
    data, run_dir, out = sys.argv[1:4]
    comm = MPI.COMM_WORLD
    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "live")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=[f"data.path={data}", "checkpoint=off",
                                           "report.plots=false"] + sys.argv[4:])
    spec = build_spec(OmegaConf.to_container(cfg, resolve=True), run_dir, comm.size)
    run = Run(spec, comm)
    run.execute()

    gc.collect()
    n, dtype = run.worker.layout.size, run.worker.dtype
    buckets = [o for o in gc.get_objects() if isinstance(o, FusedBucket)]
    blocks = {}
    for o in gc.get_objects():
        for r in gc.get_referents(o):
            if isinstance(r, np.ndarray):
                base = owner(r)
                if base.dtype == dtype and base.size >= n:
                    blocks[id(base)] = [list(base.shape), str(base.dtype)]
    buf = getattr(run.policy, "buf", None)
    shared = None if buf is None else bool(np.shares_memory(buf, run.worker.bucket.buffer))
    if comm.rank == 0:
        Path(out).write_text(json.dumps({"buckets": len(buckets), "param_sized": sorted(blocks.values()),
                                         "params": n, "shared": shared}))


if __name__ == "__main__":
    main()
