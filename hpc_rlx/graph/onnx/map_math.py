"""ONNX -> IR for arithmetic, activations, matrix products, selection and casts.

Each mapping is ``fn(em, ins, attrs, n_outputs) -> [value per output]``: ``em`` the
``Emitter``, ``ins`` the input values (``Tensor``, ``Folded`` or None for an omitted optional
input). The import table (``importer.ONNX_OPS``) names one mapping per op type.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.onnx.emit import FLOAT32_MAX, Tensor, decimal32, folded_scalar
from hpc_rlx.graph.onnx.fold import ONNX_DTYPES, Folded
from hpc_rlx.graph.shapes import FLOAT, INT

# scores a mask sets at or below this count as hidden (PyTorch writes -inf, some models -1e4)
MASK_FILL_BELOW = -1e4


def float_tensor(em, v, what: str = "input") -> Tensor:
    t = em.as_tensor(v)
    if t.dtype != FLOAT:
        raise em.fail(f"{what} must be float (IR arithmetic is on float tensors), got {t.dtype}")
    return t


def unary(op: str, **attrs):
    def emit(em, ins, at, n):
        x = float_tensor(em, ins[0])
        return [em.tensor(op, [x], x.groups, **attrs)]

    return emit


def sign(em, ins, at, n):
    """On float data (zero gradient) or int64 data (DeBERTa's relative positions)."""
    x = em.as_tensor(ins[0])
    return [em.tensor("sign", [x], x.groups)]


def hard_sigmoid(em, ins, at, n):
    x = float_tensor(em, ins[0])
    return [em.tensor("hard_sigmoid", [x], x.groups, alpha=decimal32(at.get("alpha", 0.2)),
                      beta=decimal32(at.get("beta", 0.5)))]


def mask(op: str, **attrs):
    """A no-gradient mask (an int64 0/1 tensor) over ONNX-broadcast operands: comparisons and
    logic on data, as a model builds its attention or padding masks at run time."""
    def emit(em, ins, at, n):
        return [em.broadcast_op(op, [v for v in ins if v is not None], **attrs)]

    return emit


def isinf(em, ins, at, n):
    x = float_tensor(em, ins[0])
    return [em.tensor("isinf", [x], x.groups, detect_negative=bool(at.get("detect_negative", 1)),
                      detect_positive=bool(at.get("detect_positive", 1)))]


def leaky_relu(em, ins, at, n):
    x = float_tensor(em, ins[0])
    return [em.tensor("leaky_relu", [x], x.groups, alpha=decimal32(at.get("alpha", 0.01)))]


def gelu(em, ins, at, n):
    x = float_tensor(em, ins[0])
    return [em.tensor("gelu", [x], x.groups, approximate=at.get("approximate", "none"))]


# exact on integers too: position ids and counts computed at run time (no gradient)
INT_ARITHMETIC = ("add", "sub", "mul")


def _is_int(v) -> bool:
    return v.dtype == INT if isinstance(v, Tensor) else v.value.dtype.kind in "iub"


def binary(op: str):
    def emit(em, ins, at, n):
        for v in ins:
            if isinstance(v, Tensor) and v.dtype != FLOAT and not (op in INT_ARITHMETIC and all(map(_is_int, ins))):
                raise em.fail(f"'{op}' of {v.dtype} tensors: IR arithmetic is on float tensors (add, sub and "
                              f"mul also on two integer ones)")
        return [em.broadcast_op(op, ins)]

    return emit


def softmax(op: str):
    def emit(em, ins, at, n):
        x = float_tensor(em, ins[0])
        axis = at.get("axis", -1) % x.rank
        if not x.plain(axis):
            raise em.fail(f"{op} over axis {axis}, which holds the batch")
        return [em.tensor(op, [x], x.groups, axis=sum(len(g) for g in x.groups[:axis]))]

    return emit


def clip(em, ins, at, n):
    x = float_tensor(em, ins[0])
    bounds = []
    for v, what in zip((ins + [None, None])[1:3], ("min", "max")):
        b = None if v is None else decimal32(folded_scalar(v, f"Clip's {what}", em))
        bounds.append(None if b is None or not np.isfinite(b) else b)
    return [em.tensor("clip", [x], x.groups, min=bounds[0], max=bounds[1])]


def cast_to(em, x, target) -> Tensor:
    kind = np.dtype(target).kind
    if kind == "f":
        return x if x.dtype == FLOAT else em.tensor("cast", [x], x.groups, to=FLOAT)
    if kind == "b":  # nonzero or not, as an int64 0/1 mask
        once = em.tensor("logical", [x], x.groups, kind="not")
        return em.tensor("logical", [once], x.groups, kind="not")
    return x if x.dtype == INT else em.tensor("cast", [x], x.groups, to=INT)


def cast(em, ins, at, n):
    return [cast_to(em, em.as_tensor(ins[0]), ONNX_DTYPES.get(at["to"], np.float32))]


def cast_like(em, ins, at, n):
    """Only the second input's type matters: a constant cast like a tensor stays a constant."""
    x, like = ins
    target = like.value.dtype if isinstance(like, Folded) else (np.float32 if like.dtype == FLOAT else np.int64)
    if isinstance(x, Folded):
        return [Folded(x.a.astype(target), x.b.astype(target))]
    return [cast_to(em, x, target)]


def _causal_fill(em, cond, fill, scores, hide_when: bool):
    """IR causal_mask when ``where(cond, ...)`` hides exactly the keys after each query."""
    if not (isinstance(scores, Tensor) and isinstance(fill, Folded) and fill.const and scores.rank >= 2):
        return None
    f = np.asarray(fill.value, np.float64)
    if f.size == 0 or f.ndim > scores.rank or not (f == f.reshape(-1)[0]).all() or f.reshape(-1)[0] > MASK_FILL_BELOW:
        return None
    if not (scores.plain(-1) and scores.plain(-2)) or scores.groups[-1] != scores.groups[-2]:
        return None
    t = scores.groups[-1][0]
    c = np.asarray(cond.value).astype(bool)
    if c.ndim < 2 or c.ndim > scores.rank or c.shape[-2:] != (t, t) or any(d != 1 for d in c.shape[:-2]):
        return None
    hidden = c.reshape(t, t) if hide_when else ~c.reshape(t, t)
    if not np.array_equal(hidden, np.triu(np.ones((t, t), bool), 1)):
        return None
    value = float(f.reshape(-1)[0])
    return em.tensor("causal_mask", [scores], scores.groups, fill=value if np.isfinite(value) else -FLOAT32_MAX)


def where(em, ins, at, n):
    cond, a, b = ins
    if isinstance(cond, Folded) and cond.const:
        masked = _causal_fill(em, cond, a, b, True) or _causal_fill(em, cond, b, a, False)
        if masked is not None:
            return [masked]
    if not (_is_int(a) and _is_int(b)):  # two integer branches pick ids at run time
        for v in (a, b):
            if isinstance(v, Tensor) and v.dtype != FLOAT or isinstance(v, Folded) and v.value.dtype.kind != "f":
                raise em.fail("Where of an integer and a float branch is not supported")
    return [em.broadcast_op("where", [cond, a, b])]


# ---------------------------------------------------------------- matrix products


def _linear(em, x: Tensor, w, bias, out_groups) -> Tensor:
    """x @ w (+ bias) for a 2-D ``w``; a transposed parameter is read in its own layout."""
    w = em.as_tensor(w)
    attrs = {}
    if w.transpose_of is not None:
        w, attrs = w.transpose_of, {"weight_layout": "out_in"}
    args = [x, w] + ([bias] if bias is not None else [])
    return em.tensor("linear", args, out_groups, **attrs)


def _is_matrix(v) -> bool:
    if isinstance(v, Folded):
        return v.const and v.value.ndim == 2
    return v.rank == 2 and v.batch_axis is None and v.dtype == FLOAT


def matmul(em, ins, at, n):
    a, b = float_tensor(em, ins[0], "A"), ins[1]
    if a.rank < 2:
        raise em.fail("MatMul of a 1-D left operand is not supported")
    if not a.plain(-1):
        raise em.fail("MatMul over a dim that holds the batch")
    if isinstance(b, Folded) and b.const and b.value.ndim == 1:  # (K,) as (K, 1), then dropped
        y = _linear(em, a, Folded(b.value.reshape(-1, 1)), None, a.groups[:-1] + ((1,),))
        return [em.reshape(y, a.groups[:-1])]
    if _is_matrix(b):
        n_out = (b.value.shape if isinstance(b, Folded) else b.ir_shape)[1]
        return [_linear(em, a, b, None, a.groups[:-1] + ((n_out,),))]
    b = float_tensor(em, b, "B")
    if b.rank < 2 or not b.plain(-1) or not b.plain(-2):
        raise em.fail(f"MatMul with B of ONNX rank {b.rank} holding the batch in its matrix dims")
    lead = em.broadcast_groups([a.groups[:-2], b.groups[:-2]])
    args = [em.fit(a, lead + a.groups[-2:]), em.fit(b, lead + b.groups[-2:])]
    return [em.tensor("matmul", args, lead + (a.groups[-2], b.groups[-1]))]


def gemm(em, ins, at, n):
    a, b = float_tensor(em, ins[0], "A"), ins[1]
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = decimal32(at.get("alpha", 1.0)), decimal32(at.get("beta", 1.0))
    if a.rank != 2 or not _is_matrix(b):
        raise em.fail("Gemm needs a 2-D A and a constant or parameter B")
    if at.get("transA", 0):
        a = em.transpose(a, [1, 0])
    if not a.plain(-1):
        raise em.fail("Gemm over a dim that holds the batch")
    if at.get("transB", 0):
        b = em.transpose(em.as_tensor(b), [1, 0])
    n_out = (b.value.shape if isinstance(b, Folded) else b.ir_shape)[1]
    groups = a.groups[:-1] + ((n_out,),)
    bias = None
    if c is not None and alpha == 1.0 and beta == 1.0:
        ct = em.as_tensor(c)
        if ct.ir_shape == (n_out,):
            bias, c = ct, None
    y = _linear(em, a, b, bias, groups)
    if alpha != 1.0:
        y = em.tensor("scale", [y], groups, value=alpha)
    if c is not None:
        if beta != 1.0:
            c = em.tensor("scale", [float_tensor(em, c, "C")], em.as_tensor(c).groups, value=beta)
        y = em.broadcast_op("add", [y, c])
    return [y]
