"""The 16-bit gradient wire, whole and sharded, in one MPI job: what the reduction paths compute
on the same buckets, and one training step of real runs, kept for a test to check exactly.

Usage: mpirun -n N python wire_steps.py DATA.h5 OUT_DIR ITEM [ITEM ...]

ITEM ``paths``: every rank fills a float64 bucket with values of its own (mixed magnitudes) and
sums it by the unsharded wire (`reduce.WireSum`, through `FusedBucket.allreduce`) and by the
sharded one (`shard.ScatteredSum`, coded), for bfloat16 in one chunk and in many, and float16 in
one. Rank 0 writes OUT_DIR/paths-CODEC-CHUNKS.npz: every rank's input (`inputs`), the unsharded
result (`whole`) and the sharded one, each rank's slice from its owner (`sharded`).

ITEM ``f32``, ``wire`` or ``wire_sharded``: one step of a real run (`runtime.train.Run`: policy
sync, SGD without momentum, float64) without a wire, with comm.wire_dtype=bfloat16, and with it
and comm.shard=optimizer. Rank 0 writes OUT_DIR/ITEM.npz: per rank the gradient it handed to the
reduction (`sent`), the reduced gradient the optimizer stepped with (`applied`), the parameters
before the step (`before`) and after it (`after`), and the step's learning rate x 1 / samples
(`scale`).
"""

import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))       # this checkout's hpc_rlx

import numpy as np  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from mpi4py import MPI  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from hpc_rlx.comm.codec import codec_for  # noqa: E402
from hpc_rlx.comm.collective import FusedBucket  # noqa: E402
from hpc_rlx.comm.shard import ParamShard, ScatteredSum  # noqa: E402
from hpc_rlx.config.spec import build_spec  # noqa: E402
from hpc_rlx.runtime.train import Run  # noqa: E402
from hpc_rlx.runtime.worker import Worker  # noqa: E402

CONFIGS = REPO / "hpc_rlx" / "configs"
N = 5003
PATH_CASES = [("bfloat16", 16.0), ("bfloat16", 0.01), ("float16", 16.0)]   # (codec, comm.bucket_cap_mb)
STEP = ["checkpoint=off", "report.plots=false", "report.tensorboard=false", "train.dtype=float64",
        "train.max_steps=1", "train.batch_size=24", "model.hidden=[32,16]", "optim=sgd", "optim.lr=0.05",
        "optim.momentum=0", "optim.schedule=constant", "comm.shared_memory=false"]
RUNS = {"f32": {}, "wire": {"wire_dtype": "bfloat16"},             # comm.* of each run
        "wire_sharded": {"wire_dtype": "bfloat16", "shard": "optimizer"}}


def rank_values(rank: int) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal(N) * np.exp(rng.uniform(-12, 4, N))     # most tiny, a few large


def paths(comm, out_dir: Path) -> None:
    for codec, cap_mb in PATH_CASES:
        whole = FusedBucket(N, ("samples",), np.float64, cap_mb=cap_mb, wire_dtype=codec)
        shard = ParamShard(N, N, comm.rank, comm.size)
        sharded = FusedBucket(N, ("samples",), np.float64, cap_mb=cap_mb)
        path = ScatteredSum(shard, sharded.settings.chunk_elems, codec_for(codec))
        for bucket in (whole, sharded):
            bucket.payload[...] = rank_values(comm.rank)
        whole.allreduce(comm)
        sharded.allreduce(comm, path)
        chunks = whole.last_chunks
        inputs = comm.gather(rank_values(comm.rank), root=0)
        slices = comm.gather(sharded.payload[shard.lo:shard.hi].copy(), root=0)
        if comm.rank == 0:
            np.savez(out_dir / f"paths-{codec}-{chunks}.npz", inputs=np.stack(inputs), whole=whole.payload,
                     sharded=np.concatenate(slices), chunks=chunks)


class Seen:
    """What the first step of a run handed over: filled by the wrappers below."""
    sent = applied = before = scale = None


_allreduce = FusedBucket.allreduce
_apply = Worker.apply_gradient


def _recording_allreduce(self, comm, reduction=None):
    if Seen.sent is None:
        Seen.sent = self.payload.copy()
    return _allreduce(self, comm, reduction)


def _recording_apply(self, grad, lr, grad_scale=1.0):
    if Seen.applied is None:
        Seen.applied, Seen.before, Seen.scale = grad.copy(), self.params.copy(), lr * grad_scale
    return _apply(self, grad, lr, grad_scale)


def steps(comm, data: str, out_dir: Path, names: list[str]) -> None:
    FusedBucket.allreduce = _recording_allreduce
    Worker.apply_gradient = _recording_apply
    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "wire")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        base = OmegaConf.to_container(compose("config", overrides=[f"data.path={data}"] + STEP), resolve=True)
    for name in names:
        cfg = copy.deepcopy(base)          # composed once: Hydra takes longer than a run's step
        cfg["comm"].update(RUNS[name])
        Seen.sent = Seen.applied = Seen.before = Seen.scale = None
        run = Run(build_spec(cfg, str(out_dir / name), comm.size), comm)
        assert run.execute()["status"] == "max_steps"
        per_rank = comm.gather((Seen.sent, Seen.applied, Seen.before, run.worker.params.copy(), Seen.scale), root=0)
        if comm.rank == 0:
            sent, applied, before, after, scale = zip(*per_rank)
            np.savez(out_dir / f"{name}.npz", sent=np.stack(sent), applied=np.stack(applied),
                     before=np.stack(before), after=np.stack(after), scale=np.array(scale))


def main() -> None:
    data, out_dir = sys.argv[1], Path(sys.argv[2])
    items = sys.argv[3:]
    comm = MPI.COMM_WORLD
    if "paths" in items:
        paths(comm, out_dir)
    runs = [i for i in items if i != "paths"]
    if runs:
        steps(comm, data, out_dir, runs)


if __name__ == "__main__":
    main()
