"""Streaming DiLoCo against `sync`: fragments, delay and the coded outer wire (`policy.fragments`,
`policy.fragment_delay`, `policy.outer_wire_dtype`) on the transformer LM (`experiment=lm`).

    .venv/bin/python bench/bench_streaming.py                        # 2 ranks on this host
    .venv/bin/python bench/bench_streaming.py --ranks 2 4 --epochs 4
    .venv/bin/python bench/bench_streaming.py --link 100mbit         # 2 emulated nodes (root)

Every row is one real job per seed (global batch 32, seeds 3, 4 and 5, one BLAS thread a process): `mpirun` on this
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

Each job's raw result goes to a JSON lines file (`--out`, default bench/results/streaming.jsonl,
started afresh unless `--append`), and the table printed at the end is made from it by
bench/tables.py: means over the seeds, the spread (lowest-highest) beside them, every ratio
against sync of the same seed. Goals are judged on the means.

Not a test. The rows (`--rows`):
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _common import REPO, emulated_nodes, machine_note, mpiexec_on_nodes, mpirun, one_thread_env
from tables import append_record, read_records, streaming_table
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


def run_row(launch, ranks: int, name: str, seed: int, data: str, args, workdir: Path) -> dict:
    run_dir = workdir / f"{name}-n{ranks}-s{seed}"
    job = ["-m", "hpc_rlx", "experiment=lm", f"hydra.run.dir={run_dir}", "report.plots=false",
           "checkpoint=off", f"data.path={data}", f"train.epochs={args.epochs}",
           f"train.seed={seed}", "comm.shared_memory=false"] + ROWS[name] + args.extra
    if name != "sync":
        job.append(f"policy.anchor={args.k}")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    launch(ranks, job)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "event" not in r]
    setting = {"ranks": ranks, "link": args.link, "epochs": args.epochs, "k": args.k, "extra": args.extra}
    record = {"bench": "streaming", "setting": setting, "row": name, "label": LABELS[name].format(k=args.k),
              "seed": seed, "syncs": recs[-1].get("syncs", recs[-1]["steps"]), "val_loss": recs[-1]["val_loss"],
              "curve": [(r["epoch_s"], r["val_loss"]) for r in recs],
              "wire": sum(int(r.get("wire_bytes") or 0) for r in recs), "wall_s": round(wall, 1),
              "load_before": round(load, 2), "commit": COMMIT,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
    append_record(args.out, record)
    print(f"  {name} seed {seed}: val_loss {record['val_loss']:.4f} wire {record['wire']} "
          f"wall {wall:.0f}s (load {load:.2f} before)", flush=True)
    return record


def run_rows(launch, ranks: int, rows: list[str], data: str, args, workdir: Path) -> None:
    for seed in args.seeds:
        for name in rows:
            run_row(launch, ranks, name, seed, data, args, workdir)


COMMIT = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                        text=True).stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes (this host)")
    ap.add_argument("--link", default=None, help="RATE[:DELAY_MS]: 2 emulated nodes joined by a link "
                                                  "of that rate (and delay) instead of this host (root)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--k", type=int, default=K, help="local steps per sync of every windowed row")
    ap.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5], help="train.seed of each repeat")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every row")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "streaming.jsonl",
                    help="the raw results, one JSON line a job")
    ap.add_argument("--append", action="store_true", help="add to --out instead of starting it afresh")
    args = ap.parse_args()
    if not args.append:
        args.out.unlink(missing_ok=True)
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
                      f"experiment=lm train.epochs={args.epochs} seeds {args.seeds}", flush=True)
                run_rows(launch, 2, rows, data, args, workdir)
        else:
            for ranks in args.ranks:
                def launch(n, job):
                    return mpirun(n, job, timeout=args.timeout, env=one_thread_env())
                print(f"\n# mpirun -n {ranks} on this host, experiment=lm train.epochs={args.epochs} "
                      f"seeds {args.seeds}", flush=True)
                run_rows(launch, ranks, rows, data, args, workdir)
    print(f"\n# raw results: {args.out}\n")
    print(streaming_table(read_records(args.out)), flush=True)


if __name__ == "__main__":
    main()
