"""DiLoCo against `sync` and plain averaging on the transformer LM (`experiment=lm`).

    .venv/bin/python bench/bench_diloco.py                          # 2 ranks, 8 epochs, every row
    .venv/bin/python bench/bench_diloco.py --ranks 2 4              # one table per world size
    .venv/bin/python bench/bench_diloco.py --epochs 2 --rows sync average diloco   # a quick look

Every row is one real `mpirun -n R python -m hpc_rlx experiment=lm` job (global batch 32,
seed 3 unless told otherwise) on the character-level corpus, one BLAS thread per process.
K is fixed with `policy.tune=false policy.anchor=K`: each rank runs K local steps of batch
32/R between syncs, so a window covers K global batches of data whatever R is. Columns:

- syncs/ep: synchronisations (Allreduces) in the last epoch (sync: one per step);
- fewer: sync's syncs per epoch over the row's;
- val_loss: validation loss after the last epoch, one run per row (a run repeats bitwise on
  one code version; the seed moves it by more than the 2% goal: `--seed`, `bench/README.md`);
- vs_sync: val_loss / sync's val_loss (the goal: <= 1.02 at >= 20x fewer syncs);
- wall_s: the job's wall time (on a shared machine, only a rough guide).

Not a test. The rows, by name (`--rows`):
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import fmt_table, machine_note, mpirun, one_thread_env
from hpc_rlx.data.prepare import ensure_prepared  # noqa: E402  (_common puts the repo on the path)

FIXED = ["policy=async", "policy.tune=false"]
OLD = ["policy.outer=diloco", "policy.outer_lr=0.7", "policy.outer_momentum=0.9",
       "policy.outer_warmup=0"]          # the DiLoCo defaults before these measurements
# name -> (K or None for sync, overrides)
ROWS = {
    "sync": (None, ["policy=sync"]),
    "average": (25, ["policy.outer=average"]),
    "diloco-reset": (25, OLD + ["policy.reset_inner=true"]),
    "diloco-kept": (25, OLD + ["policy.reset_inner=false"]),
    "diloco-reset-k100": (100, OLD + ["policy.reset_inner=true"]),
    "diloco-m05": (25, ["policy.outer=diloco", "policy.outer_lr=0.7", "policy.outer_momentum=0.5",
                        "policy.outer_warmup=0"]),
    "diloco-w9": (25, ["policy.outer=diloco", "policy.outer_warmup=9"]),
    "diloco": (25, ["policy.outer=diloco"]),                  # the defaults
    "diloco-k23": (23, ["policy.outer=diloco"]),              # 9 syncs per epoch, as K=25
    "diloco-k100": (100, ["policy.outer=diloco"]),
}
LABELS = {
    "sync": "policy=sync",
    "average": "K=25 outer=average",
    "diloco-reset": "K=25 diloco 0.7/0.9, inner reset (old default)",
    "diloco-kept": "K=25 diloco 0.7/0.9, inner kept",
    "diloco-reset-k100": "K=100 diloco 0.7/0.9, inner reset (old default)",
    "diloco-m05": "K=25 diloco 0.7/0.5, inner kept, no warm-up",
    "diloco-w9": "K=25 diloco, warm-up 9 (old default)",
    "diloco": "K=25 diloco, defaults",
    "diloco-k23": "K=23 diloco, defaults",
    "diloco-k100": "K=100 diloco, defaults",
}
__doc__ += "".join(f"\n- {name}: {LABELS[name]}" for name in ROWS) + "\n"


def run_row(ranks: int, name: str, data: str, epochs: int, seed: int, extra: list[str],
            workdir: Path, timeout: float) -> dict:
    k, overrides = ROWS[name]
    run_dir = workdir / f"{name}-n{ranks}"
    args = ["-m", "hpc_rlx", "experiment=lm", f"hydra.run.dir={run_dir}", "report.plots=false",
            "checkpoint=off", f"data.path={data}", f"train.epochs={epochs}", f"train.seed={seed}"]
    if k is not None:
        args += FIXED + [f"policy.anchor={k}"]
    args += overrides + extra
    t0 = time.perf_counter()
    mpirun(ranks, args, timeout=timeout, env=one_thread_env())
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    recs = [r for r in recs if "event" not in r]
    last = recs[-1]
    syncs = last["syncs"] if "syncs" in last else last["steps"]
    return {"syncs": syncs, "val_loss": last["val_loss"], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes, one table each")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--data", default=None, help="a prepared text.h5 (default: prepare one)")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every row")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    args = ap.parse_args()

    rows = args.rows if "sync" in args.rows else ["sync"] + args.rows   # the ratio's reference
    with tempfile.TemporaryDirectory(prefix="bench_diloco_") as tmp:
        workdir = Path(tmp)
        data = args.data
        if data is None:
            data = str(workdir / "text.h5")
            ensure_prepared(data, "text")
        print(f"# {machine_note()}")
        for ranks in args.ranks:
            print(f"\n# mpirun -n {ranks} python -m hpc_rlx experiment=lm train.epochs={args.epochs} "
                  f"train.seed={args.seed} (global batch 32), overrides {args.extra or '-'}", flush=True)
            table, ref = [], None
            for name in rows:
                cell = run_row(ranks, name, data, args.epochs, args.seed, args.extra, workdir,
                               args.timeout)
                if name == "sync":
                    ref = cell
                table.append([LABELS[name], cell["syncs"], f"{ref['syncs'] / cell['syncs']:.1f}x",
                              f"{cell['val_loss']:.4f}", f"{cell['val_loss'] / ref['val_loss']:.4f}",
                              f"{cell['wall_s']:.0f}"])
                print(f"  {name}: {cell}", flush=True)
            print(fmt_table(["run", "syncs/ep", "fewer", "val_loss", "vs_sync", "wall_s"], table),
                  flush=True)


if __name__ == "__main__":
    main()
