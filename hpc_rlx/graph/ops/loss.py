"""Losses and metrics: ``softmax_cross_entropy``, ``mse`` and ``correct_count`` (conventions in
``hpc_rlx.graph.ops``; metrics have no VJP)."""

from __future__ import annotations

from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import (
    FLOAT,
    INT,
    ShapeError,
    TensorType,
    fmt_shape,
    require_float,
    require_int,
)


def _labels_type(types, what):
    logits, labels = types
    require_float(logits, "logits")
    require_int(labels, "labels")
    if logits.ndim < 2 or labels.shape != logits.shape[:-1]:
        raise ShapeError(f"labels {fmt_shape(labels.shape)} must match logits {fmt_shape(logits.shape)} minus the class dim")
    if logits.shape[-1] is None:
        raise ShapeError("the class dim of logits must be known")


def _ce_type(types, a):
    _labels_type(types, "softmax_cross_entropy")
    return TensorType((), FLOAT)


@defop("softmax_cross_entropy", _ce_type, (2, 2), arg_names=("logits", "labels"))
def softmax_cross_entropy(xp, args, a, ctx):
    """Mean over every labelled position of -log softmax(logits)[label], via log-sum-exp."""
    logits, labels = args
    c = logits.shape[-1]
    z = logits.reshape(-1, c)
    lab = labels.reshape(-1)
    n = z.shape[0]
    z = z - z.max(axis=1, keepdims=True)
    picked = z[xp.arange(n), lab]
    e = xp.exp(z, out=z)
    s = e.sum(axis=1)
    loss = xp.asarray((xp.log(s) - picked).sum() * (1.0 / n))
    saved = None
    if ctx.need_saved:
        e /= s[:, None]  # the softmax probabilities, reused in place by the VJP
        saved = (e, lab, logits.shape)
    return loss, saved


def _ce_logits(xp, g, args, ans, saved, a, out):
    probs, labels, shape = saved
    n = probs.shape[0]
    probs[xp.arange(n), labels] -= 1.0  # the saved buffer is private to this node: reuse it
    probs *= g * (1.0 / n)
    return probs.reshape(shape)


defvjp("softmax_cross_entropy", _ce_logits, None, needs_args=())


def _mse_type(types, a):
    p, t = types
    require_float(p, "prediction")
    require_float(t, "target")
    if p.shape != t.shape:
        raise ShapeError(f"prediction {fmt_shape(p.shape)} and target {fmt_shape(t.shape)} differ")
    return TensorType((), FLOAT)


@defop("mse", _mse_type, (2, 2), arg_names=("prediction", "target"))
def mse(xp, args, a, ctx):
    d = args[0] - args[1]
    return xp.asarray((d * d).sum() * (1.0 / d.size)), (d if ctx.need_saved else None)


defvjp(
    "mse",
    lambda xp, g, args, ans, d, a, out: d * (g * (2.0 / d.size)),
    lambda xp, g, args, ans, d, a, out: d * (g * (-2.0 / d.size)),
    needs_args=(),
)


def _correct_type(types, a):
    _labels_type(types, "correct_count")
    return TensorType((), INT)


@defop("correct_count", _correct_type, (2, 2), arg_names=("logits", "labels"))
def correct_count(xp, args, a, ctx):
    logits, labels = args
    return xp.asarray((xp.argmax(logits, axis=-1) == labels).sum()), None
