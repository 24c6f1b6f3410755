"""Finite-difference gradient checks, shipped so users can test ops and graphs they add.

``check_grads(graph, params, feeds)`` compares the executor's float64 gradients with central
differences of the loss, on a sample of coordinates of every trainable parameter plus one
random direction through all of them (buffers are state, not differentiated).
``check_op(op, args, **attrs)`` wraps a single op into a graph (float arguments become
parameters, or buffers where the op's VJP rule is None for them, integer ones inputs, the loss a
random weighting of the op's output) and checks that.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.builder import GraphBuilder
from hpc_rlx.graph.executor import Executor
from hpc_rlx.graph.ir import Graph
from hpc_rlx.graph.params import ParamLayout
from hpc_rlx.graph.registry import VJPS
from hpc_rlx.graph.shapes import FLOAT, INT


class GradCheckError(AssertionError):
    """Analytic and numeric gradients disagree."""


def check_grads(graph: Graph, params: dict, feeds: dict, *, eps: float = 1e-6, rtol: float = 1e-5,
                atol: float = 1e-8, max_coords: int = 24, seed: int = 0, train: bool = False,
                dropout_seed: int = 1234) -> dict:
    """Raise GradCheckError on a mismatch; return ``{param: worst |numeric - analytic|}``.

    With ``train=True`` dropout is active with a fixed ``dropout_seed``, so the loss stays a
    deterministic, differentiable function of the parameters.
    """
    ex = Executor(graph, np, "float64")
    layout = ParamLayout(graph)
    flat = np.zeros(layout.size)
    layout.pack({k: np.asarray(v, dtype=np.float64) for k, v in params.items()}, flat)
    grad_flat = np.zeros(layout.size)
    views, grads = layout.views(flat), layout.views(grad_flat)
    feeds = {k: np.asarray(v, dtype=np.float64) if graph.input(k).dtype == FLOAT else np.asarray(v)
             for k, v in feeds.items()}
    ex.forward_backward(views, grads, feeds, train=train, seed=dropout_seed, grad_scale=1.0)

    def loss() -> float:
        return ex.forward(views, feeds, train=train, seed=dropout_seed)[graph.loss_name]

    rng = np.random.default_rng(seed)
    report, failures = {}, []
    buffers = set(layout.buffer_names)
    for name in (n for n in layout.names if n not in buffers):
        p, g = views[name].reshape(-1), grads[name].reshape(-1)
        coords = np.arange(p.size) if p.size <= max_coords else rng.choice(p.size, max_coords, replace=False)
        worst = 0.0
        for i in coords:
            keep = p[i]
            p[i] = keep + eps
            up = loss()
            p[i] = keep - eps
            down = loss()
            p[i] = keep
            num = (up - down) / (2 * eps)
            err = abs(num - g[i])
            worst = max(worst, err)
            if err > atol + rtol * abs(num):
                at = tuple(int(j) for j in np.unravel_index(i, views[name].shape))
                failures.append(f"{name}{list(at)}: numeric {num:.10g} analytic {g[i]:.10g}")
        report[name] = float(worst)

    # One random direction through every parameter at once catches errors in unsampled coordinates.
    direction = rng.standard_normal(layout.size)
    direction[layout.trainable_size:] = 0.0  # the buffers follow the trainable parameters
    base = flat.copy()
    flat[:] = base + eps * direction
    up = loss()
    flat[:] = base - eps * direction
    down = loss()
    flat[:] = base
    num = (up - down) / (2 * eps)
    ana = float(direction @ grad_flat)
    if abs(num - ana) > atol * np.sqrt(layout.size) + rtol * abs(num):
        failures.append(f"random direction: numeric {num:.10g} analytic {ana:.10g}")
    if failures:
        raise GradCheckError(f"graph '{graph.name}': {len(failures)} gradient mismatch(es):\n  " + "\n  ".join(failures[:20]))
    return report


def op_graph(op: str, args: list, attrs: dict | None = None, seed: int = 0):
    """A graph whose loss is ``sum(op(*args) * w)`` for a fixed random ``w``; returns (graph, params, feeds)."""
    b = GraphBuilder(f"check_{op}")
    params, feeds, refs = {}, {}, []
    for i, a in enumerate(args):
        a = np.asarray(a)
        if a.dtype.kind in "iu":
            refs.append(b.input(f"int{i}", list(a.shape), INT))
            feeds[f"int{i}"] = a.astype(np.int64)
        else:
            # an argument the op's VJP rule declares non-differentiable (None) is a buffer
            rule = VJPS.get(op)
            trainable = rule is None or i >= len(rule.fns) or rule.fns[i] is not None
            refs.append(b.param(f"arg{i}", list(a.shape), {"scheme": "zeros"}, trainable=trainable))
            params[f"arg{i}"] = a.astype(np.float64)
    out = b.op(op, *refs, name="out", **(attrs or {}))
    t = b.type_of(out)
    if t.dtype != FLOAT or None in t.shape:
        raise ValueError(f"op '{op}' gives {t}; only float outputs of known shape can be checked")
    w = b.input("w", list(t.shape), FLOAT)
    feeds["w"] = np.random.default_rng(seed).standard_normal(t.shape)
    b.output("loss", b.op("sum", b.op("mul", out, w, name="weighted"), name="total"))
    return b.build(), params, feeds


def check_op(op: str, args: list, attrs: dict | None = None, **kwargs) -> dict:
    """Finite-difference check of one op with respect to each of its float arguments."""
    graph, params, feeds = op_graph(op, args, attrs, seed=kwargs.get("seed", 0))
    return check_grads(graph, params, feeds, **kwargs)
