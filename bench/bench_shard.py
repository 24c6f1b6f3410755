"""Sharded optimizer state (`comm.shard=optimizer`) against whole state, side by side in one run.

    .venv/bin/python bench/bench_shard.py
    .venv/bin/python bench/bench_shard.py --ranks 2 4 --repeats 3 --hidden 1024 1024

Three parts, every job with one BLAS thread per rank, AdamW, float32:

1. Step time: an MLP on synthetic data (`--hidden`, a few million parameters, so the gradient
   traffic is a real part of the step), sharded and unsharded jobs alternated `--repeats` times
   at each of `--ranks` ranks on this machine (loopback); per job the step time from hpc_rlx's
   own `samples_per_s` over the epochs after the first, and the median ratio sharded /
   unsharded (goal <= 1.05: a reduce-scatter and an allgather move the bytes of an Allreduce).
2. Memory per node: an MLP whose AdamW state is most of a rank's memory (`--memory-hidden`,
   ~18M parameters) at 1, 2 and 4 ranks on this one node, 4 steps: whole state, sharded, and
   sharded with one copy of the parameters per node (`comm.node_shared_params`): the node's
   summed `param_bytes + optimizer_bytes` (summary.json, what the ranks hold; the shared copy
   counted once) and summed peak resident memory (which counts the shared pages each rank
   touched, so it overstates a shared copy).
3. Budget: per rank count, the largest transformer LM (`--budget-d-model` wide, layers grown)
   whose `param_bytes + optimizer_bytes` on a rank fit `--budget-mib`, unsharded and sharded:
   the depth is predicted from bytes per parameter measured on a 1-layer run, then the model
   trains a few steps under mpirun and its measured bytes are checked (a miss tries one layer
   less).

On a 2-core machine 4 ranks are oversubscribed: their step times measure the sharing of the
cores as much as the collectives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, hpc_throughput, machine_note, mpirun, one_thread_env, prepare_synthetic  # noqa: E402
from bench_pipeline import largest_stage_params, lm_overrides, write_tokens  # noqa: E402

SHARDS = ("none", "optimizer")


def mlp_job(run: Path, ranks: int, data: Path, args, shard: str, hidden=None, extra=()) -> dict:
    hidden = hidden or args.hidden
    overrides = ["-m", "hpc_rlx", f"hydra.run.dir={run}", "data=file", f"data.path={data}", "optim=adamw",
                 "model=mlp", f"model.hidden=[{','.join(map(str, hidden))}]", f"train.batch_size={args.batch}",
                 f"train.epochs={args.epochs}", "checkpoint=off", "report.plots=false", "report.tensorboard=false",
                 "train.threads_per_rank=1", "data.val_fraction=0.02", f"comm.shard={shard}", *extra]
    mpirun(ranks, overrides, timeout=1200, env=one_thread_env())
    summary = json.loads((run / "summary.json").read_text())
    return {"step_ms": hpc_throughput(run, args.batch)["step_ms"], "ranks": summary["ranks"]}


def step_rows(tmp: Path, data: Path, args) -> list:
    rows = []
    for n in args.ranks:
        times = {shard: [] for shard in SHARDS}
        for i in range(args.repeats):
            for shard in SHARDS:
                times[shard].append(mlp_job(tmp / f"step_{n}_{shard}_{i}", n, data, args, shard)["step_ms"])
        ratio = statistics.median(s / w for s, w in zip(times["optimizer"], times["none"]))
        rows.append([n, statistics.median(times["none"]), statistics.median(times["optimizer"]), round(ratio, 3)])
    return rows


# the memory part's setups: (label, comm.shard, comm.node_shared_params)
MEMORY_SETUPS = (("none", "none", False), ("optimizer", "optimizer", False),
                 ("optimizer + node_shared_params", "optimizer", True))


def memory_rows(tmp: Path, data: Path, args) -> list:
    rows = []
    for n in (1, 2, 4):
        for label, shard, node_shared in MEMORY_SETUPS:
            extra = ["train.epochs=1", "train.max_steps=4", f"comm.node_shared_params={str(node_shared).lower()}"]
            ranks = mlp_job(tmp / f"mem_{n}_{shard}_{node_shared}", n, data, args, shard,
                            hidden=args.memory_hidden, extra=extra)["ranks"]
            held = sum(r["param_bytes"] + r["optimizer_bytes"] for r in ranks)
            rows.append([n, label, round(held / 2**20, 1), round(sum(r["optimizer_bytes"] for r in ranks) / 2**20, 1),
                         round(sum(r["peak_rss_bytes"] for r in ranks) / 2**20, 1)])
    return rows


def lm_job(run: Path, ranks: int, layers: int, data: Path, args, shard: str) -> list:
    mpirun(ranks, lm_overrides(data, layers, args.budget_d_model, 8 * ranks, 4, 1)
           + [f"hydra.run.dir={run}", f"comm.shard={shard}", "report.tensorboard=false"],
           timeout=1800, env=one_thread_env())
    return json.loads((run / "summary.json").read_text())["ranks"]


def budget_rows(tmp: Path, data: Path, args, vocab: int) -> list:
    budget = args.budget_mib * 2**20
    held = lambda ranks: max(r["param_bytes"] + r["optimizer_bytes"] for r in ranks)   # noqa: E731
    calib = lm_job(tmp / "calib", 1, 1, data, args, "none")[0]
    params = largest_stage_params(1, args.budget_d_model, args.seq, vocab, 1)
    p_bytes, o_bytes = calib["param_bytes"] / params, calib["optimizer_bytes"] / params
    rows = []
    for n in args.ranks:
        for shard in SHARDS:
            per_param = p_bytes + (o_bytes / n if shard == "optimizer" else o_bytes)
            layers = 1
            while largest_stage_params(layers + 1, args.budget_d_model, args.seq, vocab, 1) * per_param <= budget:
                layers += 1
            while layers >= 1:
                ranks = lm_job(tmp / f"budget_{n}_{shard}_{layers}", n, layers, data, args, shard)
                if held(ranks) <= budget:
                    break
                layers -= 1
            total = largest_stage_params(layers, args.budget_d_model, args.seq, vocab, 1)
            rows.append([n, shard, layers, round(total / 1e6, 2), round(held(ranks) / 2**20, 1)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    ap.add_argument("--memory-hidden", type=int, nargs="+", default=[4096, 4096],
                    help="the memory part's MLP: AdamW's state most of a rank's memory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rows", type=int, default=3200)
    ap.add_argument("--budget-mib", type=float, default=32.0)
    ap.add_argument("--budget-d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--skip", nargs="*", default=[], choices=["step", "memory", "budget"])
    args = ap.parse_args()
    print(machine_note())
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = prepare_synthetic(tmp / "syn.h5", args.rows, 256)
        if "step" not in args.skip:
            print("\nstep time, loopback (median over repeats; ratio = median of sharded / unsharded per repeat)")
            print(fmt_table(["ranks", "unsharded ms", "sharded ms", "ratio"], step_rows(tmp, data, args)))
        if "memory" not in args.skip:
            print("\nmemory on this node: sums over its ranks (MiB)")
            print(fmt_table(["ranks", "setup", "param+optimizer", "optimizer", "peak RSS"],
                            memory_rows(tmp, data, args)))
        if "budget" not in args.skip:
            vocab = 512
            tokens = write_tokens(tmp / "tokens.h5", 2048, args.seq, vocab, counting=True)
            print(f"\nlargest transformer LM (d_model {args.budget_d_model}) within {args.budget_mib} MiB of "
                  f"parameters + optimizer state per rank")
            print(fmt_table(["ranks", "comm.shard", "layers", "M params", "held MiB/rank"],
                            budget_rows(tmp, tokens, args, vocab)))


if __name__ == "__main__":
    main()
