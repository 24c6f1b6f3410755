"""Many files against one file of the same bytes: `data.path` a directory of one-sample files
(`data.one_sample_per_file=true`, DeepCAM's and CosmoFlow's layout) against one HDF5 file of
the same samples, 2 ranks, `data.cache=memory` and `stream`.

    .venv/bin/python bench/bench_many_files.py                       # 10,000 x 64 KiB, 3 rounds
    .venv/bin/python bench/bench_many_files.py --files 2000 --rounds 1 --out /tmp/m.jsonl
    .venv/bin/python bench/bench_many_files.py --table        # the tables of the kept lines

Each sample: x float32 16x32x32 (64 KiB), y an int64 class in [0, 10). The model and batch:
`model=mlp model.hidden=[32] model.num_classes=10` (given: rank 0 does not read every label to
count the classes), global batch 64, SGD lr 0.001, `--epochs` epochs (default 3), 10%
validation, no checkpoints, float32, one BLAS thread a rank. Measured per run:

- samples/s over the whole run: training samples (summary.json) over the wall time of
  `mpirun -n 2 python -m hpc_rlx ...`, from launch to exit: start-up, loading and validation
  included (with `memory` the training itself is the same arithmetic on the same bytes);
- start-up of the many-file run: rank 0's plan (`data_sources`: listing the directory and
  describing the first file, measured here in-process) and the ranks' checks (every file's
  datasets; with `memory` also the reading), from the run's `data:` start-up line;
- rank 0's plan over 10,000 small files of several samples each (every file's count and
  datasets read before the plan): the case where rank 0 opens every file.

The files are written once under --dir (default: a temp dir, removed at the end) and read from
the page cache, so this is hpc_rlx's own cost per file, not a parallel file system's. Every run
is one JSON line in --out (kept); the table is made from those lines: the median of the rounds
and their range.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MPIRUN, PYTHON, fmt_table, machine_note, one_thread_env, run  # noqa: E402

SHAPE = (16, 32, 32)            # float32: 64 KiB a sample
MODEL = ["model=mlp", "model.hidden=[32]", "model.num_classes=10", "train.batch_size=64", "optim.lr=0.001",
         "data.val_fraction=0.1", "checkpoint=off", "report.plots=false", "report.tensorboard=false",
         "train.dtype=float32"]


def write_data(root: Path, count: int) -> tuple[Path, Path, Path]:
    """count one-sample files, one file of the same samples, and count small multi-sample files."""
    import h5py
    import numpy as np
    many, one, small = root / "many", root / "one.h5", root / "small"
    if (root / "done").exists():
        return many, one, small
    many.mkdir(parents=True, exist_ok=True)
    small.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with h5py.File(one, "w") as f:
        x = f.create_dataset("x", (count,) + SHAPE, dtype=np.float32)
        y = f.create_dataset("y", (count,), dtype=np.int64)
        for i in range(count):
            xi, yi = rng.standard_normal(SHAPE).astype(np.float32), np.int64(rng.integers(0, 10))
            x[i], y[i] = xi, yi
            with h5py.File(many / f"s_{i:05d}.h5", "w") as g:
                g["x"], g["y"] = xi, yi
            with h5py.File(small / f"p_{i:05d}.h5", "w") as g:
                g["x"], g["y"] = np.zeros((3, 16), np.float32), np.zeros(3, np.int64)
    (root / "done").write_text("")
    return many, one, small


def plan_seconds(path: Path, one_sample: bool) -> float:
    """Rank 0's part before the plan, as build_spec runs it (data/resolve.py data_sources)."""
    from hpc_rlx.data.resolve import data_sources
    t = time.perf_counter()
    data_sources({"path": str(path), "val_path": None, "val_fraction": 0.1, "x": "x", "y": "y",
                  "one_sample_per_file": one_sample})
    return time.perf_counter() - t


def train(path: Path, one_sample: bool, cache: str, epochs: int, work: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="run_", dir=work))
    args = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file", f"data.path={path}",
            f"data.one_sample_per_file={str(one_sample).lower()}", f"data.cache={cache}",
            f"train.epochs={epochs}", *MODEL]
    t = time.perf_counter()
    out = run([MPIRUN, "-n", "2", PYTHON, *args], timeout=1800, env=one_thread_env())
    wall = time.perf_counter() - t
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = sum(r["samples"] for r in summary["ranks"])
    m = re.search(r"\[hpc_rlx\] data: .*checked(?: and read)? in ([\d.]+) s", out)
    shutil.rmtree(run_dir)
    return {"wall_s": wall, "samples": samples, "samples_per_s": samples / wall,
            "checks_s": float(m.group(1)) if m else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where the files are written (kept); default: a temp dir")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "many_files.jsonl")
    ap.add_argument("--label", default="", help="names the code measured; the table has one block per label")
    ap.add_argument("--table", action="store_true", help="only print the table of the lines in --out")
    args = ap.parse_args()
    if args.table:
        print(tables([json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]))
        return
    work = args.dir or Path(tempfile.mkdtemp(prefix="hpc_rlx_many_"))
    try:
        t = time.perf_counter()
        many, one, small = write_data(work, args.files)
        print(f"data under {work} ({time.perf_counter() - t:.0f} s to write)", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for r in range(args.rounds):
            rec = {"bench": "many_files", "label": args.label, "round": r, "files": args.files, "epochs": args.epochs,
                   "plan_one_sample_s": plan_seconds(many, True),
                   "plan_multi_sample_s": plan_seconds(small, False), "machine": machine_note()}
            for cache in ("memory", "stream"):
                for layout, path, one_sample in (("one", one, False), ("many", many, True)):
                    rec[f"{cache}_{layout}"] = got = train(path, one_sample, cache, args.epochs, work)
                    print(f"round {r} {cache:6s} {layout:4s}: {got['samples_per_s']:8.0f} samples/s, "
                          f"{got['wall_s']:.1f} s" + (f", checks {got['checks_s']:.2f} s" if got["checks_s"] else ""),
                          flush=True)
            lines.append(rec)
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
        print(tables(lines))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def tables(lines: list[dict]) -> str:
    """One table per label, in the order the labels first appear."""
    labels = list(dict.fromkeys(r.get("label", "") for r in lines))
    return "\n\n".join((f"{label}:\n" if label else "") + table([r for r in lines if r.get("label", "") == label])
                       for label in labels)


def table(lines: list[dict]) -> str:
    rows = []
    for cache in ("memory", "stream"):
        one = [r[f"{cache}_one"]["samples_per_s"] for r in lines]
        many = [r[f"{cache}_many"]["samples_per_s"] for r in lines]
        ratio = [m / o for m, o in zip(many, one)]
        start = [r["plan_one_sample_s"] + r[f"{cache}_many"]["checks_s"] for r in lines]
        rows.append([cache, f"{statistics.median(one):,.0f}", f"{statistics.median(many):,.0f}", _spread(ratio),
                     _spread(start)])
    plan = [r["plan_multi_sample_s"] for r in lines]
    return (fmt_table(["data.cache", "one file samples/s", "many files samples/s", "ratio (range)",
                       "start-up s: plan + checks (range)"], rows)
            + f"\nrank 0's plan over {lines[0]['files']:,} small multi-sample files: {_spread(plan)} s")


if __name__ == "__main__":
    main()
