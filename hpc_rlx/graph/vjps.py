"""The VJP table: for each op, one cotangent function per argument.

``fn(xp, g, args, ans, saved, attrs, out) -> array`` returns the cotangent of one argument
given the cotangent ``g`` of the op's output. ``out`` is None or a preallocated array shaped
like that argument (a parameter's gradient view): GEMM-shaped rules write straight into it.
Rules never modify ``g`` or ``args`` (they may be shared); the executor copies the result into
``out`` when a rule ignores it. ``unbroadcast`` is the single place broadcasting is undone.
"""

from __future__ import annotations

import math

from hpc_rlx.device import backend
from hpc_rlx.graph import conv
from hpc_rlx.graph.ops import GELU_C
from hpc_rlx.graph.registry import defvjp

INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def unbroadcast(xp, g, shape):
    """Sum ``g`` down to ``shape``: over leading dims it gained and dims that were 1."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1
    )
    return g.sum(axis=axes).reshape(shape)


def _sum_to(xp, g, axes, out):
    """``g.sum(axes)`` written into ``out`` when one is given."""
    if out is not None:
        xp.sum(g, axis=axes, out=out)
        return out
    return g.sum(axis=axes)


# ---------------------------------------------------------------- elementwise

defvjp("relu", lambda xp, g, args, ans, s, a, out: g * (ans > 0), needs_args=(), needs_ans=True)
defvjp("tanh", lambda xp, g, args, ans, s, a, out: g * (1.0 - ans * ans), needs_args=(), needs_ans=True)
defvjp("sigmoid", lambda xp, g, args, ans, s, a, out: g * (ans * (1.0 - ans)), needs_args=(), needs_ans=True)
defvjp("scale", lambda xp, g, args, ans, s, a, out: g * a["value"], needs_args=())
defvjp("dropout", lambda xp, g, args, ans, mask, a, out: g if mask is None else g * mask, needs_args=())


def _gelu_x(xp, g, args, ans, t, a, out):
    x = args[0]
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

# ---------------------------------------------------------------- broadcasting binary

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


def _bias_add_b(xp, g, args, ans, s, a, out):
    ax = a["axis"] % g.ndim
    return _sum_to(xp, g, tuple(i for i in range(g.ndim) if i != ax), out)


defvjp("bias_add", lambda xp, g, args, ans, s, a, out: g, _bias_add_b, needs_args=())

# ---------------------------------------------------------------- matrix products


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
    return _sum_to(xp, g.reshape(-1, g.shape[-1]), 0, out)


defvjp("linear", _linear_x, _linear_w, _linear_b, needs_args=(0, 1))

# ---------------------------------------------------------------- convolution and pooling


def _conv_x(xp, g, args, ans, saved, a, out):
    return conv.conv2d_grad_x(xp, g, args[1], saved[1], a["stride"], a["padding"], a["dilation"], a["groups"])


def _conv_w(xp, g, args, ans, saved, a, out):
    return conv.conv2d_grad_w(xp, g, saved[0], args[1].shape, out, a["groups"])


def _conv_b(xp, g, args, ans, saved, a, out):
    return conv.conv2d_grad_b(xp, g, out)


defvjp("conv2d", _conv_x, _conv_w, _conv_b, needs_args=(1,))
defvjp(
    "max_pool2d",
    lambda xp, g, args, ans, saved, a, out: conv.max_pool_grad(
        xp, g, saved[0], saved[1], a["kernel"], a["stride"], a["padding"], a["dilation"]
    ),
    needs_args=(),
)
defvjp(
    "avg_pool2d",
    lambda xp, g, args, ans, shape, a, out: conv.avg_pool_grad(xp, g, shape, a["kernel"], a["stride"], a["padding"],
                                                               a["count_include_pad"]),
    needs_args=(),
)

# ---------------------------------------------------------------- shape ops

defvjp("flatten", lambda xp, g, args, ans, shape, a, out: g.reshape(shape), needs_args=())
defvjp("reshape", lambda xp, g, args, ans, shape, a, out: g.reshape(shape), needs_args=())


def _transpose_x(xp, g, args, ans, s, a, out):
    axes = a["axes"]
    inverse = [0] * len(axes)
    for i, ax in enumerate(axes):
        inverse[ax] = i
    return g.transpose(inverse)


defvjp("transpose", _transpose_x, needs_args=())


def _expand(xp, g, shape, a):
    """Broadcast a reduction's cotangent back over the reduced axes."""
    nd = len(shape)
    axes = range(nd) if a["axes"] is None else sorted(i % nd for i in a["axes"])
    if not a["keepdims"]:
        g = g.reshape(tuple(1 if i in axes else d for i, d in enumerate(shape)))
    return xp.broadcast_to(g, shape)


def _mean_x(xp, g, args, ans, shape, a, out):
    nd = len(shape)
    axes = range(nd) if a["axes"] is None else {i % nd for i in a["axes"]}
    count = 1
    for i in axes:
        count *= shape[i]
    return _expand(xp, g * (1.0 / count), shape, a)


defvjp("sum", lambda xp, g, args, ans, shape, a, out: _expand(xp, g, shape, a), needs_args=())
defvjp("mean", _mean_x, needs_args=())

# ---------------------------------------------------------------- transformer pieces


def _embedding_table(xp, g, args, ans, s, a, out):
    ids, table = args
    dest = out if out is not None else xp.empty(table.shape, dtype=g.dtype)
    dest[...] = 0
    backend.scatter_add(xp, dest, ids.reshape(-1), g.reshape(-1, table.shape[1]))
    return dest


defvjp("embedding", None, _embedding_table)


def _layer_norm_x(xp, g, args, ans, saved, a, out):
    xhat, rstd = saved
    gx = g * args[1]
    m1 = gx.mean(axis=-1, keepdims=True)
    m2 = (gx * xhat).mean(axis=-1, keepdims=True)
    gx -= m1
    gx -= xhat * m2
    gx *= rstd
    return gx


def _layer_norm_gamma(xp, g, args, ans, saved, a, out):
    gx = g * saved[0]
    return _sum_to(xp, gx.reshape(-1, gx.shape[-1]), 0, out)


def _layer_norm_beta(xp, g, args, ans, saved, a, out):
    return _sum_to(xp, g.reshape(-1, g.shape[-1]), 0, out)


defvjp("layer_norm", _layer_norm_x, _layer_norm_gamma, _layer_norm_beta, needs_args=(1,))


def _softmax_x(xp, g, args, ans, s, a, out):
    gx = g * ans
    dot = gx.sum(axis=a["axis"], keepdims=True)
    gx = g - dot
    gx *= ans
    return gx


defvjp("softmax", _softmax_x, needs_args=(), needs_ans=True)
defvjp("causal_mask", lambda xp, g, args, ans, mask, a, out: xp.where(mask, 0.0, g).astype(g.dtype, copy=False),
       needs_args=())

# ---------------------------------------------------------------- losses (metrics have no VJP)


def _ce_logits(xp, g, args, ans, saved, a, out):
    probs, labels, shape = saved
    n = probs.shape[0]
    probs[xp.arange(n), labels] -= 1.0  # the saved buffer is private to this node: reuse it
    probs *= g * (1.0 / n)
    return probs.reshape(shape)


defvjp("softmax_cross_entropy", _ce_logits, None, needs_args=())
defvjp(
    "mse",
    lambda xp, g, args, ans, d, a, out: d * (g * (2.0 / d.size)),
    lambda xp, g, args, ans, d, a, out: d * (g * (-2.0 / d.size)),
    needs_args=(),
)
