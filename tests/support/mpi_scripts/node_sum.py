"""Sums a fused bucket through the node's shared memory for several steps and checks it.

Usage: mpirun -n N python node_sum.py ELEMENTS STEPS CAP_MB OUT.json

Each step every rank writes new values (its rank and the step seed them) into the payload and
the tail, then sums the bucket twice: in the node's shared memory (`comm.shared_memory`) and
by MPI's Allreduce on a private bucket. Rank 0 writes OUT.json: the path's name, the largest
error against the float64 sum every rank can compute itself, whether every rank holds the same
bits, whether they equal MPI's sum bitwise, and the summed tail fields.
"""

import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

from hpc_rlx.comm.collective import FusedBucket

n, steps, cap_mb, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
comm = MPI.COMM_WORLD
fields = ("samples", "loss_sum")
shared = FusedBucket(n, fields, np.float32, cap_mb=cap_mb, rank_fields=("rate",), world_size=comm.size)
plain = FusedBucket(n, fields, np.float32, cap_mb=cap_mb, rank_fields=("rate",), world_size=comm.size)
active = shared.share_node_memory(comm, cpu_only=True)
assert shared.exact_reduction() is shared.reduction or not active


def values(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).standard_normal(n).astype(np.float32)


worst, same, equal_mpi, tails = 0.0, True, True, []
for step in range(steps):
    for b in (shared, plain):
        b.payload[...] = values(comm.rank, step)
        b.zero_tail()
        b["samples"] = comm.rank + 1
        b["loss_sum"] = 0.5 * (comm.rank + step)
        b.put("rate", 10.0 + comm.rank, comm.rank)
        b.allreduce(comm)
    expected = sum(values(r, step).astype(np.float64) for r in range(comm.size))
    worst = max(worst, float(np.max(np.abs(shared.payload - expected)) / np.max(np.abs(expected))))
    digests = comm.allgather(hashlib.sha256(shared.buffer.tobytes()).hexdigest())
    same = same and len(set(digests)) == 1
    equal_mpi = equal_mpi and bool(comm.allreduce(int(np.array_equal(shared.buffer, plain.buffer)), op=MPI.MIN))
    tails.append({"samples": shared["samples"], "loss_sum": shared["loss_sum"],
                  "rate": [float(v) for v in shared["rate"]]})
path = shared.reduction.path if active else "mpi"
last = shared.buffer.copy()
# a second shared bucket in the same process: the first leaves the node's memory, keeping its
# values, and sums by MPI from then on
second = FusedBucket(64, fields, np.float32)
second.share_node_memory(comm, cpu_only=True)
first_left = shared.reduction.path == "host" and bool(np.array_equal(shared.buffer, last))
shared.payload[...] = 1.0
shared.allreduce(comm)
first_sums = bool(np.all(shared.payload == comm.size))
last = second.buffer.copy()
second.release_node_memory()
kept = bool(np.array_equal(second.buffer, last)) and second.reduction.path == "host"
if comm.rank == 0:
    with open(out, "w") as f:
        json.dump({"active": active, "path": path, "max_rel_err": worst, "same_on_every_rank": same,
                   "equal_to_mpi": equal_mpi, "tails": tails, "kept_after_release": kept,
                   "first_left_for_the_second": first_left, "first_still_sums": first_sums}, f)
