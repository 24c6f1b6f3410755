"""Pipeline stages on the transformer LM: throughput, memory per rank and the measured bubble.

    .venv/bin/python bench/bench_pipeline.py                        # S=1 on 1 rank, S=2 on 2 ranks
    .venv/bin/python bench/bench_pipeline.py --micro 2 4 8 --layers 4 --d-model 128
    .venv/bin/python bench/bench_pipeline.py --budget-only --budget-mib 32   # the memory budget part

Every job trains the same LM (synthetic tokens written under a temp dir, float32, AdamW) for
`--steps` steps of each of two epochs (train.max_steps; the first epoch is warm-up), one BLAS
thread per rank, with the trace on. Per job it prints samples/s (hpc_rlx's `samples_per_s`
over the second epoch), each rank's `param_bytes` and `optimizer_bytes` (summary.json) and
peak RSS, and per stage the measured bubble: 1 - (the stage's forward and backward span time)
/ (its pipeline step span time), over the second epoch's steps (`observe/pipeline_bubble.py`, what
`python -m hpc_rlx.report` prints), next to the schedule's
(S-1)/(M+S-1) for equal stage times. On a 2-core machine S <= 2 is all that measures the
pipeline rather than oversubscription (S=4 there runs 4 single-thread ranks on 2 cores).

Then, for each S, the deepest LM (`--budget-d-model` wide, n_layers grown) whose largest stage
holds at most `--budget-mib` MiB of parameters and optimizer state on a rank (param_bytes +
optimizer_bytes of summary.json): the depth is predicted from `graph/partition.py`'s split
(the one the run makes) and the optimizer's bytes per parameter byte measured on a 1-layer run,
then that model trains `--budget-steps` steps (tokens counting up: a short run shows the
loss falling) under mpirun and its measured bytes per rank are
checked against the budget (a miss tries one layer less). Activations are not in the budget
(they are per micro-batch, and small beside AdamW's state here).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, hpc_throughput, machine_note, mpirun, one_thread_env  # noqa: E402

from hpc_rlx.graph.models import build_model  # noqa: E402
from hpc_rlx.graph.partition import partition  # noqa: E402
from hpc_rlx.observe.pipeline_bubble import stage_bubbles  # noqa: E402


def write_tokens(path: Path, rows: int, seq: int, vocab: int, counting: bool = False) -> Path:
    """Random tokens, or (``counting``) rows counting up mod ``vocab`` from a random start: a
    next token a model learns within a few steps, so a short run shows the loss falling."""
    import h5py
    import numpy as np
    rng = np.random.default_rng(0)
    if counting:
        t = (rng.integers(0, vocab, (rows, 1)) + np.arange(seq + 1)) % vocab
    else:
        t = rng.integers(0, vocab, (rows, seq + 1))
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = t[:, :-1], t[:, 1:]
        f.attrs["num_classes"] = vocab
    return path


def measured_bubble(trace_path: Path, skip_steps: int) -> list:
    """Per stage: the bubble over the steps after the first ``skip_steps`` (the report's
    measurement, ``observe/pipeline_bubble.py``), averaged over the stage's replicas."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    return [r["bubble"] for r in stage_bubbles(events, skip_steps)]


def lm_overrides(data: Path, layers: int, d_model: int, batch: int, steps: int, epochs: int) -> list:
    return ["-m", "hpc_rlx", "model=transformer_lm", "data=file", f"data.path={data}", "optim=adamw",
            f"model.n_layers={layers}", f"model.d_model={d_model}", "model.n_heads=4",
            f"model.d_ff={4 * d_model}", f"train.batch_size={batch}", f"train.epochs={epochs}",
            f"train.max_steps={epochs * steps}", "checkpoint=off", "report.plots=false",
            "train.threads_per_rank=1", "data.val_fraction=0.05"]


def largest_stage_params(layers: int, d_model: int, seq: int, vocab: int, stages: int) -> int:
    """Trainable parameters of the largest stage when the LM is split into ``stages``."""
    g = build_model("transformer_lm", vocab_size=vocab, seq_len=seq, d_model=d_model, n_heads=4,
                    n_layers=layers, d_ff=4 * d_model)
    parts = partition(g, stages) if stages > 1 else [g]
    return max(p.num_params for p in parts)


def stage_overrides(S: int, micro: int) -> list:
    """The keys of a run in S pipeline stages, split as `largest_stage_params` predicts."""
    if S == 1:
        return []
    return [f"parallel.pipeline_stages={S}", f"parallel.microbatches={micro}", "parallel.balance=params"]


def held_bytes(ranks: list) -> int:
    """The most `param_bytes + optimizer_bytes` any rank of a summary.json holds."""
    return max(r["param_bytes"] + r["optimizer_bytes"] for r in ranks)


def deepest_within(budget: float, predicted_bytes, train) -> tuple:
    """The deepest n_layers whose run holds at most `budget` bytes on a rank: the depth grown
    while `predicted_bytes(L)` fits, then `train(L)` (a summary.json's ranks) checked, one
    layer less on a miss. Returns (L, the ranks of its run)."""
    L = 1
    while predicted_bytes(L + 1) <= budget:
        L += 1
    while True:
        ranks = train(L)
        if held_bytes(ranks) <= budget or L == 1:
            return L, ranks
        L -= 1


def budget_rows(args, tmp: Path, data: Path, vocab: int) -> list:
    """The deepest LM per S within the budget, each trained a few steps (see the docstring)."""
    budget = args.budget_mib * 2**20
    ranks = json.loads(_train(tmp / "calib", 1, 1, data, args, args.budget_d_model)["summary"])["ranks"]
    per_param_byte = (ranks[0]["param_bytes"] + ranks[0]["optimizer_bytes"]) / ranks[0]["param_bytes"]
    itemsize = ranks[0]["param_bytes"] / largest_stage_params(1, args.budget_d_model, args.seq, vocab, 1)
    rows = []
    for S in args.stages:
        runs = {}

        def train(L, S=S, runs=runs):
            runs[L] = _train(tmp / f"budget_s{S}_l{L}", S, L, data, args, args.budget_d_model)
            return json.loads(runs[L]["summary"])["ranks"]

        L, ranks = deepest_within(
            budget, lambda L, S=S: largest_stage_params(L, args.budget_d_model, args.seq, vocab, S) * itemsize
            * per_param_byte, train)
        out = runs[L]
        summary = json.loads(out["summary"])
        worst = held_bytes(ranks)
        whole = largest_stage_params(L, args.budget_d_model, args.seq, vocab, 1)
        r0 = ranks[0]
        rows.append([S, L, f"{whole / 1e6:.2f}", f"{worst / 2**20:.1f}",
                     " / ".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in ranks),
                     f"{r0.get('first_loss', float('nan')):.3f} -> {r0.get('last_loss', float('nan')):.3f}",
                     summary.get("steps", "?"), f"{out['wall_s']:.1f}"])
        print(rows[-1], flush=True)
    base = float(rows[0][2]) if rows else 1.0
    for r in rows:
        r.insert(3, f"{float(r[2]) / base:.2f}x")
    return rows


def _train(run: Path, S: int, layers: int, data: Path, args, d_model: int) -> dict:
    extra = [f"hydra.run.dir={run}"] + stage_overrides(S, args.budget_micro)
    t0 = time.perf_counter()
    mpirun(S, lm_overrides(data, layers, d_model, args.budget_batch, args.budget_steps, 1) + extra,
           timeout=1800, env=one_thread_env())
    wall = time.perf_counter() - t0
    return {"summary": (run / "summary.json").read_text(), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-mib", type=float, default=32.0,
                    help="per-rank param_bytes + optimizer_bytes the largest model must fit")
    ap.add_argument("--budget-d-model", type=int, default=128)
    ap.add_argument("--budget-steps", type=int, default=8)
    ap.add_argument("--budget-batch", type=int, default=16)
    ap.add_argument("--budget-micro", type=int, default=4)
    ap.add_argument("--budget-only", action="store_true", help="skip the throughput table")
    ap.add_argument("--no-budget", action="store_true", help="skip the memory-budget table")
    args = ap.parse_args()
    print(machine_note())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_tokens(tmp / "tok.h5", rows=args.batch * args.steps * 2 + 64, seq=args.seq, vocab=64)
        base = ["-m", "hpc_rlx", "model=transformer_lm", "data=file", f"data.path={data}", "optim=adamw",
                f"model.n_layers={args.layers}", f"model.d_model={args.d_model}", "model.n_heads=4",
                f"model.d_ff={4 * args.d_model}", f"train.batch_size={args.batch}", "train.epochs=2",
                f"train.max_steps={2 * args.steps}", "checkpoint=off", "report.plots=false",
                "trace.enabled=true", "train.threads_per_rank=1", "data.val_fraction=0.05"]
        for S in ([] if args.budget_only else args.stages):
            for M in (args.micro if S > 1 else [1]):
                for sched in (args.schedules if S > 1 else ["-"]):
                    run = tmp / f"s{S}m{M}{sched}"
                    extra = [f"hydra.run.dir={run}"]
                    if S > 1:
                        extra += [f"parallel.pipeline_stages={S}", f"parallel.microbatches={M}",
                                  f"parallel.schedule={sched}"]
                    mpirun(S, base + extra, timeout=1200, env=one_thread_env())
                    tput = hpc_throughput(run, args.batch)
                    ranks = json.loads((run / "summary.json").read_text())["ranks"]
                    bubble = measured_bubble(run / "trace.json", args.steps) if S > 1 else []
                    theory = (S - 1) / (M + S - 1)
                    rows.append([S, M if S > 1 else "-", sched, round(tput["samples_per_s"], 1),
                                 " / ".join(f"{r['param_bytes'] / 2**20:.2f}" for r in ranks),
                                 " / ".join(f"{r['optimizer_bytes'] / 2**20:.2f}" for r in ranks),
                                 " / ".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in ranks),
                                 " / ".join(f"{b:.2f}" for b in bubble) if bubble else "-",
                                 f"{theory:.2f}" if S > 1 else "-"])
                    print(rows[-1], flush=True)
        counting = write_tokens(tmp / "count.h5", rows=args.budget_batch * args.budget_steps + 64, seq=args.seq,
                                vocab=64, counting=True)
        fit = [] if args.no_budget else budget_rows(args, tmp, counting, vocab=64)
    if rows:
        print(fmt_table(["S", "M", "schedule", "samples/s", "param MiB/rank", "optim MiB/rank",
                         "peak RSS MiB/rank", "bubble measured/stage", "bubble (S-1)/(M+S-1)"], rows))
    if fit:
        print(f"\nthe deepest LM (d_model={args.budget_d_model}, seq {args.seq}, AdamW, float32) within "
              f"{args.budget_mib:g} MiB of param_bytes + optimizer_bytes per rank; {args.budget_steps} steps of "
              f"batch {args.budget_batch}, M={args.budget_micro}")
        print(fmt_table(["S", "n_layers", "M params (whole)", "x S=1", "max param+optim MiB/rank",
                         "peak RSS MiB/rank", "loss first -> last", "steps", "job wall s"], fit))


if __name__ == "__main__":
    main()
