"""Pipeline stages on the transformer LM: throughput, memory per rank and the measured bubble.

    .venv/bin/python bench/bench_pipeline.py                        # S=1 on 1 rank, S=2 on 2 ranks
    .venv/bin/python bench/bench_pipeline.py --micro 2 4 8 --layers 4 --d-model 128

Every job trains the same LM (synthetic tokens written under a temp dir, float32, AdamW) for
`--steps` steps of each of two epochs (train.max_steps; the first epoch is warm-up), one BLAS
thread per rank, with the trace on. Per job it prints samples/s (hpc_rlx's `samples_per_s`
over the second epoch), each rank's `param_bytes` and `optimizer_bytes` (summary.json) and
peak RSS, and per stage the measured bubble: 1 - (the stage's forward and backward span time)
/ (its pipeline step span time), over the second epoch's steps (`observe/pipeline_bubble.py`, what
`python -m hpc_rlx.report` prints), next to the schedule's
(S-1)/(M+S-1) for equal stage times. On a 2-core machine S <= 2 is all that measures the
pipeline rather than oversubscription.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, hpc_throughput, machine_note, mpirun, one_thread_env  # noqa: E402

from hpc_rlx.observe.pipeline_bubble import stage_bubbles  # noqa: E402


def write_tokens(path: Path, rows: int, seq: int, vocab: int) -> Path:
    import h5py
    import numpy as np
    rng = np.random.default_rng(0)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
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
        for S in args.stages:
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
    print(fmt_table(["S", "M", "schedule", "samples/s", "param MiB/rank", "optim MiB/rank", "peak RSS MiB/rank",
                     "bubble measured/stage", "bubble (S-1)/(M+S-1)"], rows))


if __name__ == "__main__":
    main()
