"""End to end: hpc_rlx under mpirun vs PyTorch DDP (gloo), same MLP, same data, same steps.

    .venv/bin/python bench/bench_ddp.py                      # 1/2/4 ranks, a few minutes
    .venv/bin/python bench/bench_ddp.py --ranks 1,2 --repeats 3 --steps 40

Model 784-1024-1024-10 (ReLU), float32, SGD (lr 0.01, momentum 0.9), batch 128 per rank (so
hpc_rlx's global train.batch_size is 128 x n), one BLAS thread per rank on both sides
(hpc_rlx: train.threads_per_rank=1; torch: torch.set_num_threads(1)). Both sides train on the
same synthetic HDF5 file (python -m hpc_rlx.data prepare synthetic), each rank on its own
contiguous shard, reshuffled every epoch, for the same number of steps.

Timing, the same on both sides: rank 0's wall time of each step (batch gather from memory,
forward, backward, gradient allreduce, optimizer step) over the epochs after the first
(warm-up). Two throughputs come from it:
  mean  global samples / summed step time: for hpc_rlx exactly its own metric
        (`samples_per_s` in metrics.jsonl);
  p25   global batch / the 25th percentile of the step times: on a shared machine, steps
        during which another job held a core are slow, and this figure mostly leaves them out.
hpc_rlx's per-step times come from its trace (trace.enabled=true, about 1 us per event, a few
events per step). DDP runs with its defaults (25 MB buckets, allreduce overlapped with
backward). The two sides alternate within every repeat, so background load hits both alike;
the best repeat is reported (as timeit does).

At one rank a third side runs: the plain PyTorch loop (one process, no process group, no DDP
wrapper), the baseline the one-rank ratio is quoted against; DDP at world size 1 still copies
its gradient buckets through gloo every step.

Scaling efficiency = throughput at n / (n x throughput at 1). More ranks than cores means
the ranks share cores: efficiency then measures the machine, not the library.

`--overlap` adds a third side at n > 1: hpc_rlx with `comm.overlap=true` (its efficiency
against the 1-rank hpc_rlx figure); `--mpi-sum` one with `comm.shared_memory=false` (MPI's
Allreduce instead of the node's shared memory); `--mkl` one with `device.cpu_blas=mkl` (the CPU
lanes' matrix products on Intel MKL, as PyTorch's are), at every n. `--engine` adds, in every repeat, the bare engine step of
bench_engine.py (forward, backward and a plain SGD update on a fixed batch, in this process,
one BLAS thread) and prints the 1-rank full path's step time over it. `--ceiling` measures, in
every repeat, what this machine allows any data-parallel library at n ranks: the same bare
engine step run by n independent processes at once (no communication, no data), each one's
step time against one process alone, in time slots that alternate between the two. Two GEMM-bound processes share the machine's memory
bandwidth and caches (and, on a VM, maybe a physical core), so this efficiency is the ceiling
for the scaling efficiency columns; the table prints each side's efficiency over it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (PYTHON, REPO, fmt_table, free_port, hpc_throughput, machine_note,  # noqa: E402
                     median, mpirun, one_thread_env, p25_step_samples_per_s, percentile, prepare_synthetic,
                     result_line, timed_torch_epochs)

HIDDEN = [1024, 1024]
FEATURES, CLASSES, PER_RANK_BATCH = 784, 10, 128
LR, MOMENTUM = 0.01, 0.9


# ---- hpc_rlx side ---------------------------------------------------------------------------

def run_hpc(n: int, data: Path, epochs: int, workdir: Path, extra: list[str] = ()) -> dict:
    run_dir = workdir / f"hpc_n{n}_{time.monotonic_ns()}"
    args = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=synthetic", f"data.path={data}",
            "data.val_fraction=0", "model=mlp", f"model.hidden=[{','.join(map(str, HIDDEN))}]",
            f"train.batch_size={PER_RANK_BATCH * n}", f"train.epochs={epochs}", "train.threads_per_rank=1",
            "optim=sgd", f"optim.lr={LR}", f"optim.momentum={MOMENTUM}", "optim.schedule=constant",
            "checkpoint=off", "report.plots=false", "train.log_every_s=1000"] + list(extra)
    mpirun(n, args + ["trace.enabled=true"], timeout=900, env=one_thread_env())
    out = hpc_throughput(run_dir, PER_RANK_BATCH * n, skip_epochs=1)
    out["p25_samples_per_s"] = p25_step_samples_per_s(run_dir, PER_RANK_BATCH * n)
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def engine_step_ms(steps: int = 24) -> float:
    """bench_engine.py's bare MLP step (its engine contender), best of 3 runs of ``steps``."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from bench_engine import engine_step_fn
    from hpc_rlx.graph import build_model

    rng = np.random.default_rng(1)
    x = rng.standard_normal((PER_RANK_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, PER_RANK_BATCH)
    g = build_model("mlp", input_shape=(FEATURES,), num_classes=CLASSES, hidden=HIDDEN, activation="relu")
    step = engine_step_fn(g, {"x": x, "y": y})
    best = float("inf")
    with threadpool_limits(limits=1):
        for i in range(3):
            step(i)
        for r in range(3):
            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            best = min(best, (time.perf_counter() - t0) / steps)
    return 1e3 * best


def ceiling_efficiency(n: int, pairs: int = 8, slot_s: float = 1.5, timeout: float = 300) -> tuple[float, float, float]:
    """The machine's ceiling at ``n`` ranks: ``n`` processes run the bare engine step in time
    slots that alternate between one process alone and all ``n`` at once, so that the host's
    drifting speed hits both sides alike. Returns (median over slot pairs of alone / together,
    median step ms alone, median step ms together)."""
    start_at = time.time() + 5.0                          # after every process has imported
    outs = run_workers([["--engine-worker", str(i), str(2 * pairs), repr(slot_s), repr(start_at)]
                        for i in range(n)], timeout, f"{n} engine workers")
    slots = [result_line(out)["slot_ms"] for out in outs]         # per worker: ms per slot or None
    alone = [slots[0][k] for k in range(0, 2 * pairs, 2)]
    together = [median([w[k] for w in slots]) for k in range(1, 2 * pairs, 2)]
    return median([a / t for a, t in zip(alone, together)]), median(alone), median(together)


def engine_worker(index: int, nslots: int, slot_s: float, start_at: float) -> list[float | None]:
    """One process of `ceiling_efficiency`: in even slots only worker 0 steps, in odd slots all
    do; returns the mean step time (ms) of each slot it stepped in (None where it slept)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from bench_engine import engine_step_fn
    from hpc_rlx.graph import build_model

    rng = np.random.default_rng(1)
    x = rng.standard_normal((PER_RANK_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, PER_RANK_BATCH)
    g = build_model("mlp", input_shape=(FEATURES,), num_classes=CLASSES, hidden=HIDDEN, activation="relu")
    step = engine_step_fn(g, {"x": x, "y": y})
    out: list[float | None] = []
    with threadpool_limits(limits=1):
        for i in range(3):
            step(i)
        for k in range(nslots):
            lo, hi = start_at + k * slot_s, start_at + (k + 1) * slot_s
            time.sleep(max(0.0, lo - time.time()))
            if k % 2 == 0 and index > 0:
                out.append(None)
                continue
            # step while the slot lasts, leaving a margin so the slots never overlap
            t0, done = time.perf_counter(), 0
            while time.time() < hi - 0.15 * slot_s:
                step(done)
                done += 1
            out.append(1e3 * (time.perf_counter() - t0) / max(done, 1))
    return out


# ---- PyTorch DDP side -------------------------------------------------------------------------

def torch_mlp_and_shard(rank: int, world: int, data: str):
    """The benchmark's MLP in PyTorch (seeded) and this rank's contiguous shard of `data`, like
    data.distribution=read: (module, x, y, steps per epoch, rows per rank)."""
    import h5py
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    with h5py.File(data, "r", locking=False) as f:
        steps = f["x"].shape[0] // (PER_RANK_BATCH * world)
        per_rank = steps * PER_RANK_BATCH
        lo = rank * per_rank
        x = torch.from_numpy(np.ascontiguousarray(f["x"][lo: lo + per_rank]))
        y = torch.from_numpy(np.ascontiguousarray(f["y"][lo: lo + per_rank]))
    torch.manual_seed(0)
    layers, width = [], FEATURES
    for h in HIDDEN:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, CLASSES))
    return torch.nn.Sequential(*layers), x, y, steps, per_rank


def ddp_worker(rank: int, world: int, port: int, data: str, epochs: int) -> None:
    """One DDP process; ``port`` 0: the plain loop instead (one process, no process group, no
    DDP wrapper), the issue's one-rank baseline. DDP at world size 1 still copies its buckets
    through gloo every step, which a plain loop does not."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = port == 0
    if not plain:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    module, x, y, steps, per_rank = torch_mlp_and_shard(rank, world, data)
    batch_global = PER_RANK_BATCH * world
    model = module if plain else DDP(module)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    lossf = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + rank)
    walls, step_times, loss = timed_torch_epochs(model, opt, lossf, x, y, PER_RANK_BATCH, steps, epochs,
                                                 per_rank, gen)
    if not plain:
        dist.barrier()
    if rank == 0:
        use = walls[1:] or walls
        step_times.sort()
        print("RESULT " + json.dumps({"samples_per_s": len(use) * steps * batch_global / sum(use),
                                      "p25_samples_per_s": batch_global / percentile(step_times or [1.0], 25),
                                      "steps": len(use) * steps, "step_ms": 1e3 * sum(use) / (len(use) * steps),
                                      "loss": float(loss)}))
    if not plain:
        dist.destroy_process_group()


def run_workers(worker_args: list[list[str]], timeout: float, what: str) -> list[str]:
    """Run this script once per entry of ``worker_args``, all at once, one BLAS thread each;
    their standard outputs, or the benchmark stops with the failure."""
    procs = [subprocess.Popen([PYTHON, __file__, *args], env=one_thread_env(), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in worker_args]
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"{what} timed out after {timeout}s")
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"{what}: a process failed (rc={p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    return [out for out, _ in outs]


def run_ddp(n: int, data: Path, epochs: int, timeout: float = 900, plain: bool = False) -> dict:
    port = 0 if plain else free_port()
    outs = run_workers([["--ddp-worker", str(r), str(n), str(port), str(data), str(epochs)] for r in range(n)],
                       timeout, f"DDP with {n} processes")
    return result_line(outs[0])


# ---- main -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=24,
                    help="steps per epoch at the largest rank count (smaller counts take proportionally more)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is warm-up, not timed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the data and runs go (default: a temp dir, removed)")
    ap.add_argument("--overlap", action="store_true", help="also hpc_rlx with comm.overlap=true at n > 1")
    ap.add_argument("--mpi-sum", action="store_true",
                    help="also hpc_rlx with comm.shared_memory=false (MPI's Allreduce) at n > 1")
    ap.add_argument("--mkl", action="store_true",
                    help="also hpc_rlx with device.cpu_blas=mkl (MKL's GEMMs; needs pip install mkl), at every n")
    ap.add_argument("--engine", action="store_true", help="also the bare engine step (bench_engine.py)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also the machine's ceiling: n bare engine steps at once, no communication")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hpc_rlx_bench_ddp_"))
    work.mkdir(parents=True, exist_ok=True)
    samples = PER_RANK_BATCH * max(ranks) * args.steps
    data = prepare_synthetic(work / f"syn_{samples}.h5", samples, FEATURES, CLASSES)
    print(f"# {machine_note()}")
    print(f"# MLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}, batch {PER_RANK_BATCH}/rank, "
          f"{samples} samples, {args.epochs} epochs (first untimed), {args.repeats} repeat(s)")
    extra_sides = {"overlap": ["comm.overlap=true"], "mpi-sum": ["comm.shared_memory=false"],
                   "mkl": ["device.cpu_blas=mkl"]}
    wanted = [s for s, on in (("overlap", args.overlap), ("mpi-sum", args.mpi_sum), ("mkl", args.mkl)) if on]
    at_one_rank = [s for s in wanted if s == "mkl"]      # the others change only the collective
    results: dict[int, dict[str, list]] = {n: {"hpc": [], "ddp": [], "torch": [], **{s: [] for s in extra_sides}}
                                           for n in ranks}
    engine_ms: list[float] = []
    ceiling: dict[int, list[float]] = {n: [] for n in ranks if n > 1} if args.ceiling else {}
    for rep in range(args.repeats):
        for n in ceiling:
            eff, alone, together = ceiling_efficiency(n)
            ceiling[n].append(eff)
            print(f"  repeat {rep + 1} bare engine step alone {alone:.2f} ms, {n} at once {together:.2f} ms "
                  f"each (medians over alternating slots): ceiling efficiency {eff:.3f}", flush=True)
        if args.engine:
            engine_ms.append(engine_step_ms())
            print(f"  repeat {rep + 1} bare engine step: {engine_ms[-1]:.2f} ms", flush=True)
        for n in ranks:
            # one rank: also the plain PyTorch loop, the baseline the one-rank figure is quoted against
            sides = ("hpc", *wanted, "ddp") if n > 1 else ("hpc", *at_one_rank, "torch", "ddp")
            for side in (sides if rep % 2 == 0 else tuple(reversed(sides))):
                r = (run_ddp(n, data, args.epochs) if side == "ddp"
                     else run_ddp(n, data, args.epochs, plain=True) if side == "torch"
                     else run_hpc(n, data, args.epochs, work, extra_sides.get(side, [])))
                results[n][side].append(r)
                print(f"  repeat {rep + 1} n={n} {side}: {r['samples_per_s']:,.0f} samples/s mean, "
                      f"{r['p25_samples_per_s']:,.0f} p25 ({r['step_ms']:.1f} ms/step)", flush=True)

    base = ranks[0] if ranks[0] == 1 else None
    for key, title in (("samples_per_s", "mean step time (hpc_rlx's samples_per_s)"),
                       ("p25_samples_per_s", "25th-percentile step time (robust to other jobs)")):
        best = {n: {s: max(v[key] for v in results[n][s]) for s in ("hpc", "ddp")} for n in ranks}
        rows = []
        for n in ranks:
            h, d = best[n]["hpc"], best[n]["ddp"]
            eff_h = h / (n * best[base]["hpc"]) if base else None
            eff_d = d / (n * best[base]["ddp"]) if base else None
            comm = median([v["comm_frac"] for v in results[n]["hpc"]])
            rows.append([n, h, d, f"{h / d:.2f}x", eff_h, eff_d, f"{100 * comm:.0f}%"])
        print(f"\nsamples/s from the {title}, best of {args.repeats}:")
        print(fmt_table(["ranks", "hpc_rlx", "DDP-gloo", "hpc_rlx/DDP", "eff hpc_rlx", "eff DDP",
                         "hpc_rlx comm share"], rows))
        for side in wanted:
            other = [(n, max(v[key] for v in results[n][side])) for n in ranks if results[n][side]]
            # efficiency against the side's own one-rank figure where it ran at one rank
            one = dict(other).get(1) or (best[base]["hpc"] if base else None)
            if other:
                print(fmt_table(["ranks", f"hpc_rlx {side}", "/DDP", "/hpc_rlx default", "eff"],
                                [[n, o, f"{o / best[n]['ddp']:.2f}x", f"{o / best[n]['hpc']:.3f}x",
                                  o / (n * one) if one else None] for n, o in other]))
    if 1 in ranks:
        rows = []
        for key in ("samples_per_s", "p25_samples_per_s"):
            torch_best = max(v[key] for v in results[1]["torch"])
            for side in ("hpc", *at_one_rank, "ddp"):
                best_side = max(v[key] for v in results[1][side])
                rows.append([key.replace("_samples_per_s", "").replace("samples_per_s", "mean"),
                             {"hpc": "hpc_rlx", "ddp": "DDP-gloo, 1 process"}.get(side, f"hpc_rlx {side}"),
                             best_side, torch_best, f"{best_side / torch_best:.2f}x"])
        print(f"\n1 rank against a plain PyTorch loop (no process group, no DDP), best of {args.repeats}:")
        print(fmt_table(["step time", "side", "samples/s", "PyTorch loop", "side/PyTorch"], rows))
    if ceiling and base:
        rows = []
        one = {s: max(v["samples_per_s"] for v in results[base][s]) for s in ("hpc", "ddp")}
        for n, effs in ceiling.items():
            top = median(effs)
            h = max(v["samples_per_s"] for v in results[n]["hpc"]) / (n * one["hpc"])
            d = max(v["samples_per_s"] for v in results[n]["ddp"]) / (n * one["ddp"])
            rows.append([n, top, h, f"{h / top:.2f}", d, f"{d / top:.2f}"])
        print(f"\nthe machine's ceiling (n bare engine steps at once, median of {args.repeats}) against the "
              "best mean-step efficiencies:")
        print(fmt_table(["ranks", "ceiling eff", "eff hpc_rlx", "of ceiling", "eff DDP", "of ceiling"], rows))
    if engine_ms and 1 in ranks:
        full = min(v["step_ms"] for v in results[1]["hpc"])
        print(f"\n1-rank full path step {full:.2f} ms (best repeat) / bare engine step {min(engine_ms):.2f} ms "
              f"(best; repeats {', '.join(f'{e:.2f}' for e in engine_ms)}) = {full / min(engine_ms):.2f}x")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        r, w, port, data, epochs = sys.argv[2:7]
        ddp_worker(int(r), int(w), int(port), data, int(epochs))
    elif len(sys.argv) > 1 and sys.argv[1] == "--engine-worker":
        slot_ms = engine_worker(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
        print("RESULT " + json.dumps({"slot_ms": slot_ms}))
    else:
        main()
