"""Activations: ``relu``, ``leaky_relu``, ``tanh``, ``sigmoid``, ``gelu``, ``hard_sigmoid`` and
``hard_swish`` (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.graph.ops import fast_erf
from hpc_rlx.graph.ops.common import finite_number, same_float
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import ShapeError

GELU_C = math.sqrt(2.0 / math.pi)
SQRT_HALF = math.sqrt(0.5)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@defop("relu", same_float, (1, 1))
def relu(xp, args, a, ctx):
    return xp.maximum(args[0], 0.0), None


defvjp("relu", lambda xp, g, args, ans, s, a, out: g * (ans > 0), needs_args=(), needs_ans=True)


@defop("leaky_relu", same_float, (1, 1), attrs={"alpha": 0.01},
       check=lambda a: {"alpha": finite_number(a["alpha"], "alpha")})
def leaky_relu(xp, args, a, ctx):
    x, alpha = args[0], a["alpha"]
    if 0.0 < alpha <= 1.0:
        # max(x, alpha x) is the select's every value (-0.0, inf and NaN too) in two passes
        # (CosmoFlow's LeakyReLU: 7x faster than where() on 3-D activations)
        out = x * alpha
        return xp.maximum(out, x, out=out), None
    return xp.where(x > 0, x, x * alpha), None


def _leaky_relu_x(xp, g, args, ans, s, a, out):
    """The slope at 0 is alpha's side, as in PyTorch: g times 1 or alpha, read from a table by
    the mask's bytes (exact, 3x faster than where() on large arrays)."""
    slopes = xp.asarray([a["alpha"], 1.0], dtype=g.dtype)
    slope = xp.take(slopes, xp.greater(args[0], 0).view(xp.uint8))
    return xp.multiply(g, slope, out=slope)


defvjp("leaky_relu", _leaky_relu_x)


@defop("tanh", same_float, (1, 1))
def tanh(xp, args, a, ctx):
    return xp.tanh(args[0]), None


defvjp("tanh", lambda xp, g, args, ans, s, a, out: g * (1.0 - ans * ans), needs_args=(), needs_ans=True)


@defop("sigmoid", same_float, (1, 1))
def sigmoid(xp, args, a, ctx):
    # 1 / (1 + exp(-x)) in place: four passes over one temporary (a branch-free form with
    # where() took ~4x as long). exp(-x) overflows to inf below about -88 in float32 and the
    # result is then exactly 0, as in PyTorch.
    t = xp.negative(args[0])
    with np.errstate(over="ignore"):
        xp.exp(t, out=t)
    t += 1.0
    return xp.divide(1.0, t, out=t), None


def _sigmoid_x(xp, g, args, ans, s, a, out):
    d = 1.0 - ans
    d *= ans
    d *= g
    return d


defvjp("sigmoid", _sigmoid_x, needs_args=(), needs_ans=True)


def _check_gelu(a):
    if a["approximate"] not in ("tanh", "none"):
        raise ShapeError(f"gelu supports approximate='tanh' or 'none', got {a['approximate']!r}")
    return a


@defop("gelu", same_float, (1, 1), attrs={"approximate": "tanh"}, check=_check_gelu)
def gelu(xp, args, a, ctx):
    # "tanh": the GPT-2 form (PyTorch approximate="tanh"); "none": the exact x * Phi(x).
    # Either way the saved t is the bracket in 0.5 x (1 + t), which the VJP reuses.
    x = args[0]
    if a["approximate"] == "none" and fast_erf.on_host_float32(xp, x):
        fused = fast_erf.gelu_float32(x)
        if fused is not None:
            return fused[0], (fused[1] if ctx.need_saved else None)
    if a["approximate"] == "none":
        t = fast_erf.erf(xp, x * SQRT_HALF)
    else:
        t = x * x  # built in place: one temporary instead of one per operator
        t *= x
        t *= 0.044715
        t += x
        t *= GELU_C
        xp.tanh(t, out=t)
    out = t + 1.0
    out *= x
    out *= 0.5
    return out, (t if ctx.need_saved else None)


def _gelu_x(xp, g, args, ans, t, a, out):
    x = args[0]
    if a["approximate"] == "none" and fast_erf.on_host_float32(xp, x):
        fused = fast_erf.gelu_grad_float32(x, t, g)
        if fused is not None:
            return fused
    if a["approximate"] == "none":
        # d/dx 0.5 x (1 + erf(x / sqrt 2)) = 0.5 (1 + t) + x exp(-x^2 / 2) / sqrt(2 pi)
        d = x * x
        d *= -0.5
        xp.exp(d, out=d)
        d *= x
        d *= INV_SQRT_2PI
        d += 0.5 * (t + 1.0)
        d *= g
        return d
    # d/dx 0.5 x (1 + t) = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2), in place
    inner = x * x
    inner *= 3.0 * 0.044715 * GELU_C
    inner += GELU_C
    d = t * t
    xp.subtract(1.0, d, out=d)
    d *= x
    d *= inner
    d += t
    d += 1.0
    d *= 0.5
    d *= g
    return d


defvjp("gelu", _gelu_x)


def _check_hard_sigmoid(a):
    return {"alpha": finite_number(a["alpha"], "alpha"), "beta": finite_number(a["beta"], "beta")}


@defop("hard_sigmoid", same_float, (1, 1), attrs={"alpha": 0.2, "beta": 0.5}, check=_check_hard_sigmoid)
def hard_sigmoid(xp, args, a, ctx):
    # ONNX HardSigmoid: clip(alpha x + beta, 0, 1); PyTorch's hardsigmoid is alpha 1/6, beta 1/2
    return xp.clip(args[0] * a["alpha"] + a["beta"], 0.0, 1.0), None


def _hard_sigmoid_x(xp, g, args, ans, s, a, out):
    # the slope alpha strictly inside the ramp, 0 on the flat parts and at their edges (PyTorch)
    return g * ((ans > 0) & (ans < 1)) * a["alpha"]


defvjp("hard_sigmoid", _hard_sigmoid_x, needs_args=(), needs_ans=True)


@defop("hard_swish", same_float, (1, 1))
def hard_swish(xp, args, a, ctx):
    # x * relu6(x + 3) / 6, as ONNX HardSwish and PyTorch's hardswish
    x = args[0]
    return x * xp.clip(x * (1.0 / 6.0) + 0.5, 0.0, 1.0), None


def _hard_swish_x(xp, g, args, ans, s, a, out):
    # PyTorch's rule: 0 up to -3, x/3 + 1/2 strictly between, 1 from 3 on
    x = args[0]
    slope = xp.where(x <= -3.0, 0.0, xp.where(x < 3.0, x * (1.0 / 3.0) + 0.5, 1.0))
    return g * slope.astype(g.dtype, copy=False)


defvjp("hard_swish", _hard_swish_x)
