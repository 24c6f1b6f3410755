"""Pipeline schedules: which micro-batch each stage runs forward or backward, in what order.

A schedule is one ordered action list per stage: ``Action("F", m)`` runs micro-batch m forward
through the stage, ``Action("B", m)`` its backward. A stage runs its list in order; an action
waits for what it needs: F(m) on stage s for F(m) on stage s-1 (its activations), B(m) on
stage s for B(m) on stage s+1 (its activations' gradients). Nothing else orders the stages,
so any list that respects these dependencies and every stage's own order runs without a
deadlock (the runtime's sends are non-blocking).

- ``gpipe``: every forward, then every backward (micro-batches in order). A stage keeps all M
  micro-batches' activations until their backward.
- ``1f1b``: stage s runs min(S-1-s, M) forwards to fill the pipeline, then alternates one
  forward and one backward, then drains the backwards. A stage keeps at most S-s micro-batches'
  activations (at most S).

``simulate`` lays a schedule on a time grid (each action starts as soon as its stage is free
and its dependency finished; times in integer units) and counts, per stage, the idle slots
between time 0 and the end of the last action, and the most micro-batches alive (forward done,
backward not). With equal unit forward and backward times both schedules take 2(M+S-1) slots,
of which every stage idles 2(S-1): a bubble fraction of (S-1)/(M+S-1).

Pure Python; no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlx.base.errors import ConfigError


@dataclass(frozen=True, order=True)
class Action:
    kind: str   # "F" forward, "B" backward
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}"


def gpipe(stages: int, micro: int) -> list:
    _check(stages, micro)
    return [[Action("F", m) for m in range(micro)] + [Action("B", m) for m in range(micro)]
            for _ in range(stages)]


def one_f_one_b(stages: int, micro: int) -> list:
    _check(stages, micro)
    plans = []
    for s in range(stages):
        warm = min(stages - 1 - s, micro)
        acts = [Action("F", m) for m in range(warm)]
        f, b = warm, 0
        while f < micro:
            acts += [Action("F", f), Action("B", b)]
            f, b = f + 1, b + 1
        acts += [Action("B", m) for m in range(b, micro)]
        plans.append(acts)
    return plans


PIPELINE_SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(name: str, stages: int, micro: int) -> list:
    if name not in PIPELINE_SCHEDULES:
        raise ConfigError(f"parallel.schedule={name!r} is not one of {sorted(PIPELINE_SCHEDULES)}")
    return PIPELINE_SCHEDULES[name](stages, micro)


def _check(stages, micro) -> None:
    for what, v in (("stages", stages), ("micro-batches", micro)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"the number of {what} must be an integer >= 1, got {v!r}")


@dataclass
class Timeline:
    start: list        # per stage: {Action: start time}
    makespan: int
    busy: list         # per stage: slots spent computing
    idle: list         # per stage: makespan - busy
    peak_alive: list   # per stage: most micro-batches whose forward ran and backward did not

    def bubble(self, stage: int) -> float:
        return self.idle[stage] / self.makespan if self.makespan else 0.0


def simulate(plans: list, forward: int = 1, backward: int = 1) -> Timeline:
    """Lay ``plans`` on the time grid; raises ValueError if they cannot all run (a deadlock)."""
    S = len(plans)
    done: dict = {}       # (stage, action) -> finish time
    free = [0] * S
    nxt = [0] * S
    start = [dict() for _ in range(S)]
    while any(nxt[s] < len(plans[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            while nxt[s] < len(plans[s]):
                a = plans[s][nxt[s]]
                dep = None
                if a.kind == "F" and s > 0:
                    dep = (s - 1, a)
                elif a.kind == "B" and s < S - 1:
                    dep = (s + 1, a)
                if dep is not None and dep not in done:
                    break
                if a.kind == "B" and (s, Action("F", a.micro)) not in done:
                    raise ValueError(f"stage {s} runs {a} before F{a.micro}")
                t0 = max(free[s], done[dep] if dep is not None else 0)
                start[s][a] = t0
                free[s] = done[(s, a)] = t0 + (forward if a.kind == "F" else backward)
                nxt[s] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: " + ", ".join(
                f"stage {s} waits at {plans[s][nxt[s]]}" for s in range(S) if nxt[s] < len(plans[s])))
    makespan = max(free) if S else 0
    busy = [sum(forward if a.kind == "F" else backward for a in p) for p in plans]
    peak = []
    for s in range(S):
        alive = best = 0
        for a in sorted(start[s], key=start[s].get):
            alive += 1 if a.kind == "F" else -1
            best = max(best, alive)
        peak.append(best)
    return Timeline(start, makespan, busy, [makespan - b for b in busy], peak)
