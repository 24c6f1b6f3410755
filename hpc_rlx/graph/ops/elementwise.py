"""Elementwise arithmetic: ``scale``, ``neg``, ``sqrt``, ``exp``, ``log``, ``reciprocal``,
``cos``, ``sin``, ``erf``, ``sign`` and ``clip``, then the broadcasting ``add``, ``sub``, ``mul``, ``div``, ``pow``,
``bias_add`` and ``where`` (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.graph.ops import fast_erf
from hpc_rlx.graph.ops.common import finite_number, int_attr, same_float, sum_to, unbroadcast
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import (
    FLOAT,
    INT,
    ShapeError,
    TensorType,
    axis_index,
    broadcast,
    fmt_shape,
    require_float,
)

TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _masked(xp, mask, g):
    """``g`` where ``mask``, else 0, in ``g``'s dtype."""
    return xp.where(mask, g, 0.0).astype(g.dtype, copy=False)


# ---------------------------------------------------------------- unary


def _check_scale(a):
    if isinstance(a["value"], bool) or not isinstance(a["value"], (int, float)) or not math.isfinite(a["value"]):
        raise ShapeError(f"attribute 'value' must be a finite number, got {a['value']!r}")
    return {"value": float(a["value"])}


@defop("scale", same_float, (1, 1), attrs={"value": REQUIRED}, check=_check_scale)
def scale(xp, args, a, ctx):
    return args[0] * a["value"], None


defvjp("scale", lambda xp, g, args, ans, s, a, out: g * a["value"], needs_args=())


@defop("neg", same_float, (1, 1))
def neg(xp, args, a, ctx):
    return -args[0], None


@defop("sqrt", same_float, (1, 1))
def sqrt(xp, args, a, ctx):
    return xp.sqrt(args[0]), None


@defop("exp", same_float, (1, 1))
def exp(xp, args, a, ctx):
    return xp.exp(args[0]), None


@defop("log", same_float, (1, 1))
def log(xp, args, a, ctx):
    return xp.log(args[0]), None


@defop("reciprocal", same_float, (1, 1))
def reciprocal(xp, args, a, ctx):
    return 1.0 / args[0], None


defvjp("neg", lambda xp, g, args, ans, s, a, out: -g, needs_args=())
defvjp("sqrt", lambda xp, g, args, ans, s, a, out: g * 0.5 / ans, needs_args=(), needs_ans=True)
defvjp("exp", lambda xp, g, args, ans, s, a, out: g * ans, needs_args=(), needs_ans=True)
defvjp("log", lambda xp, g, args, ans, s, a, out: g / args[0])
defvjp("reciprocal", lambda xp, g, args, ans, s, a, out: -g * (ans * ans), needs_args=(), needs_ans=True)


@defop("cos", same_float, (1, 1))
def cos(xp, args, a, ctx):
    return xp.cos(args[0]), None


@defop("sin", same_float, (1, 1))
def sin(xp, args, a, ctx):
    return xp.sin(args[0]), None


defvjp("cos", lambda xp, g, args, ans, s, a, out: -g * xp.sin(args[0]))
defvjp("sin", lambda xp, g, args, ans, s, a, out: g * xp.cos(args[0]))


@defop("erf", same_float, (1, 1))
def erf(xp, args, a, ctx):
    return fast_erf.erf(xp, args[0]), None


def _erf_x(xp, g, args, ans, s, a, out):
    x = args[0]
    d = x * x
    xp.negative(d, out=d)
    xp.exp(d, out=d)
    d *= TWO_OVER_SQRT_PI
    d *= g
    return d


defvjp("erf", _erf_x)


def _sign_type(types, attrs):
    """Float or int64 in, the same out: DeBERTa's relative positions are int64."""
    return types[0]


@defop("sign", _sign_type, (1, 1))
def sign(xp, args, a, ctx):
    return xp.sign(args[0]), None


# flat almost everywhere: PyTorch's gradient of sign is zero (int64 inputs get none)
defvjp("sign", lambda xp, g, args, ans, s, a, out: xp.zeros_like(g), needs_args=())


def _clip_check(a):
    lo, hi = finite_number(a["min"], "min", True), finite_number(a["max"], "max", True)
    if lo is not None and hi is not None and lo > hi:
        raise ShapeError(f"clip needs min <= max, got min={lo} max={hi}")
    return {"min": lo, "max": hi}


@defop("clip", same_float, (1, 1), attrs={"min": None, "max": None}, check=_clip_check)
def clip(xp, args, a, ctx):
    x, lo, hi = args[0], a["min"], a["max"]
    if lo is None and hi is None:
        return x, None
    if hi is None:
        return xp.maximum(x, lo), None
    if lo is None:
        return xp.minimum(x, hi), None
    return xp.clip(x, lo, hi), None


def _clip_x(xp, g, args, ans, s, a, out):
    # PyTorch's hardtanh (ReLU6) convention: no gradient at the bounds themselves.
    x, lo, hi = args[0], a["min"], a["max"]
    if lo is None and hi is None:
        return g
    inside = (x > lo) if hi is None else (x < hi) if lo is None else (x > lo) & (x < hi)
    return _masked(xp, inside, g)


defvjp("clip", _clip_x)

# ---------------------------------------------------------------- broadcasting binary


def _binary(types, attrs):
    require_float(types[0], "left operand")
    require_float(types[1], "right operand")
    return TensorType(broadcast(types[0].shape, types[1].shape), FLOAT)


def _exact_binary(types, attrs):
    """add, sub and mul: on float operands, or on two int64 ones (position ids, counts: computed
    at run time, never differentiated)."""
    if types[0].dtype == INT and types[1].dtype == INT:
        return TensorType(broadcast(types[0].shape, types[1].shape), INT)
    return _binary(types, attrs)


def _shapes(args, ctx):
    return (args[0].shape, args[1].shape) if ctx.need_saved else None


@defop("add", _exact_binary, (2, 2))
def add(xp, args, a, ctx):
    return args[0] + args[1], _shapes(args, ctx)


@defop("sub", _exact_binary, (2, 2))
def sub(xp, args, a, ctx):
    return args[0] - args[1], _shapes(args, ctx)


@defop("mul", _exact_binary, (2, 2))
def mul(xp, args, a, ctx):
    return args[0] * args[1], None


@defop("div", _binary, (2, 2))
def div(xp, args, a, ctx):
    return args[0] / args[1], _shapes(args, ctx)


defvjp(
    "add",
    lambda xp, g, args, ans, shapes, a, out: unbroadcast(xp, g, shapes[0]),
    lambda xp, g, args, ans, shapes, a, out: unbroadcast(xp, g, shapes[1]),
    needs_args=(),
)
defvjp(
    "sub",
    lambda xp, g, args, ans, shapes, a, out: unbroadcast(xp, g, shapes[0]),
    lambda xp, g, args, ans, shapes, a, out: -unbroadcast(xp, g, shapes[1]),
    needs_args=(),
)
defvjp(
    "mul",
    lambda xp, g, args, ans, s, a, out: unbroadcast(xp, g * args[1], args[0].shape),
    lambda xp, g, args, ans, s, a, out: unbroadcast(xp, g * args[0], args[1].shape),
)
defvjp(
    "div",
    lambda xp, g, args, ans, shapes, a, out: unbroadcast(xp, g / args[1], shapes[0]),
    lambda xp, g, args, ans, shapes, a, out: unbroadcast(xp, -g * ans / args[1], shapes[1]),
    needs_args=(1,),
    needs_ans=True,
)


def _pow_type(types, a):
    require_float(types[0], "base")
    require_float(types[1], "exponent")
    return TensorType(broadcast(types[0].shape, types[1].shape), FLOAT)


def _scalar_exponent(xp, e):
    """The exponent as a Python float when it is one number on the host, else None. NumPy's
    float32 ``power`` is a scalar loop (x**3 costs ~250x x*x*x on 2M values), so small whole
    and half exponents (GPT-2's x**3, a norm's x**2, a sqrt) are computed by products."""
    if e.size != 1 or not isinstance(e, np.ndarray):
        return None
    v = float(e.reshape(()))
    return v if v in _FAST_EXPONENTS else None


_FAST_EXPONENTS = frozenset((-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 3.0, 4.0))


def _power_by_products(xp, x, v):
    """``x ** v`` for ``v`` in ``_FAST_EXPONENTS`` (a new array)."""
    if v == 0.5:
        return xp.sqrt(x)
    if v == -0.5:
        r = xp.sqrt(x)
        return xp.divide(1.0, r, out=r)
    m = abs(v)
    r = x * x if m >= 2 else x.copy()
    if m >= 3:
        r *= x if m == 3 else r
    return xp.divide(1.0, r, out=r) if v < 0 else r


@defop("pow", _pow_type, (2, 2), arg_names=("a", "b"))
def pow_(xp, args, a, ctx):
    base, e = args
    v = _scalar_exponent(xp, e)
    if v is not None and e.ndim <= base.ndim:
        return _power_by_products(xp, base, v).astype(base.dtype, copy=False), None
    return xp.power(base, e), None


def _pow_a(xp, g, args, ans, s, a, out):
    base, e = args
    v = _scalar_exponent(xp, e)
    if v is not None and e.ndim <= base.ndim and g.shape == base.shape:
        if v == 1.0:
            return g
        if v - 1.0 in _FAST_EXPONENTS:
            d = _power_by_products(xp, base, v - 1.0)
            d *= v
        else:  # -2 and -0.5: v x**(v-1) = v x**v / x
            d = ans * v
            d /= base
        d *= g
        return d
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


def _bias_add_type(types, a):
    x, b = types
    require_float(x, "input")
    require_float(b, "bias")
    ax = axis_index(a["axis"], x.ndim)
    if b.shape != (x.shape[ax],):
        raise ShapeError(f"bias shape {fmt_shape(b.shape)} does not match input dim {ax} of {fmt_shape(x.shape)}")
    return x


@defop("bias_add", _bias_add_type, (2, 2), attrs={"axis": -1}, check=int_attr("axis"))
def bias_add(xp, args, a, ctx):
    x, b = args
    ax = a["axis"] % x.ndim
    return x + b.reshape((-1,) + (1,) * (x.ndim - 1 - ax)), None


def _bias_add_b(xp, g, args, ans, s, a, out):
    ax = a["axis"] % g.ndim
    return sum_to(xp, g, tuple(i for i in range(g.ndim) if i != ax), out)


defvjp("bias_add", lambda xp, g, args, ans, s, a, out: g, _bias_add_b, needs_args=())


def _where_type(types, a):
    cond, x, y = types
    if not (x.dtype == y.dtype == INT):  # int64 branches: ids picked at run time, no gradient
        require_float(x, "first branch")
        require_float(y, "second branch")
    shape = broadcast(broadcast(cond.shape, x.shape, "condition and branch"), y.shape, "branches")
    return TensorType(shape, x.dtype)


@defop("where", _where_type, (3, 3), arg_names=("cond", "a", "b"))
def where(xp, args, a, ctx):
    cond, x, y = args
    mask = cond != 0  # int64 or float condition: nonzero is true
    out = xp.where(mask, x, y)
    return out, ((mask, x.shape, y.shape) if ctx.need_saved else None)


def _where_branch(take):
    def vjp(xp, g, args, ans, saved, a, out):
        mask, shape_a, shape_b = saved
        return unbroadcast(xp, _masked(xp, mask if take else ~mask, g), shape_a if take else shape_b)

    return vjp


defvjp("where", None, _where_branch(True), _where_branch(False), needs_args=())
