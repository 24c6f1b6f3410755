"""Matrix products: ``matmul`` and ``linear`` (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

from hpc_rlx.graph.ops.common import sum_to, unbroadcast
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType, broadcast, fmt_shape, require_float, require_ndim


def _matmul_type(types, a):
    x, y = types
    require_float(x, "left operand")
    require_float(y, "right operand")
    if x.ndim < 2 or y.ndim < 2:
        raise ShapeError(f"matmul needs operands of at least 2 dims, got {fmt_shape(x.shape)} and {fmt_shape(y.shape)}")
    if x.shape[-1] != y.shape[-2]:
        raise ShapeError(f"inner dims differ: {fmt_shape(x.shape)} @ {fmt_shape(y.shape)}")
    batch = broadcast(x.shape[:-2], y.shape[:-2], "batch")
    return TensorType(batch + (x.shape[-2], y.shape[-1]), FLOAT)


@defop("matmul", _matmul_type, (2, 2))
def matmul(xp, args, a, ctx):
    x, y = args
    if y.ndim == 2 and x.ndim > 2:  # one GEMM instead of a loop over the batch dims
        return xp.matmul(x.reshape(-1, x.shape[-1]), y).reshape(x.shape[:-1] + (y.shape[1],)), None
    return xp.matmul(x, y), None


def _matmul_a(xp, g, args, ans, s, a, out):
    x, y = args
    if y.ndim == 2 and g.ndim > 2:
        return xp.matmul(g.reshape(-1, g.shape[-1]), y.T).reshape(x.shape)
    return unbroadcast(xp, xp.matmul(g, xp.swapaxes(y, -1, -2)), x.shape)


def _matmul_b(xp, g, args, ans, s, a, out):
    x, y = args
    if y.ndim == 2:  # collapse every batch dim into one GEMM that lands in `out`
        x2 = x.reshape(-1, x.shape[-1]).T
        g2 = g.reshape(-1, g.shape[-1])
        return xp.matmul(x2, g2, out=out) if out is not None else xp.matmul(x2, g2)
    return unbroadcast(xp, xp.matmul(xp.swapaxes(x, -1, -2), g), y.shape)


defvjp("matmul", _matmul_a, _matmul_b)


def _linear_check(a):
    if a["weight_layout"] not in ("in_out", "out_in"):
        raise ShapeError(f"attribute 'weight_layout' must be 'in_out' or 'out_in', got {a['weight_layout']!r}")
    return a


def _linear_type(types, a):
    x, w = types[0], types[1]
    require_float(x, "input")
    require_float(w, "weight")
    require_ndim(w, 2, "weight")
    k, n = w.shape if a["weight_layout"] == "in_out" else w.shape[::-1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ShapeError(f"input {fmt_shape(x.shape)} does not match weight {fmt_shape(w.shape)} "
                         f"({a['weight_layout'].replace('_', ', ')})")
    if len(types) == 3:
        require_float(types[2], "bias")
        if types[2].shape != (n,):
            raise ShapeError(f"bias shape {fmt_shape(types[2].shape)} must be ({n},)")
    return TensorType(x.shape[:-1] + (n,), FLOAT)


@defop("linear", _linear_type, (2, 3), attrs={"weight_layout": "in_out"}, check=_linear_check,
       arg_names=("x", "weight", "bias"))
def linear(xp, args, a, ctx):
    x, w = args[0], args[1]
    if a["weight_layout"] == "out_in":
        w = w.T  # PyTorch's (out, in): a transposed view, which the GEMM reads as is
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    out = xp.matmul(x2, w)
    if len(args) == 3:
        out += args[2]
    return (out if x.ndim == 2 else out.reshape(x.shape[:-1] + (w.shape[1],))), None


def _linear_x(xp, g, args, ans, s, a, out):
    x, w = args[0], args[1]
    g2 = g.reshape(-1, g.shape[-1])
    if x.ndim == 2 and x.shape[0] > 1 and x.strides[0] == x.itemsize:
        # x is a batch-last array seen flat (a convolution's output after flatten): answer in
        # the same layout, so the flatten's cotangent reaches the convolution without a copy
        return xp.matmul(w if a["weight_layout"] == "in_out" else w.T, g2.T).T
    return xp.matmul(g2, w.T if a["weight_layout"] == "in_out" else w).reshape(x.shape)


def _linear_w(xp, g, args, ans, s, a, out):
    x2 = args[0].reshape(-1, args[0].shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    left, right = (x2.T, g2) if a["weight_layout"] == "in_out" else (g2.T, x2)
    return xp.matmul(left, right, out=out) if out is not None else xp.matmul(left, right)


def _linear_b(xp, g, args, ans, s, a, out):
    return sum_to(xp, g.reshape(-1, g.shape[-1]), 0, out)


defvjp("linear", _linear_x, _linear_w, _linear_b, needs_args=(0, 1))
