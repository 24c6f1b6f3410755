"""Runs many streaming outer-sync cases in one MPI job and keeps what each computed, for a test
to hold against its own NumPy reference (`tests/mpi/policies/test_streaming_reference.py`).

Usage: mpirun -n N python streaming_cases.py OUT_DIR --ranks R DATA.h5 CASE [CASE ...] [--ranks ...]

Each group runs its cases on the first R ranks of the job (R <= N), on DATA.h5. A CASE is
``F,TAU,WIRE`` (WIRE: null, int8 or int4), after ``ordered,`` with comm.deterministic=true
(every sum in rank order), and after ``forced,`` the whole DiLoCo sync's config (F=1, tau=0)
with `StreamingSync` built all the same.

Each case is a real run (`runtime.train.Run`: the policy, its `StreamingSync`, `FragmentSync`,
the coded wire and the outer optimizer over the real communicator) with two things fixed so a
reference can follow it: the parameters start at `start_params`, and the gradient of rank r's
local step at position k (its k-th local step since the run began, `Worker.batch`'s argument)
is `gradient(r, k, n)`, dyadic and independent of the parameters. With SGD at a power-of-two
learning rate and no momentum, every inner step is one exactly rounded subtraction.

Rank 0 writes OUT_DIR/R/CASE.npz: every rank's parameters (`local`, one row per rank), the agreed
model (`global`), with the coded wire each rank's residuals (`sent_residual`, `sum_residual`),
and the seconds the run took.
"""

import copy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))       # this checkout's hpc_rlx and tests.support

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from mpi4py import MPI  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from hpc_rlx.comm.reduce import HostSum, OrderedSum  # noqa: E402
from hpc_rlx.config.spec import build_spec  # noqa: E402
from hpc_rlx.runtime.lanes import CpuLanes  # noqa: E402
from hpc_rlx.policies.fragments import Streaming  # noqa: E402
from hpc_rlx.policies.streaming import StreamingSync  # noqa: E402
from hpc_rlx.policies.windowed import WindowedPolicy  # noqa: E402
from hpc_rlx.runtime.train import Run  # noqa: E402
from hpc_rlx.runtime.worker import Worker  # noqa: E402

from tests.support.streaming_inputs import BATCH, case_keys, gradient, overrides, start_params  # noqa: E402

CONFIGS = REPO / "hpc_rlx" / "configs"


class Fixed:
    """The patches that fix the start and the gradients (and, for a forced case, the sync)."""
    force_streaming = False
    rank = 0                        # in the communicator the case runs on


def _batch(self, position):
    return position, None           # the position stands for the rows: the gradient is its own


def _lanes_step(self, x, y, seed, on_grad_ready=None):
    n = BATCH
    payload = self.bucket_payload
    # the summed gradient of n samples; the worker divides by n (SGD's grad_scale)
    payload[...] = gradient(Fixed.rank, int(x), payload.size) * n
    self._params_fresh = False
    return n, 0.0, 0.0, 0.0


_setup = WindowedPolicy._setup


def _fixed_setup(self, loop):
    loop.worker.params[...] = start_params(loop.worker.params.size)
    _setup(self, loop)
    if Fixed.force_streaming:
        # F = 1, tau = 0 through the fragment path, the whole sync's config otherwise
        settings = self.bucket.settings
        path = self.coded or (OrderedSum if settings.deterministic else HostSum)(settings.chunk_elems)
        self.stream = StreamingSync(self, loop.worker, Streaming(1, 0, 0.0), path)


def groups(args: list[str]) -> list[tuple[int, str, list[str]]]:
    """``RANKS DATA CASE ...`` groups, each after ``--ranks``."""
    out = []
    for token in args:
        if token == "--ranks":
            out.append([None, None, []])
        elif out[-1][0] is None:
            out[-1][0] = int(token)
        elif out[-1][1] is None:
            out[-1][1] = token
        else:
            out[-1][2].append(token)
    return [tuple(g) for g in out]


def run_cases(comm, base: dict, data: str, cases: list[str], out_dir: Path) -> None:
    Fixed.rank = comm.rank
    for case in cases:
        parts = case.split(",")
        Fixed.force_streaming = "forced" in parts[:-3]
        f, tau, wire = parts[-3:]
        cfg = copy.deepcopy(base)        # composed once: Hydra takes longer than a case's run
        cfg["data"]["path"] = data
        cfg["train"]["batch_size"] = BATCH * comm.size
        cfg["comm"]["deterministic"] = "ordered" in parts[:-3]
        cfg["policy"].update(case_keys(int(f), int(tau), wire))
        t0 = time.perf_counter()
        spec = build_spec(cfg, str(out_dir / case.replace(",", "_")), comm.size)
        run = Run(spec, comm)
        result = run.execute()
        assert result["status"] == "completed", result
        policy = run.policy
        assert (policy.stream is not None) == (int(f) > 1 or int(tau) > 0 or Fixed.force_streaming)
        local = comm.gather(run.worker.params.copy(), root=0)
        residuals = comm.gather(None if policy.coded is None else
                                (policy.coded.sent_residual.copy(), policy.coded.sum_residual.copy()), root=0)
        if comm.rank == 0:
            arrays = {"local": np.stack(local), "global": policy.global_params.copy(),
                      "seconds": time.perf_counter() - t0}
            if residuals[0] is not None:
                arrays["sent_residual"] = np.stack([r[0] for r in residuals])
                arrays["sum_residual"] = np.stack([r[1] for r in residuals])
            np.savez(out_dir / f"{case}.npz", **arrays)
            print(f"{comm.size} ranks, {case}: {arrays['seconds']:.2f} s", flush=True)


def main() -> None:
    out_dir = Path(sys.argv[1])
    world = MPI.COMM_WORLD
    Worker.batch = _batch
    CpuLanes.step = _lanes_step
    WindowedPolicy._setup = _fixed_setup
    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "streaming")
    todo = groups(sys.argv[2:])
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        base = OmegaConf.to_container(compose("config", overrides=overrides(todo[0][1], world.size)), resolve=True)
    for ranks, data, cases in todo:
        # a smaller world on the first ranks of the job: one job (one start-up) for every size
        comm = world if ranks == world.size else world.Split(0 if world.rank < ranks else MPI.UNDEFINED, world.rank)
        if comm != MPI.COMM_NULL:
            (out_dir / str(ranks)).mkdir(parents=True, exist_ok=True)
            run_cases(comm, base, data, cases, out_dir / str(ranks))


if __name__ == "__main__":
    main()
