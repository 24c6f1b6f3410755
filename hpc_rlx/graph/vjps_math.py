"""VJPs of the ops in ``ops_math`` (see ``vjps`` for the conventions)."""

from __future__ import annotations

import math

from hpc_rlx.graph.registry import defvjp
from hpc_rlx.graph.vjps import unbroadcast

TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _masked(xp, mask, g):
    """``g`` where ``mask``, else 0, in ``g``'s dtype."""
    return xp.where(mask, g, 0.0).astype(g.dtype, copy=False)


# ---------------------------------------------------------------- unary


def _erf_x(xp, g, args, ans, s, a, out):
    x = args[0]
    d = x * x
    xp.negative(d, out=d)
    xp.exp(d, out=d)
    d *= TWO_OVER_SQRT_PI
    d *= g
    return d


defvjp("erf", _erf_x)
# The slope at 0 is alpha's side, as in PyTorch.
defvjp("leaky_relu", lambda xp, g, args, ans, s, a, out: xp.where(args[0] > 0, g, g * a["alpha"]))
defvjp("neg", lambda xp, g, args, ans, s, a, out: -g, needs_args=())
defvjp("sqrt", lambda xp, g, args, ans, s, a, out: g * 0.5 / ans, needs_args=(), needs_ans=True)
defvjp("exp", lambda xp, g, args, ans, s, a, out: g * ans, needs_args=(), needs_ans=True)
defvjp("log", lambda xp, g, args, ans, s, a, out: g / args[0])
defvjp("reciprocal", lambda xp, g, args, ans, s, a, out: -g * (ans * ans), needs_args=(), needs_ans=True)


def _clip_x(xp, g, args, ans, s, a, out):
    # PyTorch's hardtanh (ReLU6) convention: no gradient at the bounds themselves.
    x, lo, hi = args[0], a["min"], a["max"]
    if lo is None and hi is None:
        return g
    inside = (x > lo) if hi is None else (x < hi) if lo is None else (x > lo) & (x < hi)
    return _masked(xp, inside, g)


defvjp("clip", _clip_x)

# ---------------------------------------------------------------- broadcasting


def _pow_a(xp, g, args, ans, s, a, out):
    base, e = args
    d = xp.power(base, e - 1.0)
    d *= e
    d = _masked(xp, e != 0, g * d)  # x**0 is constant, even at x = 0 (PyTorch agrees)
    return unbroadcast(xp, d, base.shape)


def _pow_b(xp, g, args, ans, s, a, out):
    base, e = args
    d = ans * xp.log(base)
    d = _masked(xp, (base != 0) | (e < 0), g * d)  # 0**e for e >= 0: PyTorch's zero
    return unbroadcast(xp, d, e.shape)


defvjp("pow", _pow_a, _pow_b, needs_args=(0, 1), needs_ans=True)


def _where_branch(take):
    def vjp(xp, g, args, ans, saved, a, out):
        mask, shape_a, shape_b = saved
        return unbroadcast(xp, _masked(xp, mask if take else ~mask, g), shape_a if take else shape_b)

    return vjp


defvjp("where", None, _where_branch(True), _where_branch(False), needs_args=())

# ---------------------------------------------------------------- dtypes


def _cast_x(xp, g, args, ans, s, a, out):
    # Only float -> float is on a differentiable path (an int64 result is never differentiated).
    return g


defvjp("cast", _cast_x, needs_args=())
