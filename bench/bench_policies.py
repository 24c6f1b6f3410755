"""Averaging policies under simulated mixed hardware: policy x slowdown -> time, accuracy, syncs.

    .venv/bin/python bench/bench_policies.py                       # 2 ranks, rank 1 three times slower
    .venv/bin/python bench/bench_policies.py --ranks 4 --slowdowns '{}' '{3: 4.0}' --epochs 10
    .venv/bin/python bench/bench_policies.py --policies cadence async --extra model.hidden=[512,512]
    # cadence against sync on a 10-class blob set, 3 seeds, and the weightings behind the default:
    .venv/bin/python bench/bench_policies.py --blobs 2.5 --epochs 3 --seeds 1 2 3 --slowdowns '{1: 3.0}' \
        --policies sync cadence cadence+policy.gamma=0 cadence+policy.gamma=1 \
        --extra 'model.hidden=[512,512]' train.batch_size=128

Every cell is one real `mpirun -n R python -m hpc_rlx` job on the default dataset (digits),
with `debug.slowdown` making chosen ranks honestly slower. Columns:

- epoch_s: median wall time of an epoch, the first (warm-up, scheduler settling) left out;
- val_acc, val_loss: validation accuracy and loss after the last epoch (means over `--seeds`);
- syncs/ep: synchronisations (Allreduces) per epoch, median;
- steps/sync: local steps per rank per sync in the last epoch (sync: 1 each);
- comm_share: cadence/async: sync cost / window compute (what `overhead_target` aims at);
  sync: time rank 0 spent in the Allreduce / epoch wall (waiting for slow ranks included);
- rank0_wait: time rank 0 spent in collectives / epoch wall, for every policy.

A policy may carry overrides of its own after '+' (`cadence+policy.gamma=1`). Every cell runs
once per seed (`--seeds`, default 1 2 3); the table shows the means, the accuracy and loss with
their spread (lowest-highest), the speed against sync of the same seed. Each job's raw result
goes to a JSON lines file (`--out`, default bench/results/policies.jsonl, started afresh unless
`--append`), from which bench/tables.py makes the Markdown tables of bench/README.md. `--blobs S` trains on Gaussian clusters (10 classes,
32 features, 10,000 rows, class centers S noise deviations apart) instead of the digits.

Not a test: timings on a shared machine move from run to run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import append_record, policies_table, read_records

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MPIRUN = str(Path(PYTHON).with_name("mpirun"))


def run_cell(ranks: int, policy: str, slowdown: str, data: str, epochs: int, extra: list[str],
             workdir: Path, timeout: float) -> dict:
    policy, *own = policy.split("+")
    run_dir = workdir / "_".join([policy] + own).replace("=", "").replace(".", "")
    cmd = [MPIRUN, "-n", str(ranks), PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run_dir}",
           "report.plots=false", "checkpoint=off", f"data.path={data}", f"policy={policy}",
           f"train.epochs={epochs}", f"++debug.slowdown={slowdown}"] + own + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    load, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    settled = recs[1:] or recs
    last = recs[-1]
    if policy == "sync":
        syncs = [r["steps"] for r in settled]
        per_sync = [1.0] * ranks
        share = statistics.median(r["comm_s"] / r["epoch_s"] for r in settled)
    else:
        syncs = [r["syncs"] for r in settled]
        per_sync = last["steps_per_sync"]
        shares = [r["comm_share"] for r in settled if r.get("comm_share") is not None]
        share = statistics.median(shares) if shares else None
    return {
        "epoch_s": statistics.median(r["epoch_s"] for r in settled),
        "val_acc": last["val_accuracy"],
        "val_loss": last["val_loss"],
        "syncs": statistics.median(syncs),
        "per_sync": per_sync,
        "share": share,
        "wait": statistics.median(r["comm_s"] / r["epoch_s"] for r in settled),
        "wall_s": round(time.perf_counter() - t0, 1), "load_before": round(load, 2),
    }


def mean_cell(cells: list[dict]) -> dict:
    """The seeds' cells as one: means of the numbers, the last seed's steps per sync."""
    out = dict(cells[-1])
    for key in ("epoch_s", "val_acc", "val_loss", "syncs", "wait"):
        out[key] = statistics.mean(c[key] for c in cells)
    shares = [c["share"] for c in cells if c["share"] is not None]
    out["share"] = statistics.mean(shares) if shares else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=["sync", "cadence", "async"])
    ap.add_argument("--slowdowns", nargs="+", default=["{}", "{1: 3.0}"],
                    help="debug.slowdown values, as Hydra dicts")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--data", default=None, help="a prepared digits.h5 (default: prepare one)")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every cell")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="train.seed of each repeat (means)")
    ap.add_argument("--blobs", type=float, default=None,
                    help="Gaussian clusters this many noise deviations apart instead of the digits")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "policies.jsonl",
                    help="the raw results, one JSON line a job")
    ap.add_argument("--append", action="store_true", help="add to --out instead of starting it afresh")
    args = ap.parse_args()
    if not args.append:
        args.out.unlink(missing_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    setting = {"ranks": args.ranks, "epochs": args.epochs, "extra": args.extra, "blobs": args.blobs,
               "data": args.data}

    with tempfile.TemporaryDirectory(prefix="bench_policies_") as tmp:
        workdir = Path(tmp)
        data = args.data
        if data is None and args.blobs is not None:
            sys.path.insert(0, str(REPO))
            from hpc_rlx.data.prepare import prepare_synthetic
            data = prepare_synthetic(workdir / "blobs.h5", separation=args.blobs)
        if data is None:
            sys.path.insert(0, str(REPO))
            from hpc_rlx.data.prepare import ensure_prepared
            data = str(workdir / "digits.h5")
            ensure_prepared(data, "digits")
        header = (f"{'policy':<24} {'slowdown':<12} {'epoch_s':>8} {'speedup':>8} {'val_acc':>8} "
                  f"{'val_loss':>8} {'syncs/ep':>8} {'comm_share':>10} {'rank0_wait':>10}  steps/sync")
        print(f"# mpirun -n {args.ranks}, {args.epochs} epochs, seeds {args.seeds}, overrides {args.extra or '-'}")
        print(header)
        print("-" * len(header))
        for i, slowdown in enumerate(args.slowdowns):
            base = None
            for policy in args.policies:
                cells = []
                for seed in args.seeds:
                    cell = run_cell(args.ranks, policy, slowdown, data, args.epochs,
                                    args.extra + [f"train.seed={seed}"], workdir / f"slowdown{i}-seed{seed}",
                                    args.timeout)
                    cells.append(cell)
                    if "error" not in cell:
                        append_record(args.out, dict(cell, bench="policies", setting=setting, policy=policy,
                                                     slowdown=slowdown, seed=seed, commit=commit,
                                                     date=datetime.datetime.now(datetime.timezone.utc)
                                                     .strftime("%Y-%m-%dT%H:%MZ")))
                failed = [c["error"] for c in cells if "error" in c]
                if failed:
                    print(f"{policy:<24} {slowdown:<12} failed: {failed[0]}")
                    continue
                cell = mean_cell(cells)
                if policy == "sync":
                    base = cell["epoch_s"]
                speedup = f"{base / cell['epoch_s']:.2f}x" if base else "-"
                share = "-" if cell["share"] is None else f"{cell['share']:.3f}"
                per_sync = ", ".join(f"{v:g}" for v in cell["per_sync"])
                print(f"{policy:<24} {slowdown:<12} {cell['epoch_s']:>8.4f} {speedup:>8} "
                      f"{cell['val_acc']:>8.4f} {cell['val_loss']:>8.4f} {cell['syncs']:>8g} {share:>10} "
                      f"{cell['wait']:>10.3f}  [{per_sync}]", flush=True)
    if args.out.exists():
        print(f"\n# raw results: {args.out}\n")
        print(policies_table(read_records(args.out)), flush=True)


if __name__ == "__main__":
    main()
