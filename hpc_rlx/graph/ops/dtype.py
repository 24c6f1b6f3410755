"""Values of a chosen dtype: ``cast`` and ``constant`` (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import DTYPES, FLOAT, INT, ShapeError, TensorType


def compute_dtype(xp, ctx):
    """The executor's float dtype, for values an op creates rather than derives from a float
    argument (a cast from int64, a constant)."""
    return ctx.dtype


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


def _cast_x(xp, g, args, ans, s, a, out):
    # Only float -> float is on a differentiable path (an int64 result is never differentiated).
    return g


defvjp("cast", _cast_x, needs_args=())


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
