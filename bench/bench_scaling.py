"""Weak and strong scaling of hpc_rlx over 1/2/4 ranks, for the MLP and the transformer LM.

    .venv/bin/python bench/bench_scaling.py                        # both models, a few minutes
    .venv/bin/python bench/bench_scaling.py --models mlp --ranks 1,2,4,8 --repeats 3

strong: the global batch is fixed (MLP 512, LM 32) and split over the ranks; ideal is
        throughput x n at n ranks.
weak:   the batch per rank is fixed (MLP 128, LM 16), so the global batch grows with n.
Efficiency = throughput at n / (n x throughput at 1) in both cases. Throughput is hpc_rlx's
`samples_per_s` (rank 0's step wall time: batch gather, forward/backward, allreduce,
optimizer) over the epochs after the first. `comm` is the share of step time spent in the
allreduce on rank 0, waiting for slower ranks included. One BLAS thread per rank. More ranks
than cores share the cores: the efficiency then shows the machine's limit.

Data: the MLP trains on synthetic 784-feature, 10-class clusters; the LM (d_model 64, 2 layers,
4 heads, 64 tokens) on the first rows of the character-level text corpus
(`python -m hpc_rlx.data prepare text`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (fmt_table, hpc_throughput, machine_note, median, mpirun,  # noqa: E402
                     one_thread_env, prepare_synthetic)

MODELS = {
    # name: (overrides, strong global batch, weak per-rank batch)
    "mlp": (["model=mlp", "model.hidden=[1024,1024]", "data=synthetic", "optim=sgd", "optim.lr=0.01"], 512, 128),
    "lm": (["experiment=lm"], 32, 16),
}


def lm_data(work: Path, rows: int) -> Path:
    """The first `rows` windows of the text corpus, attributes kept."""
    import h5py

    from hpc_rlx.data.prepare import prepare_text
    full = work / "text_full.h5"
    out = work / f"text_{rows}.h5"
    if out.exists():
        return out
    prepare_text(full)
    with h5py.File(full, "r") as src, h5py.File(out, "w") as dst:
        for name in ("x", "y"):
            dst.create_dataset(name, data=src[name][:rows])
        for k, v in src.attrs.items():
            dst.attrs[k] = v
    return out


def run_point(model: str, data: Path, n: int, global_batch: int, epochs: int, work: Path) -> dict:
    run_dir = work / f"{model}_n{n}_b{global_batch}_{time.monotonic_ns()}"
    args = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}"] + MODELS[model][0] + [
        f"data.path={data}", "data.val_fraction=0", f"train.batch_size={global_batch}",
        f"train.epochs={epochs}", "train.threads_per_rank=1", "optim.schedule=constant",
        "checkpoint=off", "report.plots=false", "train.log_every_s=1000"]
    mpirun(n, args, timeout=1200, env=one_thread_env())
    out = hpc_throughput(run_dir, global_batch, skip_epochs=1)
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,lm")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=16, help="steps per epoch at the smallest step count")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is warm-up, not timed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    models = args.models.split(",")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hpc_rlx_bench_scaling_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# {machine_note()}")
    rows = []
    for model in models:
        _, strong_b, weak_b = MODELS[model]
        # enough rows for `steps` steps per epoch at the largest global batch
        biggest = max(strong_b, weak_b * max(ranks))
        n_rows = biggest * args.steps
        data = (prepare_synthetic(work / f"syn_{n_rows}.h5", n_rows, 784, 10) if model == "mlp"
                else lm_data(work, n_rows))
        for mode in ("strong", "weak"):
            res: dict[int, list] = {n: [] for n in ranks}
            for rep in range(args.repeats):
                for n in ranks:
                    gb = strong_b if mode == "strong" else weak_b * n
                    if gb % n:
                        continue
                    r = run_point(model, data, n, gb, args.epochs, work)
                    res[n].append(r)
                    print(f"  {model} {mode} n={n} batch {gb}: {r['samples_per_s']:,.0f} samples/s "
                          f"({r['step_ms']:.1f} ms/step, comm {100 * r['comm_frac']:.0f}%)", flush=True)
            base = max(v["samples_per_s"] for v in res[ranks[0]]) if res[ranks[0]] else None
            for n in ranks:
                if not res[n]:
                    continue
                best = max(v["samples_per_s"] for v in res[n])
                gb = strong_b if mode == "strong" else weak_b * n
                eff = best / (n / ranks[0] * base) if base else None
                rows.append([model, mode, n, gb, best, median([v["step_ms"] for v in res[n]]),
                             f"{100 * median([v['comm_frac'] for v in res[n]]):.0f}%",
                             best / base if base else None, eff])
    print()
    print(fmt_table(["model", "scaling", "ranks", "global batch", "samples/s (best)", "ms/step (median)",
                     "comm", "speed-up", "efficiency"], rows))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
