"""Elementwise math, ``where``, ``cast`` and ``constant``: type rules and forwards (see ``ops`` for
the conventions; the VJPs are in ``vjps_math``). These are the pieces an imported ONNX model is
made of beyond the built-in layers.
"""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.device import backend
from hpc_rlx.graph.registry import REQUIRED, defop
from hpc_rlx.graph.shapes import (
    DTYPES,
    FLOAT,
    INT,
    ShapeError,
    TensorType,
    broadcast,
    require_float,
)


def compute_dtype(xp, ctx):
    """The executor's float dtype, for values an op creates rather than derives from a float
    argument (a cast from int64, a constant)."""
    return ctx.dtype


def _same(types, attrs):
    require_float(types[0], "input")
    return types[0]


def _number(value, name, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ShapeError(f"attribute '{name}' must be a finite number{' or null' if allow_none else ''}, got {value!r}")
    return float(value)


# ---------------------------------------------------------------- unary


@defop("erf", _same, (1, 1))
def erf(xp, args, a, ctx):
    return backend.erf(xp, args[0]), None


@defop("leaky_relu", _same, (1, 1), attrs={"alpha": 0.01}, check=lambda a: {"alpha": _number(a["alpha"], "alpha")})
def leaky_relu(xp, args, a, ctx):
    x = args[0]
    return xp.where(x > 0, x, x * a["alpha"]), None


@defop("neg", _same, (1, 1))
def neg(xp, args, a, ctx):
    return -args[0], None


@defop("sqrt", _same, (1, 1))
def sqrt(xp, args, a, ctx):
    return xp.sqrt(args[0]), None


@defop("exp", _same, (1, 1))
def exp(xp, args, a, ctx):
    return xp.exp(args[0]), None


@defop("log", _same, (1, 1))
def log(xp, args, a, ctx):
    return xp.log(args[0]), None


@defop("reciprocal", _same, (1, 1))
def reciprocal(xp, args, a, ctx):
    return 1.0 / args[0], None


def _clip_check(a):
    lo, hi = _number(a["min"], "min", True), _number(a["max"], "max", True)
    if lo is not None and hi is not None and lo > hi:
        raise ShapeError(f"clip needs min <= max, got min={lo} max={hi}")
    return {"min": lo, "max": hi}


@defop("clip", _same, (1, 1), attrs={"min": None, "max": None}, check=_clip_check)
def clip(xp, args, a, ctx):
    x, lo, hi = args[0], a["min"], a["max"]
    if lo is None and hi is None:
        return x, None
    if hi is None:
        return xp.maximum(x, lo), None
    if lo is None:
        return xp.minimum(x, hi), None
    return xp.clip(x, lo, hi), None


# ---------------------------------------------------------------- broadcasting


def _pow_type(types, a):
    require_float(types[0], "base")
    require_float(types[1], "exponent")
    return TensorType(broadcast(types[0].shape, types[1].shape), FLOAT)


@defop("pow", _pow_type, (2, 2), arg_names=("a", "b"))
def pow_(xp, args, a, ctx):
    return xp.power(args[0], args[1]), None


def _where_type(types, a):
    cond, x, y = types
    require_float(x, "first branch")
    require_float(y, "second branch")
    shape = broadcast(broadcast(cond.shape, x.shape, "condition and branch"), y.shape, "branches")
    return TensorType(shape, FLOAT)


@defop("where", _where_type, (3, 3), arg_names=("cond", "a", "b"))
def where(xp, args, a, ctx):
    cond, x, y = args
    mask = cond != 0  # int64 or float condition: nonzero is true
    out = xp.where(mask, x, y)
    return out, ((mask, x.shape, y.shape) if ctx.need_saved else None)


# ---------------------------------------------------------------- dtypes and constants


def _cast_check(a):
    if a["to"] not in DTYPES:
        raise ShapeError(f"attribute 'to' must be one of {list(DTYPES)}, got {a['to']!r}")
    return a


@defop("cast", lambda types, a: TensorType(types[0].shape, a["to"]), (1, 1), attrs={"to": REQUIRED},
       check=_cast_check)
def cast(xp, args, a, ctx):
    x = args[0]
    if a["to"] == INT:
        # ONNX casts float to int by truncation toward zero, as astype does
        return (x if x.dtype == xp.int64 else x.astype(xp.int64)), None
    if x.dtype.kind == "f":
        return x, None  # float stays the compute dtype
    return x.astype(compute_dtype(xp, ctx)), None


def _flatten_value(value, where="value"):
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_flatten_value(v, where))
        return out
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ShapeError(f"attribute '{where}' must hold finite numbers, got {value!r}")
    return [value]


def _constant_check(a):
    shape, dtype = a["shape"], a["dtype"]
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ShapeError(f"attribute 'shape' must list non-negative ints, got {shape!r}")
    if dtype not in DTYPES:
        raise ShapeError(f"attribute 'dtype' must be one of {list(DTYPES)}, got {dtype!r}")
    flat = _flatten_value(a["value"])
    size = math.prod(shape)
    if len(flat) != size:
        raise ShapeError(f"attribute 'value' holds {len(flat)} numbers but shape {list(shape)} needs {size}")
    if dtype == INT and any(float(v) != int(v) for v in flat):
        raise ShapeError("an int64 constant must hold integers")
    # Converted once at load: the forward only copies it to the executor's module and dtype.
    host = np.array(flat, dtype=np.float64 if dtype == FLOAT else np.int64).reshape(shape)
    host.setflags(write=False)  # shared by every step (NumPy's asarray does not copy it)
    return {"value": host, "dtype": dtype, "shape": tuple(shape)}


@defop("constant", lambda types, a: TensorType(a["shape"], a["dtype"]), (0, 0),
       attrs={"value": REQUIRED, "dtype": FLOAT, "shape": REQUIRED}, check=_constant_check)
def constant(xp, args, a, ctx):
    dtype = compute_dtype(xp, ctx) if a["dtype"] == FLOAT else xp.int64
    return xp.asarray(a["value"], dtype=dtype), None

