"""The ops' type rules and forwards, written once against the array module ``xp``: elementwise,
broadcasting, matrix products, shapes and the transformer pieces here; convolution and pooling
in ``ops_spatial``, losses and metrics in ``ops_loss``.

``forward(xp, args, attrs, ctx) -> (out, saved)``: ``saved`` carries what the VJP needs beyond
the arguments and the output (masks, softmax probabilities, im2col columns, shapes) and is only
computed when ``ctx.need_saved`` is set, so evaluation stays lean. Forwards never modify their
arguments: an output may alias an input (reshape, transpose, dropout off), never the reverse.
Scalar constants are Python floats, which keep float32 arrays float32.
"""

from __future__ import annotations

import math

from hpc_rlx.device import backend
from hpc_rlx.graph.registry import REQUIRED, defop
from hpc_rlx.graph.shapes import (
    FLOAT,
    ShapeError,
    TensorType,
    axis_index,
    broadcast,
    fmt_shape,
    known_prod,
    require_float,
    require_int,
    require_ndim,
)

GELU_C = math.sqrt(2.0 / math.pi)
SQRT_HALF = math.sqrt(0.5)


def _same(types, attrs):
    require_float(types[0], "input")
    return types[0]


# ---------------------------------------------------------------- elementwise


@defop("relu", _same, (1, 1))
def relu(xp, args, a, ctx):
    return xp.maximum(args[0], 0.0), None


@defop("tanh", _same, (1, 1))
def tanh(xp, args, a, ctx):
    return xp.tanh(args[0]), None


@defop("sigmoid", _same, (1, 1))
def sigmoid(xp, args, a, ctx):
    x = args[0]
    e = xp.exp(-xp.abs(x))  # never overflows
    out = 1.0 / (1.0 + e)
    return xp.where(x >= 0, out, e * out), None


def _check_gelu(a):
    if a["approximate"] not in ("tanh", "none"):
        raise ShapeError(f"gelu supports approximate='tanh' or 'none', got {a['approximate']!r}")
    return a


@defop("gelu", _same, (1, 1), attrs={"approximate": "tanh"}, check=_check_gelu)
def gelu(xp, args, a, ctx):
    # "tanh": the GPT-2 form (PyTorch approximate="tanh"); "none": the exact x * Phi(x).
    # Either way the saved t is the bracket in 0.5 x (1 + t), which the VJP reuses.
    x = args[0]
    if a["approximate"] == "none":
        t = backend.erf(xp, x * SQRT_HALF)
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


def _check_scale(a):
    if isinstance(a["value"], bool) or not isinstance(a["value"], (int, float)) or not math.isfinite(a["value"]):
        raise ShapeError(f"attribute 'value' must be a finite number, got {a['value']!r}")
    return {"value": float(a["value"])}


@defop("scale", _same, (1, 1), attrs={"value": REQUIRED}, check=_check_scale)
def scale(xp, args, a, ctx):
    return args[0] * a["value"], None


def _check_dropout(a):
    p = a["p"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ShapeError(f"attribute 'p' must be a probability in [0, 1), got {p!r}")
    return {"p": float(p)}


@defop("dropout", _same, (1, 1), attrs={"p": REQUIRED}, check=_check_dropout)
def dropout(xp, args, a, ctx):
    x, p = args[0], a["p"]
    if not ctx.train or p == 0.0:
        return x, None
    if ctx.seed is None:
        raise ValueError(f"dropout node '{ctx.node}' runs in train mode and needs a seed")
    u = backend.uniform(xp, backend.derive_seed(ctx.seed, ctx.index), x.shape, x.dtype)
    mask = (u >= p).astype(x.dtype)
    mask *= 1.0 / (1.0 - p)
    return x * mask, mask


# ---------------------------------------------------------------- broadcasting binary


def _binary(types, attrs):
    require_float(types[0], "left operand")
    require_float(types[1], "right operand")
    return TensorType(broadcast(types[0].shape, types[1].shape), FLOAT)


def _shapes(args, ctx):
    return (args[0].shape, args[1].shape) if ctx.need_saved else None


@defop("add", _binary, (2, 2))
def add(xp, args, a, ctx):
    return args[0] + args[1], _shapes(args, ctx)


@defop("sub", _binary, (2, 2))
def sub(xp, args, a, ctx):
    return args[0] - args[1], _shapes(args, ctx)


@defop("mul", _binary, (2, 2))
def mul(xp, args, a, ctx):
    return args[0] * args[1], None


@defop("div", _binary, (2, 2))
def div(xp, args, a, ctx):
    return args[0] / args[1], _shapes(args, ctx)


def _bias_add_type(types, a):
    x, b = types
    require_float(x, "input")
    require_float(b, "bias")
    ax = axis_index(a["axis"], x.ndim)
    if b.shape != (x.shape[ax],):
        raise ShapeError(f"bias shape {fmt_shape(b.shape)} does not match input dim {ax} of {fmt_shape(x.shape)}")
    return x


def _int_attr(name):
    def check(a):
        if isinstance(a[name], bool) or not isinstance(a[name], int):
            raise ShapeError(f"attribute '{name}' must be an int, got {a[name]!r}")
        return a

    return check


@defop("bias_add", _bias_add_type, (2, 2), attrs={"axis": -1}, check=_int_attr("axis"))
def bias_add(xp, args, a, ctx):
    x, b = args
    ax = a["axis"] % x.ndim
    return x + b.reshape((-1,) + (1,) * (x.ndim - 1 - ax)), None


# ---------------------------------------------------------------- matrix products


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


# ---------------------------------------------------------------- shape ops


def _flatten_type(types, a):
    x = types[0]
    if x.ndim < 1:
        raise ShapeError("cannot flatten a scalar")
    if None in x.shape[1:]:
        raise ShapeError("only the leading (batch) dim may be unknown")
    return TensorType((x.shape[0], known_prod(x.shape[1:])), x.dtype)


@defop("flatten", _flatten_type, (1, 1))
def flatten(xp, args, a, ctx):
    x = args[0]
    return x.reshape(x.shape[0], -1), (x.shape if ctx.need_saved else None)


def _reshape_check(a):
    s = a["shape"]
    if not isinstance(s, (list, tuple)) or not all(
        d is None or (isinstance(d, int) and not isinstance(d, bool) and (d >= 1 or d == -1)) for d in s
    ):
        raise ShapeError(f"attribute 'shape' must list positive ints, -1 or null, got {s!r}")
    if sum(d == -1 for d in s) > 1:
        raise ShapeError(f"attribute 'shape' may hold at most one -1, got {s!r}")
    if any(d is None for d in s[1:]):
        raise ShapeError(f"only the first entry of 'shape' may be null (the batch dim), got {s!r}")
    return {"shape": tuple(s)}


def _reshape_type(types, a):
    x, target = types[0], a["shape"]
    if None in x.shape[1:]:
        raise ShapeError("only the leading (batch) dim may be unknown")
    batched = len(x.shape) > 0 and x.shape[0] is None
    if batched != (len(target) > 0 and target[0] is None):
        raise ShapeError(f"reshape of {fmt_shape(x.shape)} to {list(target)}: the batch dim must stay first (null)")
    size = known_prod(x.shape)
    fixed = known_prod(d for d in target if d not in (None, -1))
    if -1 in target:
        if size % fixed:
            raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} to {list(target)}")
        target = tuple(size // fixed if d == -1 else d for d in target)
    elif fixed != size:
        raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} ({size} per sample) to {list(target)}")
    return TensorType(tuple(target), x.dtype)


@defop("reshape", _reshape_type, (1, 1), attrs={"shape": REQUIRED}, check=_reshape_check)
def reshape(xp, args, a, ctx):
    x = args[0]
    target = tuple(x.shape[0] if d is None else d for d in a["shape"])
    return x.reshape(target), (x.shape if ctx.need_saved else None)


def _transpose_check(a):
    axes = a["axes"]
    if not isinstance(axes, (list, tuple)) or sorted(axes) != list(range(len(axes))):
        raise ShapeError(f"attribute 'axes' must be a permutation of 0..n-1, got {axes!r}")
    return {"axes": tuple(axes)}


def _transpose_type(types, a):
    x, axes = types[0], a["axes"]
    if len(axes) != x.ndim:
        raise ShapeError(f"axes {list(axes)} do not match the {x.ndim} dims of {fmt_shape(x.shape)}")
    return TensorType(tuple(x.shape[i] for i in axes), x.dtype)


@defop("transpose", _transpose_type, (1, 1), attrs={"axes": REQUIRED}, check=_transpose_check)
def transpose(xp, args, a, ctx):
    return args[0].transpose(a["axes"]), None


def _axes_check(a):
    axes = a["axes"]
    if axes is not None and (
        not isinstance(axes, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in axes)
    ):
        raise ShapeError(f"attribute 'axes' must be null or a list of ints, got {axes!r}")
    if not isinstance(a["keepdims"], bool):
        raise ShapeError(f"attribute 'keepdims' must be true or false, got {a['keepdims']!r}")
    return {"axes": None if axes is None else tuple(axes), "keepdims": a["keepdims"]}


def _reduce_type(types, a):
    x = types[0]
    require_float(x, "input")
    axes = range(x.ndim) if a["axes"] is None else [axis_index(i, x.ndim) for i in a["axes"]]
    axes = set(axes)
    if a["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return TensorType(shape, FLOAT)


_REDUCE_ATTRS = {"axes": None, "keepdims": False}


@defop("sum", _reduce_type, (1, 1), attrs=_REDUCE_ATTRS, check=_axes_check)
def sum_(xp, args, a, ctx):
    x = args[0]
    return xp.asarray(x.sum(axis=a["axes"], keepdims=a["keepdims"])), (x.shape if ctx.need_saved else None)


@defop("mean", _reduce_type, (1, 1), attrs=_REDUCE_ATTRS, check=_axes_check)
def mean(xp, args, a, ctx):
    x = args[0]
    return xp.asarray(x.mean(axis=a["axes"], keepdims=a["keepdims"])), (x.shape if ctx.need_saved else None)


# ---------------------------------------------------------------- transformer pieces


def _embedding_type(types, a):
    ids, table = types
    require_int(ids, "ids")
    require_float(table, "table")
    require_ndim(table, 2, "table (vocab, dim)")
    return TensorType(ids.shape + (table.shape[1],), FLOAT)


@defop("embedding", _embedding_type, (2, 2), arg_names=("ids", "table"))
def embedding(xp, args, a, ctx):
    ids, table = args
    return table[ids], None


def _eps_check(a):
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ShapeError(f"attribute 'eps' must be a positive number, got {eps!r}")
    return {"eps": float(eps)}


def _layer_norm_type(types, a):
    x = types[0]
    require_float(x, "input")
    if x.ndim < 1 or x.shape[-1] is None:
        raise ShapeError(f"layer_norm needs a known last dim, got {fmt_shape(x.shape)}")
    for t, what in zip(types[1:], ("gamma", "beta")):
        require_float(t, what)
        if t.shape != (x.shape[-1],):
            raise ShapeError(f"{what} shape {fmt_shape(t.shape)} must be ({x.shape[-1]},)")
    return x


@defop("layer_norm", _layer_norm_type, (3, 3), attrs={"eps": 1e-5}, check=_eps_check,
       arg_names=("x", "gamma", "beta"))
def layer_norm(xp, args, a, ctx):
    x, gamma, beta = args
    xc = x - x.mean(axis=-1, keepdims=True)
    var = (xc * xc).mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + a["eps"])
    xhat = xc
    xhat *= rstd
    out = xhat * gamma
    out += beta
    return out, ((xhat, rstd) if ctx.need_saved else None)


def _softmax_type(types, a):
    require_float(types[0], "input")
    axis_index(a["axis"], types[0].ndim)
    return types[0]


@defop("softmax", _softmax_type, (1, 1), attrs={"axis": -1}, check=_int_attr("axis"))
def softmax(xp, args, a, ctx):
    x, ax = args[0], a["axis"]
    e = x - x.max(axis=ax, keepdims=True)
    xp.exp(e, out=e)
    e /= e.sum(axis=ax, keepdims=True)
    return e, None


def _causal_type(types, a):
    x = types[0]
    require_float(x, "input")
    if x.ndim < 2 or x.shape[-1] != x.shape[-2] or x.shape[-1] is None:
        raise ShapeError(f"causal_mask needs (..., T, T) scores, got {fmt_shape(x.shape)}")
    return x


def _fill_check(a):
    f = a["fill"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
        raise ShapeError(f"attribute 'fill' must be a finite number, got {f!r}")
    return {"fill": float(f)}


def causal_mask_array(xp, t: int):
    """True above the diagonal: key positions a query may not attend to."""
    return xp.triu(xp.ones((t, t), dtype=bool), 1)


@defop("causal_mask", _causal_type, (1, 1), attrs={"fill": -1e9}, check=_fill_check)
def causal_mask(xp, args, a, ctx):
    # A large finite fill rather than -inf: softmax still gives exact zeros, and no
    # inf - inf = nan can appear in anything downstream.
    x = args[0]
    mask = causal_mask_array(xp, x.shape[-1])
    return xp.where(mask, a["fill"], x).astype(x.dtype, copy=False), (mask if ctx.need_saved else None)
