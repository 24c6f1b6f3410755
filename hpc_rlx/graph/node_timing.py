"""How long each node of a graph takes, forward plus backward, and that time as a stage cost.

``node_times`` runs the executor's own training plan on a small synthetic batch, one node at a
time with a clock around each forward op and each VJP, a few times, and keeps the median per
node (the first run warms caches and is dropped). It is a separate loop over the executor's
plan, so the executor's normal step carries no timing at all.

``time_cost`` turns those times into the per-node ``cost`` that ``partition`` adds to the
parameter elements each node brings: the times are scaled so that the whole graph's time weighs
as much as its whole parameter count. Parameters (what a rank must hold) and time (how long a
stage keeps the others waiting) then count equally, whatever the units of either; with equal
parameters the faster split wins, with equal times the smaller memory.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from hpc_rlx.graph.executor import Executor
from hpc_rlx.graph.params import ParamLayout, init_params
from hpc_rlx.graph.plan import OpContext
from hpc_rlx.graph.shapes import FLOAT, known_prod


def synthetic_feeds(graph, rows: int, dtype, seed: int = 0) -> dict:
    """A batch of ``rows`` samples for every graph input: floats drawn from N(0, 1), integers
    zero (a valid class and token for any model)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in graph.inputs:
        shape = tuple(rows if d is None else int(d) for d in s.shape)
        feeds[s.name] = (rng.standard_normal(shape).astype(dtype) if s.dtype == FLOAT
                         else np.zeros(shape, dtype=np.int64))
    return feeds


def _one_pass(ex: Executor, feeds: dict, params: dict, grads: dict, names: dict, acc: dict) -> None:
    xp, env = ex.xp, ex.load_slots(feeds, params)
    saved = [None] * len(env)
    ctx = OpContext(True, 0, ex.dtype)
    for st in ex.train_plan:                      # forward: no slot released (backward reads them)
        ctx.index, ctx.node, ctx.need_saved = st.index, st.name, st.need_saved
        t0 = time.perf_counter()
        out, sv = st.forward(xp, [env[a] for a in st.args], st.attrs, ctx)
        acc[st.name] = acc.get(st.name, 0.0) + time.perf_counter() - t0
        env[st.slot] = out
        if sv is not None:
            saved[st.slot] = sv
    cot = [None] * len(env)
    cot[ex.loss_slot] = xp.asarray(1.0, dtype=ex.dtype)
    for bs in ex.backward_plan:
        g, args = cot[bs.slot], [env[a] for a in bs.args]
        t0 = time.perf_counter()
        for a, fn, pname, _ in bs.grads:
            r = fn(xp, g, args, env[bs.slot], saved[bs.slot], bs.attrs, None)
            if pname is None:
                cot[a] = r if cot[a] is None else cot[a] + r
            else:
                grads[pname][...] += r
        name = names.get(bs.slot)
        if name is not None:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0


def node_times(graph, rows: int = 8, dtype="float32", reps: int = 3, seed: int = 0) -> dict:
    """node name -> median seconds of its forward plus backward on ``rows`` samples (``reps``
    timed runs after one warm-up). Needs a graph with a loss; the graph as written (no rewrite)."""
    ex = Executor(graph, np, dtype, rewrite=False)
    layout = ParamLayout(graph)
    flat = init_params(graph, np.zeros(layout.size), seed).astype(ex.dtype)
    params, grads = layout.views(flat), layout.views(np.zeros_like(flat))
    feeds = synthetic_feeds(graph, max(1, int(rows)), ex.dtype, seed)
    names = {st.slot: st.name for st in ex.train_plan}
    runs = []
    for _ in range(max(1, int(reps)) + 1):
        acc: dict = {}
        _one_pass(ex, feeds, params, grads, names, acc)
        runs.append(acc)
    runs = runs[1:]
    return {n: statistics.median(r.get(n, 0.0) for r in runs) for n in runs[0]}


def time_cost(times: dict, graph) -> dict:
    """node -> cost in parameter elements: ``times`` scaled so their sum equals the graph's
    parameter count (see the module docstring). All zero times give no cost."""
    total_time = sum(times.values())
    total_params = sum(known_prod(p.shape) for p in graph.params)
    if total_time <= 0 or total_params <= 0:
        return {}
    scale = total_params / total_time
    return {n: t * scale for n, t in times.items()}
