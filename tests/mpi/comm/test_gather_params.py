"""``comm.shard=optimizer``: the bucket's reduction path gathers the parameters its own way
(`FusedBucket.gather_params`): MPI's rounds for the reduce-scatter, host or staged; the node's
segments when the bucket lives in the node's shared window; the node's one parameter array with
``comm.node_shared_params``. Every way gives every rank every slice, and counts its bytes."""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import REPO, explain, mpirun

WORKER = r'''
import json
import numpy as np
from mpi4py import MPI
from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.comm.node_params import NodeSharedParams
from hpc_rlx.comm.shard import ParamShard
from hpc_rlx.base import cuda_mpi

comm = MPI.COMM_WORLD
n = 10_007
shard = ParamShard(n, n - 7, comm.rank, comm.size)
expected = np.arange(n, dtype=np.float32) * 0.5 + 1.0
out = {}


def mine(params):
    """This rank's slice updated, every other slice stale."""
    params[...] = -1.0
    params[shard.lo: shard.hi] = expected[shard.lo: shard.hi]


def case(label, bucket, params, place=None):
    if place is not None:
        bucket.set_choice(place)
    mine(params)
    comm.Barrier()          # the node's array: every rank wrote before anyone gathers
    bucket.gather_params(comm, params)
    ok = bool(np.array_equal(params, expected))
    out[label] = {"gathered": bool(comm.allreduce(int(ok), op=MPI.MIN)), "sent": bucket.sent.sent,
                  "path": bucket.reduction.path}


def sharded(**kw):
    return FusedBucket(n, ("samples",), np.float32, cap_mb=0.01, shard=shard, **kw)


case("host", sharded(), np.empty(n, np.float32), cuda_mpi.PathChoice(cuda_mpi.HOST, "cpu"))
case("staged", sharded(), np.empty(n, np.float32), cuda_mpi.PathChoice(cuda_mpi.STAGED, "no CUDA-aware MPI"))
windowed = sharded()
out["window"] = windowed.share_node_memory(comm, cpu_only=True)
case("segments", windowed, np.empty(n, np.float32))
windowed.release_node_memory()
node = NodeSharedParams.create(comm, n, np.float32)
on_node = sharded(shared_params=node)
mine(np.empty(n, np.float32))
node.array[shard.lo: shard.hi] = expected[shard.lo: shard.hi]
comm.Barrier()
on_node.gather_params(comm, node.array)
out["node array"] = {"gathered": bool(comm.allreduce(int(np.array_equal(node.array, expected)), op=MPI.MIN)),
                     "sent": on_node.sent.sent, "path": on_node.reduction.path}
node.free()
try:
    FusedBucket(n, ("samples",), np.float32).gather_params(comm, np.empty(n, np.float32))
    out["unsharded"] = "gathered"
except Exception as exc:
    out["unsharded"] = str(exc)
if comm.rank == 0:
    print("RESULT " + json.dumps(out))
'''


@pytest.mark.mpi
def test_every_sharded_path_gathers_the_parameters_its_own_way(tmp_path):
    script = tmp_path / "gather_worker.py"
    script.write_text(WORKER)
    proc = mpirun(2, [str(script)], timeout=120, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, explain(proc)
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert res["window"] is True, res       # two ranks of one node share a window
    for label in ("host", "staged", "segments", "node array"):
        assert res[label]["gathered"], (label, res)
    # MPI's rounds: padded blocks of a ring Allgather (rank 0 sends its block to one other rank)
    assert res["host"]["sent"] == res["staged"]["sent"] > 0, res
    assert res["segments"]["path"].startswith("node shared memory") and res["segments"]["sent"] == 0, res
    assert res["node array"]["sent"] == 0, res      # one node: no slice leaves it
    assert res["unsharded"] == "the bucket's path (host) does not gather parameters", res
