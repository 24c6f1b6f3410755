"""What a short job costs in CPU, and what waiting ranks cost on an oversubscribed node.

    .venv/bin/python bench/bench_startup.py                 # about a minute
    .venv/bin/python bench/bench_startup.py --repeats 5

1. Startup: CPU seconds (user + system, every process of the job) of a 1-epoch default job,
   per rank, on 1, 2 and 4 ranks. Training is a fraction of a second here, so this is
   mostly each rank's start: Python, NumPy, h5py, MPI, and on rank 0 alone Hydra composing the
   config (the other ranks follow rank 0's jobs, hpc_rlx/runtime/job_channel.py).
2. Waiting: an 8-rank, 2-epoch job on this machine's cores, alternating hpc_rlx's default
   (waiting ranks sleep between MPI polls when ranks outnumber cores, hpc_rlx/comm/waiting.py)
   with MPICH's own busy polling (the same variables set to MPICH's defaults, which hpc_rlx
   leaves alone). Wall time and CPU seconds, median of the repeats, and their ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, machine_note, mpirun, one_thread_env  # noqa: E402

# MPICH's defaults (mpivars): a site that sets them keeps them, so this is busy polling
BUSY_POLLING = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "0", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1000",
                "OMPI_MCA_mpi_yield_when_idle": "0"}


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def job(n: int, run_dir: Path, epochs: int, env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every process of the job)."""
    cpu0, t0 = children_cpu(), time.perf_counter()
    mpirun(n, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", f"train.epochs={epochs}",
               "report.plots=false", "report.tensorboard=false", "checkpoint=off"],
           timeout=600, env=env)
    return time.perf_counter() - t0, children_cpu() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the oversubscribed job")
    args = ap.parse_args()
    print(machine_note())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        job(1, tmp / "warm", 1, one_thread_env())      # the dataset is prepared once, here
        rows = []
        for n in (1, 2, 4):
            cpus = [job(n, tmp / f"s{n}-{r}", 1, one_thread_env())[1] for r in range(args.repeats)]
            rows.append([n, statistics.median(cpus), statistics.median(cpus) / n])
        print("\n1-epoch default job: CPU seconds, median of", args.repeats)
        print(fmt_table(["ranks", "job CPU s", "CPU s per rank"], rows))

        sleepy, busy = [], []
        for r in range(args.repeats):
            sleepy.append(job(args.ranks, tmp / f"sleepy-{r}", 2, one_thread_env()))
            busy.append(job(args.ranks, tmp / f"busy-{r}", 2, one_thread_env(BUSY_POLLING)))
        med = {name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for name, runs in (("sleep between polls (default)", sleepy), ("busy polling", busy))}
        print(f"\n{args.ranks} ranks, 2 epochs, alternating, median of {args.repeats}")
        print(fmt_table(["waiting", "wall s", "CPU s"], [[k, w, c] for k, (w, c) in med.items()]))
        (ws, cs), (wb, cb) = med.values()
        print(f"ratios sleeping/busy: wall {ws / wb:.2f}, CPU {cs / cb:.2f}")


if __name__ == "__main__":
    main()
