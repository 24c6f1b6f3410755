"""Streaming DiLoCo against `sync`: fragments, delay and the coded outer wire (`policy.fragments`,
`policy.fragment_delay`, `policy.outer_wire_dtype`) on the transformer LM (`experiment=lm`).

    .venv/bin/python bench/bench_streaming.py                        # 2 ranks on this host
    .venv/bin/python bench/bench_streaming.py --ranks 2 4 --epochs 4
    .venv/bin/python bench/bench_streaming.py --link 100mbit         # 2 emulated nodes (root)

Every row is one real job (global batch 32, seed 3, one BLAS thread a process): `mpirun` on this
host with `comm.shared_memory=false` (so that sync's bytes are MPI's Allreduce, not the node's
memory), or with `--link RATE[:DELAY_MS]` MPICH's `mpiexec` across 2 emulated nodes, one rank
each, joined by a link shaped with `tc tbf` at that rate, or with a delay `tc netem` (rate and
one-way delay; a kernel without the netem qdisc, as this machine's, refuses it). Columns:

- syncs/ep: synchronisations in the last epoch (sync: one per step; streaming: one per fragment);
- wire_MB: bytes every rank sent over the whole run (`wire_bytes` in metrics.jsonl, summed over
  ranks and epochs; MPI's own Allreduce is computed from its ring volume, not counted);
- fewer: sync's bytes over the row's (the goal: >= 100x);
- val_loss, vs_sync: validation loss after the last epoch, and over sync's (goals: <= 1.01 at 2
  ranks, <= 1.02 at 4); every row sees the same samples;
- to_sync_s: seconds of training (the epochs' `epoch_s`, validation left out) until the row's
  validation loss first reached sync's final one, '-' if never; vs_sync_t: over sync's total
  (the goal on the slow link: <= 0.33).

Not a test. The rows (`--rows`):
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import emulated_nodes, fmt_table, machine_note, mpiexec_on_nodes, mpirun, one_thread_env
from hpc_rlx.data.prepare import ensure_prepared  # noqa: E402  (_common puts the repo on the path)

K = 25                 # local steps per sync (--k)
WINDOWED = ["policy=async", "policy.tune=false", "policy.outer=diloco"]
ROWS = {
    "sync": ["policy=sync"],
    "diloco": WINDOWED,
    "stream": WINDOWED + ["policy.fragments=5", "policy.fragment_delay=1"],
    "stream-int8": WINDOWED + ["policy.fragments=5", "policy.fragment_delay=1", "policy.outer_wire_dtype=int8"],
    "stream-int4": WINDOWED + ["policy.fragments=5", "policy.fragment_delay=1", "policy.outer_wire_dtype=int4"],
    "diloco-int4": WINDOWED + ["policy.outer_wire_dtype=int4"],
}
LABELS = {
    "sync": "policy=sync",
    "diloco": "DiLoCo K={k}, float32",
    "stream": "Streaming K={k} F=5 tau=1, float32",
    "stream-int8": "Streaming K={k} F=5 tau=1, int8",
    "stream-int4": "Streaming K={k} F=5 tau=1, int4",
    "diloco-int4": "DiLoCo K={k}, int4",
}
__doc__ += "".join(f"\n- {name}: {LABELS[name].format(k='K')}" for name in ROWS) + "\n"


def run_row(launch, ranks: int, name: str, data: str, args, workdir: Path) -> dict:
    run_dir = workdir / f"{name}-n{ranks}"
    job = ["-m", "hpc_rlx", "experiment=lm", f"hydra.run.dir={run_dir}", "report.plots=false",
           "checkpoint=off", f"data.path={data}", f"train.epochs={args.epochs}",
           f"train.seed={args.seed}", "comm.shared_memory=false"] + ROWS[name] + args.extra
    if name != "sync":
        job.append(f"policy.anchor={args.k}")
    t0 = time.perf_counter()
    launch(ranks, job)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "event" not in r]
    return {"syncs": recs[-1].get("syncs", recs[-1]["steps"]), "val_loss": recs[-1]["val_loss"],
            "curve": [(r["epoch_s"], r["val_loss"]) for r in recs],
            "wire": sum(int(r.get("wire_bytes") or 0) for r in recs), "wall_s": wall}


def time_to(curve, target: float) -> float | None:
    """Training seconds until the validation loss first reached `target` (linear within the
    epoch that crossed it: the loss is only known at epoch ends)."""
    spent, before = 0.0, None
    for seconds, loss in curve:
        if loss <= target:
            if before is None or before <= loss:
                return spent + seconds
            return spent + seconds * (before - target) / (before - loss)
        spent += seconds
        before = loss
    return None


def table(rows: list[str], cells: dict, k: int) -> str:
    ref = cells["sync"]
    out = []
    for name in rows:
        c = cells[name]
        reach = time_to(c["curve"], ref["val_loss"])
        total = sum(s for s, _ in ref["curve"])
        out.append([LABELS[name].format(k=k), c["syncs"], f"{c['wire'] / 2**20:.2f}",
                    f"{ref['wire'] / max(c['wire'], 1):.0f}x", f"{c['val_loss']:.4f}",
                    f"{c['val_loss'] / ref['val_loss']:.4f}", "-" if reach is None else f"{reach:.1f}",
                    "-" if reach is None else f"{reach / total:.2f}", f"{c['wall_s']:.0f}"])
    return fmt_table(["run", "syncs/ep", "wire_MB", "fewer", "val_loss", "vs_sync", "to_sync_s",
                      "vs_sync_t", "wall_s"], out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes (this host)")
    ap.add_argument("--link", default=None, help="RATE[:DELAY_MS]: 2 emulated nodes joined by a link "
                                                  "of that rate (and delay) instead of this host (root)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--k", type=int, default=K, help="local steps per sync of every windowed row")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every row")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    args = ap.parse_args()
    rows = args.rows if "sync" in args.rows else ["sync"] + args.rows
    print(f"# {machine_note()}")
    with tempfile.TemporaryDirectory(prefix="bench_streaming_") as tmp:
        workdir = Path(tmp)
        data = str(workdir / "text.h5")
        ensure_prepared(data, "text")
        if args.link:
            rate, _, delay = args.link.partition(":")
            delay = delay or "0"
            with emulated_nodes(2, workdir / "cluster") as cluster:
                cluster.limit_bandwidth(rate, float(delay))

                def launch(n, job):
                    return mpiexec_on_nodes(cluster, {"node1": 1, "node2": 1}, job, timeout=args.timeout)
                print(f"\n# 2 emulated nodes, 1 rank each, link {rate} with {delay} ms added delay, "
                      f"experiment=lm train.epochs={args.epochs} train.seed={args.seed}", flush=True)
                cells = {name: run_row(launch, 2, name, data, args, workdir) for name in rows}
                print(table(rows, cells, args.k), flush=True)
            return
        for ranks in args.ranks:
            def launch(n, job):
                return mpirun(n, job, timeout=args.timeout, env=one_thread_env())
            print(f"\n# mpirun -n {ranks} on this host, experiment=lm train.epochs={args.epochs} "
                  f"train.seed={args.seed}", flush=True)
            cells = {}
            for name in rows:
                cells[name] = run_row(launch, ranks, name, data, args, workdir)
                print(f"  {name}: val_loss {cells[name]['val_loss']:.4f} wire {cells[name]['wire']} "
                      f"wall {cells[name]['wall_s']:.0f}s", flush=True)
            print(table(rows, cells, args.k), flush=True)


if __name__ == "__main__":
    main()
