"""The pipeline bubble per stage, measured from a merged trace (pure: no files, no MPI).

A pipelined rank records, per training step, a ``pipeline step`` span on its main track, a
``forward`` and a ``backward`` span per micro-batch on its ``stage S`` track, and a span for each
wait on a send or receive of the pipeline (``pipeline/engine.py``). Over the steps counted, a
stage is busy for the sum of its forward and backward spans inside its step spans; its bubble
is the rest of the step time: ``1 - busy / step``. With equal stage times and free messages
the schedule's bubble is ``(S-1)/(M+S-1)`` (``theory``), for GPipe and 1F1B alike.
"""

from __future__ import annotations

import bisect

COMPUTE_SPANS = ("forward", "backward")
WAIT_SPANS = ("recv activations", "send activations", "recv gradients", "send gradients", "send drain")
STEP_SPAN = "pipeline step"


def theory(stages: int, micro: int) -> float:
    """The bubble fraction of a GPipe or 1F1B schedule with equal stage times."""
    return (stages - 1) / (micro + stages - 1) if stages > 0 and micro > 0 else 0.0


def rank_bubbles(events: list[dict], skip_steps: int = 0) -> dict[int, dict]:
    """Per rank (a trace ``pid``) with ``pipeline step`` spans: its stage, the number of steps
    counted (all after the first ``skip_steps``), their total time ``step_s``, the forward and
    backward time inside them ``busy_s``, the send/receive wait inside them ``wait_s``, the
    micro-batches per step ``micro`` (the most seen), ``bubble = 1 - busy_s / step_s`` and
    ``wait_fraction = wait_s / step_s``. ``events`` are Chrome trace events (microseconds)."""
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans: dict[int, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X":
            spans.setdefault(e["pid"], []).append(e)
    out = {}
    for pid, evs in sorted(spans.items()):
        steps = sorted((e for e in evs if e["name"] == STEP_SPAN), key=lambda e: e["ts"])[skip_steps:]
        if not steps:
            continue
        starts = [e["ts"] for e in steps]
        busy = wait = 0.0
        stage = None
        micro_in: dict[int, set] = {}
        for e in evs:
            if e["name"] not in COMPUTE_SPANS and e["name"] not in WAIT_SPANS:
                continue
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i < 0 or e["ts"] + e["dur"] > steps[i]["ts"] + steps[i]["dur"] + 1e-3:
                continue      # outside every counted step
            if e["name"] in COMPUTE_SPANS:
                busy += e["dur"]
                name = tracks.get((pid, e["tid"]), "")
                if stage is None and name.startswith("stage "):
                    stage = int(name.split()[1])
                micro_in.setdefault(i, set()).add((e.get("args") or {}).get("micro"))
            else:
                wait += e["dur"]
        step = sum(e["dur"] for e in steps)
        out[pid] = {"stage": stage, "steps": len(steps), "step_s": step * 1e-6, "busy_s": busy * 1e-6,
                    "wait_s": wait * 1e-6, "micro": max((len(v) for v in micro_in.values()), default=0),
                    "bubble": 1.0 - busy / step if step > 0 else 0.0,
                    "wait_fraction": wait / step if step > 0 else 0.0}
    return out


def stage_bubbles(events: list[dict], skip_steps: int = 0) -> list[dict]:
    """Per stage, in order: ``rank_bubbles`` summed over the stage's replicas (times per
    replica: divided by their count), with ``ranks``, ``stages`` and ``theory`` added."""
    per = rank_bubbles(events, skip_steps)
    by_stage: dict[int, list[dict]] = {}
    for pid, r in per.items():
        if r["stage"] is not None:
            by_stage.setdefault(r["stage"], []).append(dict(r, rank=pid))
    S = len(by_stage)
    out = []
    for s in sorted(by_stage):
        rs = by_stage[s]
        step, busy, wait = (sum(r[k] for r in rs) for k in ("step_s", "busy_s", "wait_s"))
        micro = max(r["micro"] for r in rs)
        out.append({"stage": s, "ranks": [r["rank"] for r in rs], "steps": min(r["steps"] for r in rs),
                    "step_s": step / len(rs), "busy_s": busy / len(rs), "wait_s": wait / len(rs),
                    "bubble": 1.0 - busy / step if step > 0 else 0.0,
                    "wait_fraction": wait / step if step > 0 else 0.0,
                    "micro": micro, "stages": S, "theory": theory(S, micro)})
    return out
