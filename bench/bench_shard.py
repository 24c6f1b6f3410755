"""Sharded optimizer state (`comm.shard=optimizer`) against whole state, side by side in one run.

    .venv/bin/python bench/bench_shard.py
    .venv/bin/python bench/bench_shard.py --ranks 2 4 --repeats 3 --hidden 1024 1024
    .venv/bin/python bench/bench_shard.py --skip memory budget --links 10gbit   # as root
    .venv/bin/python bench/bench_shard.py --skip step memory budget --collectives --links 10gbit
    .venv/bin/python bench/bench_shard.py --skip step memory --budget-stages 1 2 4

Three parts, every job with one BLAS thread per rank, AdamW, float32:

1. Step time: an MLP on synthetic data (`--hidden`, a few million parameters, so the gradient
   traffic is a real part of the step), sharded and unsharded jobs alternated `--repeats` times
   at each of `--ranks` ranks on this machine (loopback); per job the step time from hpc_rlx's
   own `samples_per_s` over the epochs after the first, and the median ratio sharded /
   unsharded (goal <= 1.05: a reduce-scatter and an allgather move the bytes of an Allreduce),
   with each side's comm share (`comm_s` over the step wall). `--links 10gbit` (root) runs the
   same jobs across 2 emulated nodes (tests/support/netns_cluster.py, as bench_interconnect.py:
   network namespaces joined by a bridge, `tc tbf` at that rate on each node's interface, node k
   pinned to core k): 2 ranks as 1 + 1, 4 as 2 + 2 (where the unsharded job sums each node's
   part in shared memory first, `comm.shared_memory`, and the sharded one does not).
   `--step-extra KEY=VALUE...` adds overrides to both sides (`comm.shared_memory=false` puts the
   unsharded side on MPI's Allreduce, as the sharded side is on MPI's Alltoallv/Allgatherv).
   `--collectives` times the step's collectives alone on the same payload, under the same
   launchers: MPI's Allreduce against the sharded path's reduce-scatter (`ScatteredSum`: the
   tail's Allgather, one Alltoallv, the sums in rank order) and allgather (`ParamShard.allgather`:
   one Allgatherv in place), with MPI's own Reduce_scatter and Allgather (equal blocks) beside.
2. Memory per node: an MLP whose AdamW state is most of a rank's memory (`--memory-hidden`,
   ~18M parameters) at 1, 2 and 4 ranks on this one node, 4 steps: whole state, sharded, and
   sharded with one copy of the parameters per node (`comm.node_shared_params`): the node's
   summed `param_bytes + optimizer_bytes` (summary.json, what the ranks hold; the shared copy
   counted once), summed peak resident memory (which counts the shared pages each rank
   touched, so it overstates a shared copy) and, as root, the peak of a cgroup holding the
   whole job (tests/support/memory_limit.py, no limit set: every page once, shared ones too).
3. Budget: per rank count, the largest transformer LM (`--budget-d-model` wide, layers grown)
   whose `param_bytes + optimizer_bytes` on a rank fit `--budget-mib`, unsharded and sharded,
   and in `--budget-stages` pipeline stages (S dividing the ranks, n/S replicas a stage, the
   stage's state sliced among its replicas when sharded), as `bench_pipeline.py --budget-only`
   does for stages alone and with its search (`deepest_within`): the depth is predicted from
   the largest stage's parameters (`graph/partition.py`'s split) and the bytes per parameter
   measured on a 1-layer run, then the model trains a few steps under mpirun and its measured
   bytes are checked (a miss tries one layer less).

On a 2-core machine 4 ranks are oversubscribed: their step times measure the sharing of the
cores as much as the collectives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (MPIRUN, PYTHON, emulated_nodes, fmt_table, hpc_throughput,  # noqa: E402
                     machine_note, mpiexec_on_nodes, mpirun, one_thread_env, prepare_synthetic, result_line,
                     run)
from bench_pipeline import (deepest_within, held_bytes, largest_stage_params, lm_overrides,  # noqa: E402
                            stage_overrides, write_tokens)

from tests.support.memory_limit import LimitUnavailable, MemoryLimit  # noqa: E402

SHARDS = ("none", "optimizer")


def loopback(n: int, overrides: list, timeout: float = 1200) -> str:
    return mpirun(n, overrides, timeout=timeout, env=one_thread_env())


def on_nodes(cluster):
    """A launcher across 2 emulated nodes: n ranks as n/2 on each."""
    def launch(n: int, overrides: list, timeout: float = 1200) -> str:
        return mpiexec_on_nodes(cluster, {"node1": n // 2, "node2": n - n // 2}, overrides, timeout=timeout)
    return launch


def mlp_job(run: Path, ranks: int, data: Path, args, shard: str, hidden=None, extra=(), launch=loopback) -> dict:
    hidden = hidden or args.hidden
    overrides = ["-m", "hpc_rlx", f"hydra.run.dir={run}", "data=file", f"data.path={data}", "optim=adamw",
                 "model=mlp", f"model.hidden=[{','.join(map(str, hidden))}]", f"train.batch_size={args.batch}",
                 f"train.epochs={args.epochs}", "checkpoint=off", "report.plots=false", "report.tensorboard=false",
                 "train.threads_per_rank=1", "data.val_fraction=0.02", f"comm.shard={shard}", *extra]
    launch(ranks, overrides, 1200)
    summary = json.loads((run / "summary.json").read_text())
    tput = hpc_throughput(run, args.batch)
    return {"step_ms": tput["step_ms"], "comm_frac": tput["comm_frac"], "ranks": summary["ranks"]}


def step_rows(tmp: Path, data: Path, args, where: str = "loopback", launch=loopback) -> list:
    """Per rank count: sharded and unsharded jobs alternated (the order reversed every other
    repeat), the median step time of each, and the median of the per-repeat ratios."""
    rows = []
    for n in args.ranks:
        jobs = {shard: [] for shard in SHARDS}
        for i in range(args.repeats):
            for shard in (SHARDS if i % 2 == 0 else SHARDS[::-1]):
                jobs[shard].append(mlp_job(tmp / f"step_{where}_{n}_{shard}_{i}", n, data, args, shard,
                                           extra=args.step_extra, launch=launch))
            print(f"  {where} {n} ranks, repeat {i + 1}: unsharded {jobs['none'][-1]['step_ms']:.2f} ms, sharded "
                  f"{jobs['optimizer'][-1]['step_ms']:.2f} ms, ratio "
                  f"{jobs['optimizer'][-1]['step_ms'] / jobs['none'][-1]['step_ms']:.3f}", flush=True)
        ratios = [s["step_ms"] / w["step_ms"] for s, w in zip(jobs["optimizer"], jobs["none"])]
        med = {shard: statistics.median(j["step_ms"] for j in jobs[shard]) for shard in SHARDS}
        comm = {shard: statistics.median(j["comm_frac"] for j in jobs[shard]) for shard in SHARDS}
        rows.append([where, n, med["none"], med["optimizer"], round(statistics.median(ratios), 3),
                     f"{min(ratios):.3f}-{max(ratios):.3f}", f"{100 * comm['none']:.0f}%",
                     f"{100 * comm['optimizer']:.0f}%"])
    return rows


def collective_child(elems: int, repeats: int) -> None:
    """Under mpirun: the step's collectives on a float32 payload of `elems`, each timed between
    barriers (the slowest rank's time), the variants alternated in every repeat; rank 0 prints
    the medians (ms) as a RESULT line."""
    import types

    import numpy as np
    from mpi4py import MPI

    from hpc_rlx.comm.shard import ParamShard, ScatteredSum

    comm = MPI.COMM_WORLD
    chunk = 16 * 2**20 // 4                     # comm.bucket_cap_mb's default: one round
    payload = np.zeros(elems, np.float32)          # zeros: the sums stay finite
    bucket = types.SimpleNamespace(payload=payload, tail=np.zeros(6, np.float32))
    shard = ParamShard(elems, elems, comm.rank, comm.size)
    scattered = ScatteredSum(shard, chunk)
    counts = [hi - lo for lo, hi in shard.bounds]
    mine = np.empty(counts[comm.rank], np.float32)
    block = np.empty(elems // comm.size * comm.size, np.float32)
    variants = {
        "Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, payload),
        "reduce-scatter": lambda: scattered.run(bucket, comm, 0),        # tail Allgather + Alltoallv + sums
        "allgather": lambda: shard.allgather(comm, payload, chunk),       # Allgatherv, in place
        "MPI Reduce_scatter": lambda: comm.Reduce_scatter(payload, mine, counts),
        "MPI Allgather": lambda: comm.Allgather(MPI.IN_PLACE, block),
    }
    times = {name: [] for name in variants}
    for rep in range(repeats):
        for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            variants[name]()                    # untimed: warm buffers
            comm.Barrier()
            t0 = time.perf_counter()
            variants[name]()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            times[name].append(1e3 * dt)
    if comm.rank == 0:
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)


def collective_rows(args, where: str, launch_out) -> list:
    dims = [256, *args.hidden, 10]                      # the step part's MLP
    elems = sum(a * b + b for a, b in zip(dims, dims[1:]))
    rows = []
    for n in args.ranks:
        r = result_line(launch_out(n, [__file__, "--collective-child", str(elems), str(args.collective_repeats)]))
        ratio = (r["reduce-scatter"] + r["allgather"]) / r["Allreduce"]
        rows.append([where, n, f"{elems * 4 / 2**20:.1f}", r["Allreduce"], r["reduce-scatter"], r["allgather"],
                     f"{ratio:.2f}", r["MPI Reduce_scatter"], r["MPI Allgather"]])
        print(f"  {where} {n} ranks: {r}", flush=True)
    return rows


COLLECTIVE_HEADERS = ["where", "ranks", "MiB", "Allreduce ms", "reduce-scatter ms", "allgather ms",
                      "(rs + ag) / Allreduce", "MPI Reduce_scatter ms", "MPI Allgather ms"]


STEP_HEADERS = ["where", "ranks", "unsharded ms", "sharded ms", "ratio", "ratio range", "comm unsharded",
                "comm sharded"]


# the memory part's setups: (label, comm.shard, comm.node_shared_params)
MEMORY_SETUPS = (("none", "none", False), ("optimizer", "optimizer", False),
                 ("optimizer + node_shared_params", "optimizer", True))


def in_cgroup(limit):
    """A launcher that runs mpirun and its ranks inside `limit`'s cgroup (its peak: the job's)."""
    def launch(n: int, overrides: list, timeout: float = 1200) -> str:
        return run(limit.wrap([MPIRUN, "-n", str(n), PYTHON] + list(overrides)), timeout=timeout,
                   env=one_thread_env())
    return launch


def memory_rows(tmp: Path, data: Path, args) -> list:
    rows = []
    for n in (1, 2, 4):
        for label, shard, node_shared in MEMORY_SETUPS:
            extra = ["train.epochs=1", "train.max_steps=4", f"comm.node_shared_params={str(node_shared).lower()}"]
            run_dir = tmp / f"mem_{n}_{shard}_{node_shared}"
            try:
                with MemoryLimit(64 << 30) as limit:        # no limit in effect: only its peak is read
                    ranks = mlp_job(run_dir, n, data, args, shard, hidden=args.memory_hidden, extra=extra,
                                    launch=in_cgroup(limit))["ranks"]
                    node_peak = limit.peak_bytes()
            except LimitUnavailable as why:
                print(f"  (no cgroup peak: {why})", flush=True)
                ranks = mlp_job(run_dir, n, data, args, shard, hidden=args.memory_hidden, extra=extra)["ranks"]
                node_peak = None
            held = sum(r["param_bytes"] + r["optimizer_bytes"] for r in ranks)
            rows.append([n, label, round(held / 2**20, 1), round(sum(r["optimizer_bytes"] for r in ranks) / 2**20, 1),
                         round(sum(r["peak_rss_bytes"] for r in ranks) / 2**20, 1),
                         round(node_peak / 2**20, 1) if node_peak else None])
            print(f"  {n} ranks, {label}: {rows[-1][2:]}", flush=True)
    return rows


def lm_job(run: Path, ranks: int, stages: int, layers: int, data: Path, args, shard: str) -> list:
    mpirun(ranks, lm_overrides(data, layers, args.budget_d_model, 8 * ranks, 4, 1) + stage_overrides(stages, 4)
           + [f"hydra.run.dir={run}", f"comm.shard={shard}", "report.tensorboard=false"],
           timeout=1800, env=one_thread_env())
    return json.loads((run / "summary.json").read_text())["ranks"]


def budget_setups(ranks: list, stages: list) -> list:
    """(ranks, stages, comm.shard): one rank's whole state first (the baseline), then per rank
    count every S dividing it, whole and (with more than one replica a stage) sharded."""
    setups = [(1, 1, "none")]
    for n in ranks:
        for S in stages:
            if n % S == 0:
                setups += [(n, S, shard) for shard in SHARDS if shard == "none" or n // S > 1]
    return list(dict.fromkeys(setups))


def budget_rows(tmp: Path, data: Path, args, vocab: int) -> list:
    budget = args.budget_mib * 2**20
    calib = lm_job(tmp / "calib", 1, 1, 1, data, args, "none")[0]
    params = largest_stage_params(1, args.budget_d_model, args.seq, vocab, 1)
    p_bytes, o_bytes = calib["param_bytes"] / params, calib["optimizer_bytes"] / params
    rows = []
    for n, S, shard in budget_setups(args.ranks, args.budget_stages):
        replicas = n // S
        per_param = p_bytes + (o_bytes / replicas if shard == "optimizer" else o_bytes)
        L, ranks = deepest_within(
            budget, lambda L, S=S: largest_stage_params(L, args.budget_d_model, args.seq, vocab, S) * per_param,
            lambda L, n=n, S=S, shard=shard: lm_job(tmp / f"budget_{n}_{S}_{shard}_{L}", n, S, L, data, args, shard))
        total = largest_stage_params(L, args.budget_d_model, args.seq, vocab, 1)
        r0 = ranks[0]
        rows.append([n, S, replicas, shard, L, round(total / 1e6, 2), None, round(held_bytes(ranks) / 2**20, 1),
                     round(max(r["param_bytes"] for r in ranks) / 2**20, 1),
                     round(max(r["optimizer_bytes"] for r in ranks) / 2**20, 1),
                     f"{r0.get('first_loss', float('nan')):.3f} -> {r0.get('last_loss', float('nan')):.3f}"])
        print(f"  {n} ranks, S={S}, comm.shard={shard}: {L} layers, {total / 1e6:.2f} M parameters, "
              f"{held_bytes(ranks) / 2**20:.1f} MiB held on a rank", flush=True)
    for r in rows:
        r[6] = f"{r[5] / rows[0][5]:.2f}x"
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
    ap.add_argument("--step-extra", nargs="*", default=[],
                    help="overrides for both sides of the step-time part (comm.shared_memory=false: the "
                         "unsharded side on MPI's Allreduce instead of the node's shared-memory sum)")
    ap.add_argument("--links", nargs="*", default=[],
                    help="also the step time across 2 emulated nodes at these link rates (tc's: 10gbit, "
                         "1gbit; 'unlimited'); needs root")
    ap.add_argument("--collectives", action="store_true",
                    help="also the step's collectives alone, on the step part's payload: Allreduce against "
                         "the sharded path's reduce-scatter and allgather (and MPI's Reduce_scatter, Allgather)")
    ap.add_argument("--collective-repeats", type=int, default=30)
    ap.add_argument("--budget-mib", type=float, default=32.0)
    ap.add_argument("--budget-d-model", type=int, default=128)
    ap.add_argument("--budget-stages", type=int, nargs="+", default=[1],
                    help="pipeline stages of the budget part (S dividing the ranks)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--skip", nargs="*", default=[], choices=["step", "memory", "budget"])
    args = ap.parse_args()
    print(machine_note())
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = prepare_synthetic(tmp / "syn.h5", args.rows, 256)
        step, coll = [], []
        if "step" not in args.skip:
            print("\nstep time, loopback", flush=True)
            step += step_rows(tmp, data, args)
        if args.collectives:
            coll += collective_rows(args, "loopback", loopback)
        if args.links:
            with emulated_nodes(2, tmp / "cluster") as cluster:
                for link in args.links:
                    cluster.limit_bandwidth(None if link == "unlimited" else link)
                    if "step" not in args.skip:
                        print(f"\nstep time, 2 emulated nodes at {link}", flush=True)
                        step += step_rows(tmp, data, args, f"2 nodes {link}", on_nodes(cluster))
                    if args.collectives:
                        coll += collective_rows(args, f"2 nodes {link}", on_nodes(cluster))
                    print(f"  ({machine_note()})", flush=True)
                cluster.limit_bandwidth(None)
        if step:
            print("\nstep time (median over repeats; ratio = median of sharded / unsharded per repeat)")
            print(fmt_table(STEP_HEADERS, step))
        if coll:
            print(f"\nthe step's collectives alone (median of {args.collective_repeats}, slowest rank)")
            print(fmt_table(COLLECTIVE_HEADERS, coll))
        if "memory" not in args.skip:
            print("\nmemory on this node: sums over its ranks (MiB)")
            print(fmt_table(["ranks", "setup", "param+optimizer", "optimizer", "peak RSS", "job's cgroup peak"],
                            memory_rows(tmp, data, args)))
        if "budget" not in args.skip:
            vocab = 512
            tokens = write_tokens(tmp / "tokens.h5", 2048, args.seq, vocab, counting=True)
            print(f"\nlargest transformer LM (d_model {args.budget_d_model}) within {args.budget_mib:g} MiB of "
                  f"parameters + optimizer state per rank", flush=True)
            rows = budget_rows(tmp, tokens, args, vocab)
            print(fmt_table(["ranks", "stages", "replicas", "comm.shard", "layers", "M params", "x 1 rank",
                             "max held MiB/rank", "param MiB", "optim MiB", "loss first -> last"], rows))
    print(machine_note())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--collective-child":
        collective_child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
