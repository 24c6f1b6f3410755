"""Averaging policies under simulated mixed hardware: policy x slowdown -> time, accuracy, syncs.

    .venv/bin/python bench/bench_policies.py                       # 2 ranks, rank 1 three times slower
    .venv/bin/python bench/bench_policies.py --ranks 4 --slowdowns '{}' '{3: 4.0}' --epochs 10
    .venv/bin/python bench/bench_policies.py --policies cadence async --extra model.hidden=[512,512]

Every cell is one real `mpirun -n R python -m hpc_rlx` job on the default dataset (digits),
with `debug.slowdown` making chosen ranks honestly slower. Columns:

- epoch_s: median wall time of an epoch, the first (warm-up, scheduler settling) left out;
- val_acc: validation accuracy after the last epoch;
- syncs/ep: synchronisations (Allreduces) per epoch, median;
- steps/sync: local steps per rank per sync in the last epoch (sync: 1 each);
- comm_share: cadence/async: sync cost / window compute (what `overhead_target` aims at);
  sync: time rank 0 spent in the Allreduce / epoch wall (waiting for slow ranks included);
- rank0_wait: time rank 0 spent in collectives / epoch wall, for every policy.

Not a test: timings on a shared machine move from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MPIRUN = str(Path(PYTHON).with_name("mpirun"))


def run_cell(ranks: int, policy: str, slowdown: str, data: str, epochs: int, extra: list[str],
             workdir: Path, timeout: float) -> dict:
    run_dir = workdir / policy
    cmd = [MPIRUN, "-n", str(ranks), PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run_dir}",
           "report.plots=false", "checkpoint=off", f"data.path={data}", f"policy={policy}",
           f"train.epochs={epochs}", f"++debug.slowdown={slowdown}"] + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
        "syncs": statistics.median(syncs),
        "per_sync": per_sync,
        "share": share,
        "wait": statistics.median(r["comm_s"] / r["epoch_s"] for r in settled),
    }


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
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_policies_") as tmp:
        workdir = Path(tmp)
        data = args.data
        if data is None:
            sys.path.insert(0, str(REPO))
            from hpc_rlx.data.prepare import ensure_prepared
            data = str(workdir / "digits.h5")
            ensure_prepared(data, "digits")
        header = (f"{'policy':<8} {'slowdown':<12} {'epoch_s':>8} {'speedup':>8} {'val_acc':>8} "
                  f"{'syncs/ep':>8} {'comm_share':>10} {'rank0_wait':>10}  steps/sync")
        print(f"# mpirun -n {args.ranks}, {args.epochs} epochs, overrides {args.extra or '-'}")
        print(header)
        print("-" * len(header))
        for i, slowdown in enumerate(args.slowdowns):
            base = None
            for policy in args.policies:
                cell = run_cell(args.ranks, policy, slowdown, data, args.epochs, args.extra,
                                workdir / f"slowdown{i}", args.timeout)
                if "error" in cell:
                    print(f"{policy:<8} {slowdown:<12} failed: {cell['error']}")
                    continue
                if policy == "sync":
                    base = cell["epoch_s"]
                speedup = f"{base / cell['epoch_s']:.2f}x" if base else "-"
                share = "-" if cell["share"] is None else f"{cell['share']:.3f}"
                per_sync = ", ".join(f"{v:g}" for v in cell["per_sync"])
                print(f"{policy:<8} {slowdown:<12} {cell['epoch_s']:>8.4f} {speedup:>8} "
                      f"{cell['val_acc']:>8.4f} {cell['syncs']:>8g} {share:>10} "
                      f"{cell['wait']:>10.3f}  [{per_sync}]", flush=True)


if __name__ == "__main__":
    main()
