"""The loss head of an imported ONNX model.

``loss="cross_entropy"``: softmax cross-entropy of the model output, (B, C) logits against
(B,) int64 labels, (B, C, *S) against (B, *S) (PyTorch's segmentation: class axis 1) or
(B, T, V) against (B, T) (a language model: class axis last), plus a ``correct`` count. The
labels' shape decides the class axis (``ops.loss.class_axis``); where it fits both, ``class_axis``
(1 or -1) does. Without a label shape, (B, C, H, W) and more dims take axis 1, (B, T, V) the last.
``loss="mse"``: mean squared error against float targets shaped like the output.
``loss="auto"``: mse when the caller says the labels are float, else cross-entropy.

A graph that computes its own loss is trained as it is: it has two data inputs (the first is
fed ``x``, the second ``y``) and a float scalar output, which must be the mean over the batch.
"""

from __future__ import annotations

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.onnx.emit import Emitter, Tensor
from hpc_rlx.graph.ops.loss import class_axis as find_class_axis
from hpc_rlx.graph.shapes import FLOAT, INT, ShapeError, fmt_shape

LOSSES = ("auto", "cross_entropy", "mse")
LABEL_DTYPES = (None, INT, FLOAT)


def check_loss_args(loss, label_dtype, label_shape) -> None:
    if loss not in LOSSES:
        raise GraphError(f"loss must be one of {list(LOSSES)}, got {loss!r}")
    if label_dtype not in LABEL_DTYPES:
        raise GraphError(f"label_dtype must be 'int64', 'float' or None, got {label_dtype!r}")
    if label_shape is not None and not (isinstance(label_shape, (list, tuple)) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in label_shape)):
        raise GraphError(f"label_shape must list the positive dims of one sample's label, got {label_shape!r}")


def kind_of(loss: str, label_dtype) -> str:
    if loss == "auto":
        return "mse" if label_dtype == FLOAT else "cross_entropy"
    if loss == "cross_entropy" and label_dtype == FLOAT:
        raise GraphError("loss=cross_entropy needs integer class labels, but the labels are float (use mse)")
    if loss == "mse" and label_dtype == INT:
        raise GraphError("loss=mse needs float targets, but the labels are integers (use cross_entropy)")
    return loss


def _class_axis(shape, label_shape, axis) -> int:
    """The class axis (1 or the last) of logits ``shape`` against one sample's ``label_shape``."""
    if label_shape is None:
        if axis is not None:
            return 1 if axis == 1 else len(shape) - 1
        return 1 if len(shape) >= 4 else len(shape) - 1
    try:
        return find_class_axis(shape, (None,) + tuple(label_shape), axis)
    except ShapeError as e:
        fits = [s for s in (shape[2:], shape[1:-1]) if tuple(label_shape) == s]
        why = str(e) if fits else f"needs {shape[2:]} (classes on axis 1) or {shape[1:-1]} (classes last)"
        raise GraphError(f"the labels are {tuple(label_shape)} per sample, but a cross_entropy loss of output "
                         f"{fmt_shape(shape)} {why}") from None


def attach(em: Emitter, out: Tensor, loss: str, label_dtype, label_shape, class_axis=None) -> dict:
    """Adds the label input ``y`` and the loss (and metric) nodes; returns the graph outputs."""
    kind = kind_of(loss, label_dtype)
    shape = out.ir_shape
    if out.dtype != FLOAT or not shape or shape[0] is not None or None in shape[1:]:
        raise GraphError(f"the model output has shape {fmt_shape(shape)} ({out.dtype}); a loss needs a float "
                         f"output with the batch first")
    if kind == "cross_entropy":
        if len(shape) < 2:
            raise GraphError(f"cross-entropy needs (batch, classes) logits, the model output is {fmt_shape(shape)} "
                             f"(use loss=mse for a regression)")
        axis = _class_axis(shape, label_shape, class_axis)
        labels = shape[:axis] + shape[axis + 1:]
    else:
        labels = shape
    if label_shape is not None and tuple(label_shape) != labels[1:]:
        raise GraphError(f"the labels are {tuple(label_shape)} per sample, but a {kind} loss of output "
                         f"{fmt_shape(shape)} needs {labels[1:]}")
    y = em.input("y", labels, INT if kind == "cross_entropy" else FLOAT)
    em.at("loss", "loss", "loss")
    if kind == "cross_entropy":
        # the attribute only where the shapes alone cannot tell (an imported graph's JSON otherwise unchanged)
        side = {"axis": 1 if axis == 1 else -1} if len(shape) > 2 and shape[2:] == shape[1:-1] else {}
        return {"loss": em.op("softmax_cross_entropy", out.name, y.name, **side),
                "correct": em.op("correct_count", out.name, y.name, **side)}
    return {"loss": em.op("mse", out.name, y.name)}


def own_loss(outputs: list) -> tuple:
    """(loss Tensor, model output Tensor) of a graph with its own loss: the first float scalar
    output, and the first other output (the loss itself when there is none)."""
    scalars = [t for t in outputs if isinstance(t, Tensor) and t.ir_shape == () and t.dtype == FLOAT]
    if not scalars:
        raise GraphError("the ONNX graph has one data input more than data.x names, so it is read as computing its "
                         "own loss (x, y -> loss), but no output is a float scalar; a model of several inputs "
                         "(input_ids, attention_mask) takes them all named: data.x=[input_ids,attention_mask]")
    rest = [t for t in outputs if isinstance(t, Tensor) and t is not scalars[0] and t.ir_shape != ()]
    return scalars[0], (rest[0] if rest else scalars[0])
