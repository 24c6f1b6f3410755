"""Random draws a model makes itself: ``random_like`` (uniform or normal values shaped like its
input) and ``bernoulli`` (0/1 draws with the probabilities it is given), as exported from
stochastic depth, dropout written by hand, or noise (conventions in ``hpc_rlx.graph.ops``).

Training draws from the step seed and the node, like dropout's masks, so a run repeats exactly
and each lane and step draws its own. Evaluation takes the draw's expectation instead: a
stochastic-depth mask divided by its keep probability then averages to 1 and additive noise to
its mean, which is what the model's own eval mode computes. No gradient flows through a draw:
``random_like``'s input gives only the shape, and PyTorch's ``bernoulli`` has no gradient.
"""

from __future__ import annotations

import math

from hpc_rlx.base import backend
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType, require_float

DISTRIBUTIONS = ("uniform", "normal")


def _float_like(types, a):
    require_float(types[0], "input")
    return TensorType(types[0].shape, FLOAT)


def _check_random(a):
    if a["dist"] not in DISTRIBUTIONS:
        raise ShapeError(f"attribute 'dist' must be one of {', '.join(DISTRIBUTIONS)}, got {a['dist']!r}")
    for key in ("a", "b"):
        v = a[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ShapeError(f"attribute '{key}' must be a finite number, got {v!r}")
    if a["dist"] == "uniform" and not a["a"] <= a["b"]:
        raise ShapeError(f"uniform draws need a <= b, got a={a['a']} b={a['b']}")
    if a["dist"] == "normal" and a["b"] < 0:
        raise ShapeError(f"normal draws need a scale b >= 0, got {a['b']}")
    return {"dist": a["dist"], "a": float(a["a"]), "b": float(a["b"])}


def _seed(ctx, op: str) -> int:
    if ctx.seed is None:
        raise ValueError(f"{op} node '{ctx.node}' runs in train mode and needs a seed")
    return backend.derive_seed(ctx.seed, ctx.index)


@defop("random_like", _float_like, (1, 1), attrs={"dist": REQUIRED, "a": 0.0, "b": 1.0}, check=_check_random)
def random_like(xp, args, a, ctx):
    """`dist='uniform'`: values in [a, b); `dist='normal'`: mean a, standard deviation b."""
    x = args[0]
    lo_or_mean, hi_or_scale = a["a"], a["b"]
    if not ctx.train:
        mean = (lo_or_mean + hi_or_scale) / 2 if a["dist"] == "uniform" else lo_or_mean
        return xp.full(x.shape, mean, dtype=x.dtype), None
    seed = _seed(ctx, "random_like")
    u = backend.uniform(xp, seed, x.shape, x.dtype)
    if a["dist"] == "uniform":
        return lo_or_mean + (hi_or_scale - lo_or_mean) * u, None
    # Box-Muller from two uniform draws: the same on every array module
    v = backend.uniform(xp, backend.derive_seed(seed, 1), x.shape, x.dtype)
    z = xp.sqrt(-2.0 * xp.log1p(-u)) * xp.cos((2.0 * math.pi) * v)
    return lo_or_mean + hi_or_scale * z, None


@defop("bernoulli", _float_like, (1, 1))
def bernoulli(xp, args, a, ctx):
    """1 with probability p (the input, elementwise), else 0."""
    p = args[0]
    if not ctx.train:
        return p, None
    u = backend.uniform(xp, _seed(ctx, "bernoulli"), p.shape, p.dtype)
    return (u < p).astype(p.dtype), None


def _no_gradient(xp, g, args, ans, saved, a, out):
    return xp.zeros_like(args[0])


defvjp("random_like", _no_gradient, needs_args=(0,))
defvjp("bernoulli", _no_gradient, needs_args=(0,))
