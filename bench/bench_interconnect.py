"""Across 2 emulated nodes (network namespaces, tests/support/netns_cluster.py; needs root): how the link
speed moves training throughput, for hpc_rlx's sync, cadence and async policies and PyTorch DDP
(gloo) on the same model, data and link.

    .venv/bin/python bench/bench_interconnect.py                       # unlimited, 10gbit, 1gbit
    .venv/bin/python bench/bench_interconnect.py --links 1gbit --repeats 2
    .venv/bin/python bench/bench_interconnect.py --links 10gbit,1gbit --methods sync,overlap,ddp \
        --repeats 3 --trace-dir /tmp/traces      # comm.overlap off vs on vs DDP, plus a trace

Methods: `sync`, `cadence`, `async` (hpc_rlx policies), `overlap` (`policy=sync comm.overlap=true
comm.overlap_chunk_mb=--chunk-mb`), `overlap-notest` (the same without the MPI Test calls
between layers: bench_overlap.py's switch), `overlap-progress` (the same with MPICH's own
progress thread, `MPIR_CVAR_ASYNC_PROGRESS=1`), `ddp`; `overlap@4` (any overlap method with
`@MiB`) sets that method's chunk size, so several sizes can alternate in one run. Every repeat runs each method once,
the order reversed every other repeat; the best repeat of each is reported. `--trace-dir`
adds one untimed `overlap` run per link with `trace.enabled=true` and keeps its trace.json.

One rank per node, node k pinned to core k (so the two ranks do not share a core), one BLAS
thread per rank on both sides. MLP 784-1024-1024-10 (1.86 M parameters: a 7.4 MB float32
gradient per step), batch 128 per rank, SGD. The link is `tc tbf` on each node's interface.

Figures: samples/s over the epochs after the first (hpc_rlx: its `samples_per_s` weighted by
`epoch_s`, the epoch's training wall; DDP: rank 0's summed step wall time), and the comm share,
the part of the wall time spent communicating: for hpc_rlx `comm_s / epoch_s` (every policy);
for DDP, 1 - (time of a step under
`no_sync()`) / (time of a synchronised step), both measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (PYTHON, REPO, emulated_nodes, fmt_table, machine_note,  # noqa: E402
                     mpiexec_on_nodes, one_thread_env, prepare_synthetic, result_line)
from bench_ddp import CLASSES, FEATURES, HIDDEN, LR, MOMENTUM, PER_RANK_BATCH, torch_mlp_and_shard  # noqa: E402


OVERLAP = ("overlap", "overlap-notest", "overlap-progress")


def run_hpc(cluster, method: str, data: Path, epochs: int, work: Path, chunk_mb: float = 1.0,
            keep_trace: Path | None = None) -> dict:
    policy, extra, env = method, [], one_thread_env()
    head = ["-m", "hpc_rlx"]
    if "@" in method:                   # overlap@4: that method with 4 MiB chunks
        method, chunk_mb = method.split("@")[0], float(method.split("@")[1])
    run_dir = work / f"hpc_{method}_{time.monotonic_ns()}"
    if method in OVERLAP:
        policy, extra = "sync", ["comm.overlap=true", f"comm.overlap_chunk_mb={chunk_mb}"]
    if method == "overlap-notest":
        head = [str(Path(__file__).with_name("bench_overlap.py")), "--rank-without-test"]
    if method == "overlap-progress":
        env = dict(env, MPIR_CVAR_ASYNC_PROGRESS="1")
    if keep_trace is not None:
        extra.append("trace.enabled=true")
    args = head + [f"hydra.run.dir={run_dir}", "data=synthetic", f"data.path={data}",
            "data.val_fraction=0", "model=mlp", f"model.hidden=[{','.join(map(str, HIDDEN))}]",
            f"train.batch_size={PER_RANK_BATCH * 2}", f"train.epochs={epochs}", "train.threads_per_rank=1",
            "optim=sgd", f"optim.lr={LR}", f"optim.momentum={MOMENTUM}", "optim.schedule=constant",
            f"policy={policy}", "checkpoint=off", "report.plots=false", "report.tensorboard=false",
            "train.log_every_s=1000", "train.progress=lines"] + extra
    mpiexec_on_nodes(cluster, {"node1": 1, "node2": 1}, args, timeout=1200, env=env)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if x.strip() and "event" not in json.loads(x)][1:]
    # epoch_s is the epoch's training wall (every policy); "steps" would count syncs under
    # cadence/async, so the samples come from samples_per_s x epoch_s
    wall = sum(r["epoch_s"] for r in recs)
    out = {"samples_per_s": sum(r["samples_per_s"] * r["epoch_s"] for r in recs) / wall,
           "comm_share": sum(r["comm_s"] for r in recs) / wall}
    if keep_trace is not None:
        keep_trace.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / "trace.json", keep_trace)
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def ddp_worker(rank: int, world: int, addr: str, port: int, data: str, epochs: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    module, x, y, steps, per_rank = torch_mlp_and_shard(rank, world, data)
    model = DDP(module)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    lossf = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + rank)

    def step(idx, sync: bool) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if sync:
            lossf(model(x[idx]), y[idx]).backward()
        else:
            with model.no_sync():
                lossf(model(x[idx]), y[idx]).backward()
        opt.step()
        return time.perf_counter() - t0

    synced, local = 0.0, 0.0
    for ep in range(epochs):
        perm = torch.randperm(per_rank, generator=gen)
        wall = sum(step(perm[s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH], True) for s in range(steps))
        if ep > 0:
            synced += wall
    # the same steps without the allreduce: what the step costs when nothing crosses the link
    perm = torch.randperm(per_rank, generator=gen)
    local = sum(step(perm[s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH], False) for s in range(steps))
    dist.barrier()
    if rank == 0:
        timed = (epochs - 1) * steps
        print("RESULT " + json.dumps({"samples_per_s": timed * PER_RANK_BATCH * world / synced,
                                      "step_ms": 1e3 * synced / timed,
                                      "comm_share": max(0.0, 1 - (local / steps) / (synced / timed))}))
    dist.destroy_process_group()


def run_ddp(cluster, data: Path, epochs: int, port: int) -> dict:
    import subprocess

    addr = cluster.addr["node1"]
    procs = [cluster.popen_on(node, [PYTHON, __file__, "--ddp-worker", str(r), "2", addr, str(port), str(data),
                                     str(epochs)], env=one_thread_env(), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, node in enumerate(("node1", "node2"))]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=1200))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit("DDP timed out")
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"DDP worker failed (rc={p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    return result_line(outs[0][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", default="unlimited,10gbit,1gbit")
    ap.add_argument("--steps", type=int, default=40, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is warm-up, not timed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default="sync,cadence,async,ddp", help="see the module docstring")
    ap.add_argument("--chunk-mb", type=float, default=1.0, help="comm.overlap_chunk_mb of the overlap methods")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="also one traced overlap run per link: DIR/trace_LINK.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpc_rlx_bench_link_"))
    data = prepare_synthetic(work / "syn.h5", PER_RANK_BATCH * 2 * args.steps, FEATURES, CLASSES)
    print(f"# {machine_note()}")
    print(f"# 2 emulated nodes x 1 rank, MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}, batch "
          f"{PER_RANK_BATCH}/rank, {args.steps} steps/epoch, {args.epochs} epochs (first untimed), "
          f"best of {args.repeats}")
    sides = tuple(args.methods.split(","))
    rows = []
    with emulated_nodes(2, work / "cluster") as cluster:
        for link in args.links.split(","):
            cluster.limit_bandwidth(None if link == "unlimited" else link)
            best: dict = {}
            for rep in range(args.repeats):
                for side in (sides if rep % 2 == 0 else tuple(reversed(sides))):
                    r = (run_ddp(cluster, data, args.epochs, 29500 + rep) if side == "ddp"
                         else run_hpc(cluster, side, data, args.epochs, work, args.chunk_mb))
                    print(f"  {link} {side}: {r['samples_per_s']:,.0f} samples/s, comm share "
                          f"{100 * r['comm_share']:.0f}%", flush=True)
                    if side not in best or r["samples_per_s"] > best[side]["samples_per_s"]:
                        best[side] = r
            if args.trace_dir is not None:
                r = run_hpc(cluster, "overlap", data, args.epochs, work, args.chunk_mb,
                            keep_trace=args.trace_dir / f"trace_{link}.json")
                print(f"  {link} overlap, traced (untimed): {r['samples_per_s']:,.0f} samples/s", flush=True)
            ddp = best["ddp"]["samples_per_s"] if "ddp" in best else float("nan")
            sync = best["sync"]["samples_per_s"] if "sync" in best else float("nan")
            for side in sides:
                r = best[side]
                rows.append([link, side, r["samples_per_s"], f"{100 * r['comm_share']:.0f}%",
                             f"{r['samples_per_s'] / ddp:.2f}x", f"{r['samples_per_s'] / sync:.2f}x"])
        cluster.limit_bandwidth(None)
    print()
    print(fmt_table(["link", "method", "samples/s", "comm share", "vs DDP", "vs sync"], rows))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        r, w, addr, port, data, epochs = sys.argv[2:8]
        ddp_worker(int(r), int(w), addr, int(port), data, int(epochs))
    else:
        main()
