"""Data read: `data.distribution=read` (every rank reads its own hyperslab) vs `scatter`
(rank 0 reads, then MPI Scatterv) for an HDF5 dataset over 2 and 4 ranks.

    .venv/bin/python bench/bench_data.py                 # 0.25 GB, under a minute
    .venv/bin/python bench/bench_data.py --gb 1          # the 1 GB case

The file (float32 x with 1024 features, int64 y) is written under a temp dir and deleted at
the end. The whole training split is loaded, split evenly over the ranks, with hpc_rlx's own
`hpc_rlx.data.distribute.load_shard`; each point is the slowest rank's time between barriers,
the two modes alternating, median of the repeats. The file was just written, so both modes
read from the page cache: this measures the library and MPI, not the disk. On a parallel file
system `read` also multiplies the readers, which is usually what makes it win there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, machine_note, mpirun, one_thread_env  # noqa: E402

FEATURES = 1024


def child(path: str, repeats: int, chunk_mb: float) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpc_rlx.data.distribute import load_shard
    from hpc_rlx.data.hdf5 import describe

    comm = MPI.COMM_WORLD
    n = describe(path).n
    per, more = divmod(n, comm.size)
    bounds, lo = [], 0
    for r in range(comm.size):
        hi = lo + per + (1 if r < more else 0)
        bounds.append((lo, hi))
        lo = hi
    times = {"read": [], "scatter": []}
    t = np.zeros(1)
    load_shard(comm, "read", path, "x", "y", bounds)        # warm-up (file open, page cache)
    for rep in range(repeats):
        for mode in (("read", "scatter") if rep % 2 == 0 else ("scatter", "read")):
            comm.Barrier()
            t0 = MPI.Wtime()
            kw = {"chunk_bytes": int(chunk_mb * 1024 * 1024)} if (chunk_mb and mode == "scatter") else {}
            x, y = load_shard(comm, mode, path, "x", "y", bounds, **kw)
            t[0] = MPI.Wtime() - t0
            assert x.shape[0] == bounds[comm.rank][1] - bounds[comm.rank][0]
            del x, y
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
            times[mode].append(t[0])
    if comm.rank == 0:
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in times.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=0.25, help="dataset size in GiB (x only)")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temp dir)")
    ap.add_argument("--chunk-mb", type=float, default=0,
                    help="scatter round size in MiB passed to load_shard (default: its own)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpc_rlx_bench_data_", dir=args.dir))
    try:
        from hpc_rlx.data.prepare import prepare_synthetic
        rows = int(args.gb * 1024 ** 3) // (4 * FEATURES)
        path = work / "data.h5"
        t0 = time.perf_counter()
        prepare_synthetic(path, samples=rows, features=FEATURES, classes=10, seed=0)
        size = os.path.getsize(path)
        print(f"# {machine_note()}")
        print(f"# {path}: {rows} rows x {FEATURES} float32 + int64 labels = {size / 1024 ** 3:.2f} GiB "
              f"(written in {time.perf_counter() - t0:.1f}s); median of {args.repeats}, slowest rank")
        table = []
        for n in [int(r) for r in args.ranks.split(",")]:
            out = mpirun(n, [__file__, "--child", str(path), str(args.repeats), str(args.chunk_mb)],
                         timeout=1800, env=one_thread_env())
            res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            r, s = res["read"], res["scatter"]
            table.append([n, r, size / 1024 ** 3 / r, s, size / 1024 ** 3 / s, f"{s / r:.2f}"])
            print(f"  n={n}: read {r:.2f}s scatter {s:.2f}s", flush=True)
        print(fmt_table(["ranks", "read s", "read GiB/s", "scatter s", "scatter GiB/s", "scatter/read"], table))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
