"""Collective cost: hpc_rlx's fused bucket vs one Allreduce per parameter tensor, 1..128 MB.

    .venv/bin/python bench/bench_collective.py                     # 2 ranks, about a minute
    .venv/bin/python bench/bench_collective.py --ranks 4 --sizes 1,8,32,128 --repeats 20

For each gradient size (float32), with the same bytes laid out as 8 layers (a weight and a
1024-element bias each, so 16 tensors), every rank times, between barriers:

  raw 1 call     one Allreduce(IN_PLACE) over the whole flat buffer (MPI's best case, no chunking)
  raw chunked    the same, in chunks of comm.bucket_cap_mb (a bare loop of Allreduce calls)
  bucket         hpc_rlx: FusedBucket.allreduce with the default cap (what a training step runs)
  bucket 1 call  FusedBucket with chunking off (comm.bucket_cap_mb=1e6)
  bucket shm     FusedBucket in the node's shared memory (comm.shared_memory=true, the default
                 for CPU lanes): each rank sums its 1/N part in place, then copies the others
  per tensor     one Allreduce(IN_PLACE) per parameter tensor
  pack+copy      copy the tensors into a flat buffer, one Allreduce, copy back (a framework
                 whose gradients do not live in the communication buffer)

Each timed call follows an untimed one on the same buffers (warm caches, as gradients that the
backward pass just wrote). The time of an iteration is the slowest rank's; the median over
repeats is printed. Ratios:
bucket / raw 1 call (<= 1.15 means the bucket costs no more than the raw collective of the
same bytes) and bucket / raw chunked (the bucket's own overhead). MPICH here switches
algorithm for messages of 32 MiB and more; the chunked columns stay clear of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt_table, machine_note, mpirun, one_thread_env  # noqa: E402

LAYERS, BIAS = 8, 1024
VARIANTS = ("raw 1 call", "raw chunked", "bucket", "bucket 1 call", "bucket shm", "per tensor", "pack+copy")


def default_cap_mb() -> float:
    from omegaconf import OmegaConf
    return float(OmegaConf.load(REPO / "configs" / "config.yaml").comm.bucket_cap_mb)


def child(sizes_mb: list[float], repeats: int | None, cap_mb: float) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpc_rlx.comm.collective import FusedBucket

    comm = MPI.COMM_WORLD
    tail = ("samples", "loss_sum", "correct", "stop", "nonfinite", "ckpt_due")
    rows = []
    for mb in sizes_mb:
        elems = int(mb * 1024 * 1024) // 4
        w = max(1, (elems - LAYERS * BIAS) // LAYERS)
        shapes = [w, BIAS] * LAYERS
        n = sum(shapes)
        rng = np.random.default_rng(comm.rank)
        flat = rng.standard_normal(n, dtype=np.float32)
        tensors = [rng.standard_normal(s, dtype=np.float32) for s in shapes]   # separate arrays
        packed = np.empty(n, dtype=np.float32)
        bucket = FusedBucket(n, tail, np.float32, cap_mb=cap_mb)
        bucket.payload[...] = flat
        bucket1 = FusedBucket(n, tail, np.float32, cap_mb=1e6)
        bucket1.payload[...] = flat
        shared = FusedBucket(n, tail, np.float32, cap_mb=cap_mb)
        if not shared.share_node_memory(comm, cpu_only=True):
            raise SystemExit("bucket shm: the ranks cannot share a node's memory here")
        shared.payload[...] = flat
        chunk = bucket.settings.chunk_elems

        def raw1():
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

        def rawc():
            for lo in range(0, n, chunk):
                comm.Allreduce(MPI.IN_PLACE, flat[lo: lo + chunk], op=MPI.SUM)

        def per_tensor():
            for t in tensors:
                comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)

        def pack():
            lo = 0
            for t in tensors:
                packed[lo: lo + t.size] = t
                lo += t.size
            comm.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)
            lo = 0
            for t in tensors:
                t[...] = packed[lo: lo + t.size]
                lo += t.size

        fns = {"raw 1 call": raw1, "raw chunked": rawc, "bucket": lambda: bucket.allreduce(comm),
               "bucket 1 call": lambda: bucket1.allreduce(comm), "bucket shm": lambda: shared.allreduce(comm),
               "per tensor": per_tensor, "pack+copy": pack}
        reps = repeats or max(5, min(40, int(160 / mb)))
        times = {k: [] for k in VARIANTS}
        t = np.zeros(1)
        for fn in fns.values():          # warm-up: first touch, MPI internal buffers
            fn()
        for rep in range(reps):
            # interleaved, so background load hits every variant; rotated, so no variant is
            # always the one that runs first after the rescaling pass below
            k = rep % len(VARIANTS)
            for name in VARIANTS[k:] + VARIANTS[:k]:
                fns[name]()              # untimed: its buffers are in cache, as fresh gradients are
                comm.Barrier()
                t0 = MPI.Wtime()
                fns[name]()
                t[0] = MPI.Wtime() - t0
                comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
                times[name].append(t[0])
            # sums grow without bound; keep the values finite and realistic
            for arr in [flat, packed, bucket.buffer, bucket1.buffer, shared.buffer] + tensors:
                arr *= 1.0 / comm.size
        shared.release_node_memory()
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append((mb, bucket.last_chunks, reps, med))
    if comm.rank == 0:
        import json
        print("RESULT " + json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8,16,24,32,48,64,128", help="gradient MB (MiB) per point")
    ap.add_argument("--repeats", type=int, default=None, help="default: 40 at 1 MB down to 5 at 128 MB")
    ap.add_argument("--cap-mb", type=float, default=None, help="bucket chunk size (default: comm.bucket_cap_mb)")
    args = ap.parse_args()
    cap = args.cap_mb or default_cap_mb()
    cmd = [__file__, "--child", args.sizes, str(args.repeats or 0), str(cap)]
    out = mpirun(args.ranks, cmd, timeout=1200, env=one_thread_env())
    import json
    rows = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    print(f"# {machine_note()}")
    print(f"# {args.ranks} ranks, float32, {LAYERS * 2} tensors per model, chunk cap {cap:g} MiB; "
          f"milliseconds, median of the slowest rank per iteration")
    table = []
    worst = 0.0
    for mb, chunks, reps, med in rows:
        b = med["bucket"]
        r1, rc = med["raw 1 call"], med["raw chunked"]
        worst = max(worst, b / r1)
        table.append([f"{mb:g}", chunks, reps] + [med[k] for k in VARIANTS] +
                     [f"{b / r1:.2f}", f"{b / rc:.2f}", f"{med['per tensor'] / b:.2f}",
                      f"{med['bucket shm'] / b:.2f}", f"{mb / 1024 / (b / 1e3):.2f}"])
    print(fmt_table(["MiB", "chunks", "reps"] + [f"{k} ms" for k in VARIANTS] +
                    ["bucket/raw1", "bucket/rawchunk", "per-tensor/bucket", "shm/bucket", "bucket GiB/s"],
                    table))
    print(f"worst bucket / raw-1-call ratio: {worst:.2f} (target <= 1.15)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sizes = [float(s) for s in sys.argv[2].split(",")]
        child(sizes, int(sys.argv[3]) or None, float(sys.argv[4]))
    else:
        main()
