"""`comm.overlap` on vs off: hpc_rlx's full training path under mpirun, side by side in one run.

    .venv/bin/python bench/bench_overlap.py                     # 2 ranks, 3 repeats, ~2 minutes
    .venv/bin/python bench/bench_overlap.py --ranks 2 --repeats 5 --chunks 1,4

Model 784-1024-1024-10 (ReLU), float32, SGD with momentum, batch 128 per rank, one BLAS thread
per rank (as bench/bench_ddp.py). Variants, alternated within every repeat so background load
hits them alike; the best repeat of each is reported:
  off             comm.overlap=false (one blocking Allreduce after backward)
  on C MiB        comm.overlap=true comm.overlap_chunk_mb=C
  on C MiB, no Test   the same without the MPI Test calls between layers (MPICH progresses a
                  non-blocking collective only inside MPI calls: this shows what they buy)
Figures: samples/s of the epochs after the first (hpc_rlx's own `samples_per_s`), the step
time, the exposed communication per step (`comm_s`: with overlap the wait after backward),
and each variant's throughput relative to `off`.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (fmt_table, hpc_throughput, machine_note, mpirun, one_thread_env,  # noqa: E402
                     prepare_synthetic)

HIDDEN = [1024, 1024]
FEATURES, CLASSES, PER_RANK_BATCH = 784, 10, 128
NO_TEST = "--rank-without-test"


def run_variant(n: int, data: Path, steps: int, epochs: int, workdir: Path, extra: list[str],
                no_test: bool) -> dict:
    run_dir = workdir / f"run_{time.monotonic_ns()}"
    head = [str(Path(__file__).resolve()), NO_TEST] if no_test else ["-m", "hpc_rlx"]
    args = head + [f"hydra.run.dir={run_dir}", "data=synthetic", f"data.path={data}",
                   "data.val_fraction=0", "model=mlp", f"model.hidden=[{','.join(map(str, HIDDEN))}]",
                   f"train.batch_size={PER_RANK_BATCH * n}", f"train.epochs={epochs}",
                   "train.threads_per_rank=1", "optim=sgd", "optim.lr=0.01", "optim.momentum=0.9",
                   "optim.schedule=constant", "checkpoint=off", "report.plots=false",
                   "train.log_every_s=1000"] + extra
    mpirun(n, args, timeout=900, env=one_thread_env())
    out = hpc_throughput(run_dir, PER_RANK_BATCH * n, skip_epochs=1)
    out["comm_ms"] = out["comm_frac"] * out["step_ms"]
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == NO_TEST:      # one rank of the "no Test" variant
        from hpc_rlx.comm.collective import FusedBucket
        FusedBucket.overlap_progress = False
        sys.argv = [sys.argv[0]] + sys.argv[2:]
        runpy.run_module("hpc_rlx", run_name="__main__", alter_sys=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=3, help="the first is warm-up")
    ap.add_argument("--chunks", default="1,4", help="comm.overlap_chunk_mb values")
    ap.add_argument("--no-test", action="store_true", help="also the variant without MPI Test calls")
    a = ap.parse_args()
    n = a.ranks
    variants = [("off", [], False)]
    for c in a.chunks.split(","):
        variants.append((f"on {c} MiB", ["comm.overlap=true", f"comm.overlap_chunk_mb={c}"], False))
    if a.no_test:
        c = a.chunks.split(",")[0]
        variants.append((f"on {c} MiB, no Test", ["comm.overlap=true", f"comm.overlap_chunk_mb={c}"], True))
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_overlap_") as tmp:
        work = Path(tmp)
        data = prepare_synthetic(work / "syn.h5", PER_RANK_BATCH * n * a.steps, FEATURES, CLASSES)
        for rep in range(a.repeats):
            for name, extra, no_test in variants:
                r = run_variant(n, data, a.steps, a.epochs, work, extra, no_test)
                print(f"repeat {rep + 1} {name:>22}: {r['samples_per_s']:8.0f} samples/s  "
                      f"step {r['step_ms']:6.2f} ms  comm {r['comm_ms']:5.2f} ms", flush=True)
                if name not in best or r["samples_per_s"] > best[name]["samples_per_s"]:
                    best[name] = r
    ref = best["off"]["samples_per_s"]
    rows = [[name, round(r["samples_per_s"]), round(r["step_ms"], 2), round(r["comm_ms"], 2),
             round(r["samples_per_s"] / ref, 3)] for name, r in best.items()]
    print(f"\n{n} ranks, MLP 784-1024-1024-10, batch {PER_RANK_BATCH}/rank, 1 BLAS thread, "
          f"best of {a.repeats}; {machine_note()}")
    print(fmt_table(["variant", "samples/s", "step ms", "exposed comm ms", "vs off"], rows))


if __name__ == "__main__":
    main()
