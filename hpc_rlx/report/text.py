"""A text summary and plots of a run (or of a sweep) from the files it left behind.

    python -m hpc_rlx.report outputs/2026-01-01_12-00-00          # a run directory
    python -m hpc_rlx.report multirun/2026-01-01_12-00-00         # a sweep directory
    python -m hpc_rlx.report RUN_DIR --no-plots                   # text only

A run directory gets `plots/curves.png`, `plots/rank_time.png` and `plots/lanes.png`, a sweep
directory `sweep.png` (see `observe.plots`). Reading the files and the numbers derived from them
live in `observe.run_files` (re-exported here); this module prints the text and is the command.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.base.topology import rank_span
from hpc_rlx.base.errors import HpcRlxError
from hpc_rlx.observe.plots import write_plots  # noqa: F401 - re-exported (matplotlib loads on first plot)
from hpc_rlx.observe.run_files import (
    MAX_EPOCH_GROUPS,
    MAX_GROUPED_RANKS,
    PARTS,
    RunFiles,
    bin_epochs,
    cpu_use,
    epoch_parts,
    is_sweep_dir,
    lane_rates,
    load_run,
    rank_epochs,
    rank_totals,
    read_metrics,
    slowest_rank,
    sweep_rows,
    varied_overrides,
)
from hpc_rlx.observe.pipeline_bubble import stage_bubbles
from hpc_rlx.observe.metrics.validation import VAL_KEYS
from hpc_rlx.observe.sweep_table import render
from hpc_rlx.base.trace import summarize

# --------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------

def _f(v, spec: str = ".4f") -> str:
    return "-" if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def run_text(files: RunFiles) -> str:
    s = files.summary or {}
    m = files.metrics
    lines = []
    status = s.get("status", "running or interrupted (no summary.json)")
    lines.append(f"run {files.dir}: {status}, {s.get('epochs_completed', len(m))} epochs, "
                 f"{s.get('steps', m[-1].get('step') if m else '?')} steps, "
                 f"{s.get('world_size', '?')} ranks, policy {m[-1].get('policy', '?') if m else '?'}")
    final = s.get("final") or (m[-1] if m else {})
    # a regression run has no accuracy: no "val_accuracy -" either
    acc = "".join(f"  {k} {_f(final.get(k))}" for k in VAL_KEYS[1:] if k in final)
    lines.append(f"final: train_loss {_f(final.get('train_loss'))}  val_loss {_f(final.get('val_loss'))}"
                 f"{acc}")
    for f in s.get("failures") or []:
        who = ", ".join(f"{r} on {h}" for r, h in zip(f["ranks"], f["hosts"]))
        lines.append(f"failure: rank{'s' if len(f['ranks']) > 1 else ''} {who} lost at step {f['step']}; "
                     f"{f['world_size_after']} ranks trained on after {f['recovery_s']:.2f} s of recovery")
    rates = [r["samples_per_s"] for r in m if isinstance(r.get("samples_per_s"), (int, float))]
    if rates:
        later = rates[1:] or rates   # the first epoch pays warm-up
        lines.append(f"throughput: {statistics.median(later):,.0f} samples/s median over "
                     f"{'epochs 2+' if len(rates) > 1 else 'the epoch'} (first epoch {rates[0]:,.0f})")
    totals = rank_totals(files)
    if files.ranks:
        lines.append("per rank (seconds over the run):")
        cpu = cpu_use(files)
        lines.append(f"  {'rank':>4} {'host':<12} {'lanes':<14} {'thr':>3} {'samples':>9} {'compute':>8} "
                     f"{'comm':>8} {'data':>8} {'ckpt':>7} {'wall':>8} {'cpu%':>5}")
        for i, r in enumerate(files.ranks):
            k = int(r.get("rank", i))
            t = totals.get(k, {})
            lines.append(
                f"  {k:>4} {str(r.get('host', ''))[:12]:<12} {','.join(r.get('lanes') or [])[:14]:<14} "
                f"{_f(r.get('threads'), 'd') if isinstance(r.get('threads'), int) else '-':>3} "
                f"{int(r.get('samples') or 0):>9} {_f(r.get('compute_s'), '.3f'):>8} {_f(r.get('comm_s'), '.3f'):>8} "
                f"{_f(t.get('data_s', r.get('data_s')), '.3f'):>8} {_f(r.get('checkpoint_s'), '.3f'):>7} "
                f"{_f(r.get('wall_s'), '.2f'):>8} "
                f"{(f'{100 * cpu[k]:.0f}' if k in cpu else '-'):>5}")
        slow = slowest_rank(files)
        if slow:
            rank, ratio = slow
            verdict = ("balanced" if ratio < 1.1 else
                       f"rank {rank} is the slowest: {ratio:.2f}x the median compute time per sample; "
                       f"the other ranks wait for it inside the allreduce (their comm time)")
            lines.append(f"balance: {verdict}")
        starved = sorted(k for k, c in cpu.items() if c < 0.7)
        if starved:
            lines.append(f"cpu: rank{'s' if len(starved) > 1 else ''} {rank_span(starved)} used under 70% "
                         f"of a core while training: "
                         f"they waited for a core (another job on the node, or ranks x threads > cores; "
                         f"see train.threads_per_rank and python -m hpc_rlx.doctor)")
        comm_share = [t["comm_s"] / max(1e-12, t["comm_s"] + t["compute_s"]) for t in totals.values()
                      if t["comm_s"] + t["compute_s"] > 0]
        if comm_share:
            lines.append(f"communication: {100 * min(comm_share):.0f}-{100 * max(comm_share):.0f}% "
                         f"of compute+comm time across ranks")
        wire = [int(r["wire_bytes"]) for r in files.ranks if isinstance(r.get("wire_bytes"), int)]
        if wire:
            lines.append(f"bytes on the wire: {sum(wire) / 2**20:,.2f} MiB over the run, all ranks "
                         f"({min(wire) / 2**20:,.2f}-{max(wire) / 2**20:,.2f} MiB per rank; docs/observe.md)")
    lanes = lane_rates(files)
    if len(lanes) > 1 or any(lane != "cpu0" for _, lane, _, _ in lanes):
        lines.append("lanes: " + "  ".join(f"r{r}:{lane} {rate:,.0f}/s ({n} samples)"
                                           for r, lane, rate, n in lanes[:16])
                     + ("  ..." if len(lanes) > 16 else ""))
    tpath = files.dir / names.TRACE
    if tpath.is_file():
        lines.append(f"trace: {tpath} (open in https://ui.perfetto.dev or chrome://tracing)")
        lines.extend(trace_lines(tpath))
    return "\n".join(lines)


STEP_SPANS = ("data.batch", "forward_backward", "allreduce", "wait", "optimizer", "step")


def trace_per_step(doc: dict) -> dict[int, dict[str, float]]:
    """Per rank: milliseconds per step spent in each step-level span (from a merged trace)."""
    tot: dict[int, dict[str, float]] = {}
    steps: dict[int, int] = {}
    for e in doc.get("traceEvents", []):
        if e.get("ph") != "X" or e["name"] not in STEP_SPANS:
            continue
        d = tot.setdefault(e["pid"], {})
        d[e["name"]] = d.get(e["name"], 0.0) + e["dur"] * 1e-3
        if e["name"] == "step":
            steps[e["pid"]] = steps.get(e["pid"], 0) + 1
    return {r: {k: v / steps[r] for k, v in d.items()} for r, d in tot.items() if steps.get(r)}


def trace_lines(path: Path, max_ranks: int = 8) -> list[str]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"  (trace unreadable: {e})"]
    per = trace_per_step(doc)
    bubble = bubble_lines(doc)
    if not per:
        # policies without per-step spans (cadence, async): totals per span name instead
        tot = sorted(summarize(doc).items(), key=lambda kv: -kv[1])
        tot = [(k, v) for k, v in tot if not k.startswith("epoch ")][:8]
        return (["  seconds, all ranks: " + "  ".join(f"{k} {v:.3f}" for k, v in tot)] if tot else []) + bubble
    out = ["  ms per step  " + " ".join(f"{k:>16}" for k in STEP_SPANS)]
    for r in sorted(per)[:max_ranks]:
        out.append(f"  rank {r:<6} " + " ".join(f"{per[r].get(k, 0.0):>16.3f}" for k in STEP_SPANS))
    if len(per) > max_ranks:
        out.append(f"  ... {len(per) - max_ranks} more ranks")
    return out + bubble


def bubble_lines(doc: dict) -> list[str]:
    """The pipeline's bubble per stage (a pipelined run's trace), the first step left out as
    warm-up when there are more."""
    events = doc.get("traceEvents", [])
    steps = sum(1 for e in events if e.get("ph") == "X" and e.get("name") == "pipeline step" and e.get("pid") == 0)
    rows = stage_bubbles(events, skip_steps=1 if steps > 1 else 0)
    if not rows:
        return []
    out = [f"  pipeline bubble per stage ({rows[0]['stages']} stages, {rows[0]['micro']} micro-batches, "
           f"{rows[0]['steps']} steps{', the first left out' if steps > 1 else ''}; times per replica):",
           f"  {'stage':>5} {'ranks':<10} {'step s':>9} {'busy s':>9} {'bubble':>7} {'send/recv wait':>14} "
           f"{'(S-1)/(M+S-1)':>13}"]
    for r in rows:
        out.append(f"  {r['stage']:>5} {rank_span(r['ranks'])[:10]:<10} {r['step_s']:>9.3f} {r['busy_s']:>9.3f} "
                   f"{r['bubble']:>7.3f} {r['wait_s']:>8.3f} s {r['wait_fraction']:>4.0%} {r['theory']:>13.3f}")
    return out


def sweep_text(sweep_dir: Path, rows: list[dict]) -> str:
    done = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
    head = f"sweep {sweep_dir}: {len(rows)} points, {len(done)} with a final val_loss"
    if done:
        best = min(done, key=lambda r: r["val_loss"])
        head += (f"; best val_loss {best['val_loss']:.4f} at point {best['point']} "
                 f"({best.get('varied') or best.get('overrides')})")
    common = ""
    if rows and rows[0].get("overrides"):
        shared = [t for t in rows[0]["overrides"].split() if t not in (rows[0].get("varied") or "").split()]
        common = ("common overrides: " + " ".join(shared) + "\n") if shared else ""
    compact = [dict(r, overrides=r.get("varied", r.get("overrides"))) for r in rows]
    return head + "\n" + common + render(compact)


def _plots_not_written(e: OSError, where) -> None:
    """The summary is printed already: a run directory one cannot write (a colleague's run, an
    archive, a read-only mount) loses only its plots, with where else they can go."""
    print(f"hpc_rlx.report: warning: plots not written: {e.filename or where}: "
          f"{e.strerror or e}; write them elsewhere with --out DIR, or print the summary "
          f"alone with --no-plots", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpc_rlx.report",
                                description="Plots and a text summary of a run or sweep directory.")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, summary.json) or a sweep directory")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    p.add_argument("--no-plots", action="store_true", help="print the text summary only")
    p.add_argument("--points", action="store_true",
                   help="for a sweep directory, also (re)write every point's own plots")
    args = p.parse_args(argv)
    try:
        path = Path(args.run_dir)
        if not path.is_dir():
            raise HpcRlxError(f"{path} is not a directory")
        if is_sweep_dir(path):
            print(sweep_text(path, sweep_rows(path)))
        else:
            print(run_text(load_run(path)))
        if not args.no_plots:
            try:
                made = write_plots(path, args.out)
            except ImportError:
                print("plots: skipped, matplotlib is not installed (pip install 'hpc_rlx[report]')")
            except OSError as e:
                _plots_not_written(e, args.out or path)
            else:
                if args.points and is_sweep_dir(path):
                    for r in sweep_rows(path):
                        try:
                            made += write_plots(path / r["point"])
                        except HpcRlxError as e:
                            print(f"point {r['point']}: {e}")
                        except OSError as e:
                            _plots_not_written(e, path / r["point"])
                print("plots: " + (", ".join(str(m) for m in made) if made else "nothing to plot"))
    except HpcRlxError as e:
        print(f"hpc_rlx.report: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
