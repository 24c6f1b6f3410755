"""Losses and metrics: ``softmax_cross_entropy``, ``mse`` and ``correct_count`` (conventions in
``hpc_rlx.graph.ops``; metrics have no VJP), and the counts the dense metrics are built from.

Cross-entropy takes the class axis from the shapes: logits ``(B, C, *S)`` against labels
``(B, *S)`` (PyTorch's images and volumes: class axis 1) or ``(B, *S, C)`` against ``(B, *S)``
(a language model: class axis last); ``(B, C)`` against ``(B,)`` is both. Where the shapes fit
both (``(B, 4, 4)`` against ``(B, 4)``) the ``axis`` attribute (1 or -1) decides, and without it
the type check fails saying so. ``weights`` (one per class) and ``ignore_index`` (a label left
out) follow PyTorch's ``cross_entropy(weight=, ignore_index=, reduction="mean")``: the sum of
``weights[label] * nll`` over the labelled positions divided by the sum of their weights
(``label_weight``). A batch without a labelled position has loss 0 and a zero gradient (PyTorch
gives NaN): the mean over a global batch is the ratio of sums, which the runtime forms.
"""

from __future__ import annotations

import numpy as np

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


def class_axis(logits_shape, labels_shape, axis=None) -> int:
    """The class axis of ``logits_shape`` (1 or its last, as a non-negative index) against
    labels of ``labels_shape``; ShapeError where the shapes fit neither, or both and ``axis``
    is None."""
    logits_shape, labels_shape = tuple(logits_shape), tuple(labels_shape)
    last = len(logits_shape) - 1
    first_fits = last >= 1 and labels_shape == logits_shape[:1] + logits_shape[2:]
    last_fits = last >= 1 and labels_shape == logits_shape[:-1]
    if axis is not None:
        want = 1 if axis == 1 else last
        if (first_fits if want == 1 else last_fits):
            return want
        raise ShapeError(f"labels {fmt_shape(labels_shape)} do not fit logits {fmt_shape(logits_shape)} "
                         f"with the classes on axis {axis}")
    if first_fits and last_fits and last > 1:
        raise ShapeError(f"logits {fmt_shape(logits_shape)} against labels {fmt_shape(labels_shape)} fit "
                         f"the classes on axis 1 (images, volumes) and on the last axis (sequences) alike: "
                         f"set the class axis (attribute axis=1 or axis=-1; model.class_axis in a config)")
    if last_fits:
        return last
    if first_fits:
        return 1
    raise ShapeError(f"labels {fmt_shape(labels_shape)} must match logits {fmt_shape(logits_shape)} minus the "
                     f"class dim: (B, C, *S) against (B, *S), or (B, *S, C) against (B, *S)")


def _check_attrs(a):
    axis, weights, ignore = a["axis"], a["weights"], a["ignore_index"]
    if axis not in (None, 1, -1):
        raise ShapeError(f"axis must be 1, -1 or null, got {axis!r}")
    if weights is not None and not (isinstance(weights, list) and weights and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights)):
        raise ShapeError(f"weights must be a non-empty list of non-negative numbers, got {weights!r}")
    if ignore is not None and (isinstance(ignore, bool) or not isinstance(ignore, int)):
        raise ShapeError(f"ignore_index must be an integer or null, got {ignore!r}")
    return a


LABEL_ATTRS = {"axis": None, "weights": None, "ignore_index": None}


def _labels_type(types, a):
    logits, labels = types
    require_float(logits, "logits")
    require_int(labels, "labels")
    if logits.ndim < 2:
        raise ShapeError(f"logits {fmt_shape(logits.shape)} need a class dim")
    axis = class_axis(logits.shape, labels.shape, a["axis"])
    classes = logits.shape[axis]
    if classes is None:
        raise ShapeError("the class dim of logits must be known")
    if a["weights"] is not None and len(a["weights"]) != classes:
        raise ShapeError(f"{len(a['weights'])} class weights for {classes} classes")


def _ce_type(types, a):
    _labels_type(types, a)
    return TensorType((), FLOAT)


def _rows(xp, logits, labels, a):
    """(N, C) logits with the classes last (a copy where they are on axis 1) and (N,) labels."""
    axis = class_axis(logits.shape, labels.shape, a["axis"])
    c = logits.shape[axis]
    if axis != logits.ndim - 1:
        logits = xp.moveaxis(logits, axis, -1)
    return logits.reshape(-1, c), labels.reshape(-1), axis


def label_weight(xp, labels, weights=None, ignore_index=None, dtype=np.float64):
    """(per-position weight, their sum) of integer ``labels``: ``weights[label]`` (1 without
    weights), 0 where the label is ``ignore_index``. The sum is the mean's denominator."""
    lab = labels.reshape(-1)
    keep = None if ignore_index is None else lab != ignore_index
    if weights is None:
        w = xp.ones(lab.shape, dtype=dtype) if keep is None else keep.astype(dtype)
    else:
        safe = lab if keep is None else xp.where(keep, lab, 0)
        w = xp.asarray(weights, dtype=dtype)[safe]
        if keep is not None:
            w *= keep
    return w, w.sum()


def weighted(a) -> bool:
    return a["weights"] is not None or a["ignore_index"] is not None


@defop("softmax_cross_entropy", _ce_type, (2, 2), attrs=LABEL_ATTRS, check=_check_attrs,
       arg_names=("logits", "labels"))
def softmax_cross_entropy(xp, args, a, ctx):
    """The mean over every labelled position of -log softmax(logits)[label], via log-sum-exp;
    with weights or an ignored label, PyTorch's weighted mean."""
    logits, labels = args
    z, lab, axis = _rows(xp, logits, labels, a)
    n = z.shape[0]
    z = z - z.max(axis=1, keepdims=True)
    if not weighted(a):
        picked = z[xp.arange(n), lab]
        e = xp.exp(z, out=z)
        s = e.sum(axis=1)
        loss = xp.asarray((xp.log(s) - picked).sum() * (1.0 / n))
        w = None
    else:
        w, total = label_weight(xp, lab, a["weights"], a["ignore_index"], z.dtype)
        safe = lab if a["ignore_index"] is None else xp.where(lab != a["ignore_index"], lab, 0)
        picked = z[xp.arange(n), safe]
        e = xp.exp(z, out=z)
        s = e.sum(axis=1)
        total = float(total)
        lab = safe
        loss = xp.asarray(((xp.log(s) - picked) * w).sum() / total if total > 0 else 0.0, dtype=z.dtype)
        w = w / total if total > 0 else w * 0.0     # each row's share of the mean
    saved = None
    if ctx.need_saved:
        e /= s[:, None]  # the softmax probabilities, reused in place by the VJP
        saved = (e, lab, logits.shape, axis, w)
    return loss, saved


def _ce_logits(xp, g, args, ans, saved, a, out):
    probs, labels, shape, axis, w = saved
    n = probs.shape[0]
    probs[xp.arange(n), labels] -= 1.0  # the saved buffer is private to this node: reuse it
    if w is None:
        probs *= g * (1.0 / n)
    else:
        probs *= (w * g)[:, None]
    if axis == len(shape) - 1:
        return probs.reshape(shape)
    moved = shape[:axis] + shape[axis + 1:] + (shape[axis],)
    return xp.ascontiguousarray(xp.moveaxis(probs.reshape(moved), -1, axis))


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
    _labels_type(types, a)
    return TensorType((), INT)


def predictions(xp, logits, labels, a):
    """(predicted class, label, labelled?) per position, flat; labelled is None without an
    ignored label."""
    axis = class_axis(logits.shape, labels.shape, a.get("axis"))
    lab = labels.reshape(-1)
    keep = None if a.get("ignore_index") is None else lab != a["ignore_index"]
    return xp.argmax(logits, axis=axis).reshape(-1), lab, keep


@defop("correct_count", _correct_type, (2, 2), attrs=LABEL_ATTRS, check=_check_attrs,
       arg_names=("logits", "labels"))
def correct_count(xp, args, a, ctx):
    """Positions whose arg-max class is their label, ignored positions left out."""
    logits, labels = args
    if a["axis"] is None and a["ignore_index"] is None and class_axis(logits.shape, labels.shape) == logits.ndim - 1:
        return xp.asarray((xp.argmax(logits, axis=-1) == labels).sum()), None
    pred, lab, keep = predictions(xp, logits, labels, a)
    hit = pred == lab
    if keep is not None:
        hit &= keep
    return xp.asarray(hit.sum()), None


def iou_counts(xp, logits, labels, a, classes: int):
    """(intersection, union) per class, int64 arrays of ``classes``, ignored positions left out:
    the additive counts a mean IoU over many batches and ranks is formed from."""
    pred, lab, keep = predictions(xp, logits, labels, a)
    if keep is not None:
        pred, lab = pred[keep], lab[keep]
    inter = xp.bincount(lab[pred == lab], minlength=classes)[:classes]
    union = (xp.bincount(pred, minlength=classes)[:classes] + xp.bincount(lab, minlength=classes)[:classes]
             - inter)
    return inter.astype(np.int64), union.astype(np.int64)


def labelled_count(xp, labels, ignore_index) -> int:
    """Positions whose label is not ``ignore_index`` (accuracy's denominator)."""
    if ignore_index is None:
        return int(labels.size)
    return int((labels != ignore_index).sum())


def abs_error_sum(xp, prediction, target) -> float:
    """The summed absolute error (a mean absolute error's numerator)."""
    return float(xp.abs(prediction - target).sum())
