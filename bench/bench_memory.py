"""What the memory keys buy: a rank's peak resident memory with validation in bounded batches
(`train.eval_batch_size`) and with gradient accumulation (`train.accumulate`), side by side in
one run.

    .venv/bin/python bench/bench_memory.py
    .venv/bin/python bench/bench_memory.py --rows 20000 --accumulate 1 4 16

The file holds uint8 images 1x64x64 (4 KiB a sample, issue 33's case) and int64 labels, written
under a temp dir and deleted at the end. Every job is one rank, `model=cnn model.channels=[4]
model.hidden=16`, one BLAS thread. Per job it prints summary.json's `peak_rss_bytes` (VmHWM)
and that figure minus the same job's on a 512-row file (the process, the model and its code),
which leaves the data held plus the step's and the evaluation's activations.

- validation: 2% of the rows validated, `train.batch_size=64`, evaluated 1,024 rows at a time
  (the old fixed batch) and in the default batch (the rank's training micro-batch, 64);
- accumulation: `train.batch_size=--batch` with `train.accumulate=K` for each K, validation
  held to a few rows so that the step's activations dominate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model=cnn", "model.channels=[4]", "model.hidden=16", "checkpoint=off", "report.plots=false",
         "report.tensorboard=false", "train.threads_per_rank=1"]


def write(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(0, 256, (rows, 1, 64, 64), dtype=np.uint8)
        f["y"] = rng.integers(0, 10, rows).astype(np.int64)


def peak(run: Path, data: Path, overrides: list[str]) -> int:
    cmd = [sys.executable, "-m", "hpc_rlx", f"hydra.run.dir={run}", "data=file", f"data.path={data}",
           *MODEL, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-2000:]}")
    (rank,) = json.loads((run / "summary.json").read_text())["ranks"]
    return int(rank["peak_rss_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=512, help="train.batch_size of the accumulation jobs")
    ap.add_argument("--accumulate", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        large, small = tmp / "large.h5", tmp / "small.h5"
        write(large, args.rows)
        write(small, 512)
        stored = args.rows * 64 * 64
        print(f"{args.rows} rows of uint8 1x64x64: {stored / mib:.0f} MiB stored\n")

        print("validation (2% of the rows, train.batch_size=64, 20 steps):")
        val = ["train.batch_size=64", "train.max_steps=20", "data.val_fraction=0.02"]
        base = peak(tmp / "v0", small, val)
        for label, extra in (("eval 1024 rows at a time", ["train.eval_batch_size=1024"]),
                             ("eval in the default batch", [])):
            p = peak(tmp / label.replace(" ", "_"), large, val + extra)
            print(f"  {label:28s} peak {p / mib:6.0f} MiB   over the 512-row job {(p - base) / mib:6.0f} MiB"
                  f"   = {(p - base) / stored:4.2f} x the data")

        print(f"\naccumulation (train.batch_size={args.batch}, 10 steps, validation of a few rows):")
        acc = [f"train.batch_size={args.batch}", "train.max_steps=10", "data.val_fraction=0.0005"]
        # the process and the model with next to no activations: batch 8 on the small file
        base = peak(tmp / "a0", small, ["train.batch_size=8", "train.max_steps=10", "data.val_fraction=0.01",
                                        "train.eval_batch_size=4"])
        first = None
        for k in args.accumulate:
            p = peak(tmp / f"k{k}", large, acc + [f"train.accumulate={k}", "train.eval_batch_size=4"])
            over = p - base - stored
            first = over if first is None else first
            print(f"  K={k:<3d} peak {p / mib:6.0f} MiB   over the 512-row job and the data {over / mib:6.0f} MiB"
                  f"   ({over / max(first, 1):4.2f} x K={args.accumulate[0]})")


if __name__ == "__main__":
    main()
