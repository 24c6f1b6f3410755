"""Cost of `trace.enabled=true`, measured two ways.

    .venv/bin/python bench/bench_trace.py                    # about two minutes
    .venv/bin/python bench/bench_trace.py --repeats 5 --ranks 2

1. Per call: the time of one recorded span (enabled) and of one instrumented site when
   tracing is off, in nanoseconds; and the instrumentation of one policy=sync step (the same
   five recording sites as the loop, on empty work), tracing on minus off (best of several
   loops, one process). Divided by a real step's time this gives the overhead with little
   noise.
2. End to end: the same training job with tracing off and on, alternating, for the
   benchmark MLP (784-1024-1024-10, batch 128 per rank) and the small default digits MLP
   (the worst case: steps of about a millisecond). Throughput is hpc_rlx's `samples_per_s`
   over the epochs after the first; best of the repeats. On a shared machine this difference
   is within the noise, which is why (1) is printed too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (fmt_table, hpc_throughput, machine_note, mpirun, one_thread_env,  # noqa: E402
                     prepare_synthetic)


def per_event_ns(loops: int = 200_000, rounds: int = 5) -> dict:
    from hpc_rlx.base import trace

    def best(fn) -> float:
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) / loops * 1e9)
        return min(out)

    def off_span():
        for _ in range(loops):
            with trace.span("optimizer", "optim"):
                pass

    def off_check():
        for _ in range(loops):
            if trace.ACTIVE is not None:
                pass

    def empty():
        for _ in range(loops):
            pass

    trace.ACTIVE = None
    base = best(empty)
    res = {"disabled span": best(off_span) - base, "disabled check": best(off_check) - base}
    tr = trace.Tracer(max_events=loops * rounds * 3)
    trace.ACTIVE = tr

    def on_span():
        for _ in range(loops):
            with trace.span("optimizer", "optim"):
                pass

    def on_add():
        for _ in range(loops):
            t0 = time.perf_counter()
            tr.add("chunk", "comm", trace.MAIN, t0, time.perf_counter(), {"seq": 1, "i": 0})

    res["enabled span"] = best(on_span) - base
    res["enabled add (+2 clock reads, args)"] = best(on_add) - base

    def sync_step_sites():
        # what a policy=sync step records: batch, lane, allreduce, optimizer, step
        if trace.ACTIVE is not None:
            trace.ACTIVE = trace.Tracer(max_events=10 * loops)    # room for every event
        for s in range(loops):
            t_step = time.perf_counter()
            t_data = time.perf_counter()
            tr = trace.ACTIVE
            if tr is not None:
                tr.add("data.batch", "data", trace.MAIN, t_step, t_data)
            t0 = time.perf_counter()
            t1 = time.perf_counter()
            if trace.ACTIVE is not None:
                trace.ACTIVE.add("forward_backward", "compute", "lane cpu0", t0, t1, {"n": 32})
            t0 = time.perf_counter()
            tr2 = trace.ACTIVE
            seq = tr2.next_seq() if tr2 is not None else 0
            t1 = time.perf_counter()
            if tr2 is not None:
                tr2.add("allreduce", "comm", trace.MAIN, t0, t1,
                        {"seq": seq, "bytes": 4096, "chunks": 1, "path": "host"})
            with trace.span("optimizer", "optim"):
                pass
            t_end = time.perf_counter()
            if tr is not None:
                tr.add("step", "step", trace.MAIN, t_step, t_end, {"step": s})

    trace.ACTIVE = trace.Tracer()
    on_step = best(sync_step_sites)
    trace.ACTIVE = None
    res["sync step, tracing on minus off"] = on_step - best(sync_step_sites)
    return res


JOBS = {
    # name: (overrides, global batch per rank)
    "mlp-1024": (["data=synthetic", "data.val_fraction=0", "model.hidden=[1024,1024]", "optim.lr=0.01"], 128),
    "digits-default": ([], 32),
}


def run_job(name: str, n: int, data: Path, trace_on: bool, epochs: int, work: Path) -> tuple[dict, dict | None]:
    over, per_rank = JOBS[name]
    run_dir = work / f"{name}_{n}_{int(trace_on)}_{time.monotonic_ns()}"
    args = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", f"data.path={data}", f"train.batch_size={per_rank * n}",
            f"train.epochs={epochs}", "train.threads_per_rank=1", "checkpoint=off", "report.plots=false",
            f"trace.enabled={'true' if trace_on else 'false'}", "train.log_every_s=1000"] + over
    mpirun(n, args, timeout=900, env=one_thread_env())
    tp = hpc_throughput(run_dir, per_rank * n, skip_epochs=1)
    events = None
    if trace_on:
        doc = json.loads((run_dir / "trace.json").read_text())
        xs = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["name"] != "wait"]
        steps = sum(1 for e in xs if e["name"] == "step")
        events = {"per_step": len(xs) / max(1, steps), "steps": steps}
    shutil.rmtree(run_dir, ignore_errors=True)
    return tp, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--jobs", default="mlp-1024,digits-default")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpc_rlx_bench_trace_"))
    print(f"# {machine_note()}")
    ev = per_event_ns()
    print(fmt_table(["site", "ns per call"], [[k, v] for k, v in ev.items()]))
    step_ns = ev["sync step, tracing on minus off"]
    rows = []
    try:
        for job in args.jobs.split(","):
            if job == "mlp-1024":
                data = prepare_synthetic(work / "syn.h5", 128 * args.ranks * 32, 784, 10)
            else:
                from hpc_rlx.data.prepare import ensure_prepared
                data = Path(ensure_prepared(str(work / "digits.h5"), "digits"))
            off, on, per_step = [], [], None
            for rep in range(args.repeats):
                for flag in ((False, True) if rep % 2 == 0 else (True, False)):
                    tp, evs = run_job(job, args.ranks, data, flag, args.epochs, work)
                    (on if flag else off).append(tp)
                    per_step = evs or per_step
                    print(f"  {job} trace={'on ' if flag else 'off'}: {tp['samples_per_s']:,.0f} samples/s "
                          f"({tp['step_ms']:.2f} ms/step)", flush=True)
            b_off = max(v["samples_per_s"] for v in off)
            b_on = max(v["samples_per_s"] for v in on)
            step_ms = min(v["step_ms"] for v in off)
            est = step_ns * 1e-6 / step_ms
            rows.append([job, b_off, b_on, f"{100 * (b_off - b_on) / b_off:+.1f}%", step_ms,
                         f"{per_step['per_step']:.1f}", f"{100 * est:.3f}%"])
        print()
        print(fmt_table(["job", "off samples/s", "on samples/s", "measured slowdown", "ms/step",
                         "events/step", "estimated overhead"], rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
