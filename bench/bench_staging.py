"""Staging throughput (`data.stage_dir`): the start-up copy of each node's files to node-local
storage, as hpc_rlx runs it (`hpc_rlx.runtime.staging.stage`: the plan, the free-space check,
the copies split among the node's ranks, each checked and renamed), over 1 and 2 ranks.

    .venv/bin/python bench/bench_staging.py                  # 2,000 x 64 KiB and 100 x 1.25 MiB
    .venv/bin/python bench/bench_staging.py --rounds 5 --out bench/results/staging.jsonl

The files (one-sample HDF5, float32) are written under a temp dir, then staged to each target
(`/dev/shm` and a directory on the disk the sources are on) in rounds; a round is one staging
and its removal, timed on the slowest rank between barriers. The sources were just written, so
they are read from the page cache: this is the copying's own cost, not a parallel file
system's. Beside it, one process copying the same files with `shutil.copyfile` (what
`cp` does). Every round is one JSON line in `--out` (kept), the table is made from them.
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
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, machine_note, mpirun, one_thread_env  # noqa: E402


def write_files(root: Path, count: int, kib: int) -> list[str]:
    import h5py
    import numpy as np
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(kib * 256).astype(np.float32)        # kib KiB of float32
    paths = []
    for i in range(count):
        p = root / f"s_{i:05d}.h5"
        with h5py.File(p, "w") as f:
            f["x"] = x
            f["y"] = np.int64(i % 3)
        paths.append(str(p))
    return paths


def child(src: str, target: str, rounds: int) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpc_rlx.data.plan import plan_shards
    from hpc_rlx.runtime.staging import stage

    comm = MPI.COMM_WORLD
    paths = sorted(str(Path(src) / n) for n in os.listdir(src))
    n = len(paths)
    data = SimpleNamespace(path=src, files=[[p, 1] for p in paths], val_files=None, one_sample=True,
                           n_train=n, val_path=None, val_start=n, val_stop=n, distribution="read",
                           sample_shape=[1], x_dtype="float32", y_dtype="int64", y_shape=[],
                           stage_dir=target, stage_keep=False)
    spec = SimpleNamespace(data=data)
    plan = plan_shards(n, comm.size * 4, comm.size, "drop")
    t = np.zeros(1)
    for r in range(rounds):
        comm.Barrier()
        t0 = MPI.Wtime()
        staged = stage(spec, comm, plan, log=lambda line: None)
        t[0] = MPI.Wtime() - t0
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        size = sum(os.path.getsize(p) for p in paths)
        comm.Barrier()
        staged.close()
        if comm.rank == 0:
            print("ROUND " + json.dumps({"round": r, "ranks": comm.size, "seconds": float(t[0]),
                                         "bytes": size, "files": n}), flush=True)


def plain_copy(paths: list[str], target: str) -> float:
    dst = Path(target) / f"plain-{os.getpid()}"
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    for p in paths:
        shutil.copyfile(p, dst / os.path.basename(p))
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--sets", default="2000x64,100x1280", help="COUNTxKiB,... one-sample files per set")
    ap.add_argument("--targets", default="/dev/shm,disk", help="stage directories; 'disk': beside the sources")
    ap.add_argument("--out", default=None, help="append every round as a JSON line here")
    ap.add_argument("--child", nargs=3, metavar=("SRC", "TARGET", "ROUNDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return

    rows, records = [], []
    work = Path(tempfile.mkdtemp(prefix="bench_staging-", dir=os.environ.get("BENCH_TMP", "/var/tmp")))
    try:
        for spec in args.sets.split(","):
            count, kib = (int(v) for v in spec.split("x"))
            src = work / f"src-{count}x{kib}"
            paths = write_files(src, count, kib)
            size = sum(os.path.getsize(p) for p in paths)
            for target in args.targets.split(","):
                where = str(work / "stage") if target == "disk" else os.path.join(target, "bench_staging")
                plain = [plain_copy(paths, where) for _ in range(args.rounds)]
                records += [{"set": spec, "target": target, "ranks": 0, "how": "shutil.copyfile, one process",
                             "round": r, "seconds": s, "bytes": size, "files": count} for r, s in enumerate(plain)]
                rows.append([spec, target, "cp (1 process)", f"{statistics.median(plain):.3f}",
                             f"{size / statistics.median(plain) / 2**30:.2f}", f"{min(plain):.3f}-{max(plain):.3f}"])
                for ranks in (int(v) for v in args.ranks.split(",")):
                    out = mpirun(ranks, [__file__, "--child", str(src), where, str(args.rounds)],
                                 env=one_thread_env(), timeout=600)
                    got = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("ROUND ")]
                    records += [dict(g, set=spec, target=target, how="hpc_rlx staging") for g in got]
                    secs = [g["seconds"] for g in got]
                    rows.append([spec, target, f"staging, {ranks} rank(s)", f"{statistics.median(secs):.3f}",
                                 f"{size / statistics.median(secs) / 2**30:.2f}", f"{min(secs):.3f}-{max(secs):.3f}"])
                shutil.rmtree(where, ignore_errors=True)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    print(machine_note())
    print(fmt_table(["files x KiB", "to", "how", "median s", "GiB/s", "range s"], rows))


if __name__ == "__main__":
    main()
