"""Constant and shape folding for the ONNX importer: a small NumPy evaluator.

A value that does not depend on the input data (a constant, or something computed from the
input's shape) is a ``Folded``: its NumPy value at two batch sizes, ``TRACE_BATCHES``. Where the
two agree the value is a constant; where they differ it depends on the batch size, and the
importer reads which entries are the batch (the value equals the batch size) and which are a
multiple of it. The two sizes are large primes so that no model dimension is mistaken for them.

Each evaluator runs one ONNX op on NumPy arrays: ``fn(inputs, attrs) -> array`` or a list of
arrays (one per output); ``inputs`` holds None for an omitted optional input. The import table
(``importer.ONNX_OPS``) names each op's evaluator.
"""

from __future__ import annotations

import math

import numpy as np

TRACE_BATCHES = (1009, 1013)
# A batch-dependent constant is materialised at both trace sizes; beyond this many elements it
# is not worth folding (and would only come from an unusual model).
MAX_FOLD_ELEMENTS = 1 << 24

# ONNX TensorProto element types -> NumPy (bfloat16 has no NumPy type: computed as float32)
ONNX_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32,
               7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32,
               13: np.uint64, 16: np.float32}


class FoldError(ValueError):
    """A folded op cannot be evaluated (the caller names the node)."""


class Folded:
    """A value known without the input data: ``a`` at the first trace batch, ``b`` at the
    second (the same object when it does not depend on the batch size)."""

    __slots__ = ("a", "b")

    def __init__(self, a, b=None):
        a = np.asarray(a)
        b = a if b is None else np.asarray(b)
        if b is not a and a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b):
            b = a
        for v in (a, b):
            if v.size > MAX_FOLD_ELEMENTS:
                raise FoldError(f"a folded value of shape {v.shape} is too large to evaluate")
        self.a, self.b = a, b

    @property
    def const(self) -> bool:
        return self.a is self.b

    @property
    def value(self) -> np.ndarray:
        return self.a

    def at(self, trace: int) -> np.ndarray:
        return self.a if trace == 0 else self.b

    def __repr__(self) -> str:
        return f"Folded({self.a!r})" if self.const else f"Folded({self.a!r}, {self.b!r})"


def evaluate(fn, inputs: list, attrs: dict) -> list:
    """Run ``fn`` on folded inputs: once if none depends on the batch size, else per trace."""
    traces = 1 if all(v is None or v.const for v in inputs) else 2
    results = []
    for t in range(traces):
        out = fn([None if v is None else v.at(t) for v in inputs], attrs)
        results.append(out if isinstance(out, (list, tuple)) else [out])
    if traces == 1:
        return [Folded(np.asarray(v)) for v in results[0]]
    return [Folded(np.asarray(a), np.asarray(b)) for a, b in zip(results[0], results[1])]


# ---------------------------------------------------------------- helpers


def ints(value) -> list:
    """A folded 0-d or 1-d integer array as a list of Python ints."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _axes(ins, attrs, position=1) -> list | None:
    """Axes from the input at ``position`` (newer opsets) or the ``axes`` attribute."""
    if len(ins) > position and ins[position] is not None:
        return ints(ins[position])
    return list(attrs["axes"]) if "axes" in attrs else None


def _same_kind(value, like):
    return np.asarray(value).astype(like.dtype) if isinstance(like, np.ndarray) else value


def unary(fn):
    return lambda ins, at: _same_kind(fn(ins[0]), ins[0])


def binary(fn):
    return lambda ins, at: fn(ins[0], ins[1])


def compare(fn):
    return lambda ins, at: np.asarray(fn(ins[0], ins[1]), dtype=np.bool_)


def erf_values(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype)


def div(a, b):
    if np.asarray(a).dtype.kind in "iu" and np.asarray(b).dtype.kind in "iu":
        q = np.abs(a) // np.abs(b)  # ONNX integer division truncates toward zero
        return (q * np.sign(a) * np.sign(b)).astype(np.result_type(a, b))
    return a / b


def pow_(a, b):
    return np.power(a, b).astype(np.asarray(a).dtype)


def mod(ins, at):
    a, b = ins
    if at.get("fmod", 0):
        return np.fmod(a, b)
    return np.mod(a, b)


def where(ins, at):
    return np.where(ins[0].astype(bool), ins[1], ins[2])


def cast(ins, at):
    return np.asarray(ins[0]).astype(ONNX_DTYPES.get(at["to"], np.float32))


def cast_like(ins, at):
    return np.asarray(ins[0]).astype(ins[1].dtype)


def shape(ins, at):
    dims = np.asarray(np.shape(ins[0]), dtype=np.int64)
    return dims[slice(at.get("start", 0), at.get("end"))]


def constant(ins, at):
    for key in ("value", "sparse_value"):
        if key in at:
            return np.asarray(at[key])
    if "value_float" in at:
        return np.asarray(at["value_float"], np.float32)
    if "value_floats" in at:
        return np.asarray(at["value_floats"], np.float32)
    if "value_int" in at:
        return np.asarray(at["value_int"], np.int64)
    if "value_ints" in at:
        return np.asarray(at["value_ints"], np.int64)
    raise FoldError("a Constant node without a numeric value")


def constant_of_shape(ins, at):
    fill = np.asarray(at.get("value", np.zeros(1, np.float32))).reshape(-1)
    return np.full(ints(ins[0]), fill[0], dtype=fill.dtype)


def range_(ins, at):
    start, limit, delta = (np.asarray(v).reshape(()) for v in ins)
    return np.arange(start, limit, delta, dtype=np.result_type(start, limit, delta))


def concat(ins, at):
    return np.concatenate([np.atleast_1d(v) if v.ndim == 0 else v for v in ins if v is not None], axis=at["axis"])


def gather(ins, at):
    data, idx = ins
    axis = at.get("axis", 0) % max(data.ndim, 1)
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    return np.take(data, idx, axis=axis)


def gather_elements(ins, at):
    data, idx = ins
    axis = at.get("axis", 0) % max(data.ndim, 1)
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    return np.take_along_axis(data, idx, axis=axis)


def slice_index(shape, starts, ends, axes, steps) -> tuple:
    """The NumPy index of an ONNX Slice (negative bounds count from the end; clamped)."""
    axes = list(range(len(starts))) if axes is None else [a % len(shape) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * len(shape)
    for ax, s, e, st in zip(axes, starts, ends, steps):
        index[ax] = slice(*slice(s, e, st).indices(shape[ax]))
        if st < 0 and index[ax].stop < 0:  # ran through index 0: open-ended
            index[ax] = slice(index[ax].start, None, st)
    return tuple(index)


def slice_(ins, at):
    data = ins[0]
    axes = ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    steps = ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
    return data[slice_index(data.shape, ints(ins[1]), ints(ins[2]), axes, steps)]


def squeeze_shape(shape, axes) -> tuple:
    if axes is None:
        return tuple(d for d in shape if d != 1)
    drop = {a % len(shape) for a in axes}
    if any(shape[a] != 1 for a in drop):
        raise FoldError(f"cannot squeeze axes {sorted(drop)} of shape {tuple(shape)}")
    return tuple(d for i, d in enumerate(shape) if i not in drop)


def unsqueeze_shape(shape, axes) -> tuple:
    rank = len(shape) + len(axes)
    where = {a % rank for a in axes}
    rest = iter(shape)
    return tuple(1 if i in where else next(rest) for i in range(rank))


def reshape_shape(shape, target, allowzero=0) -> tuple:
    """ONNX Reshape's output shape: 0 copies the input dim (unless ``allowzero``), -1 is inferred."""
    out = [shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if out.count(-1) > 1:
        raise FoldError(f"reshape target {list(target)} has more than one -1")
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        total = math.prod(shape)
        if known == 0 or total % known:
            raise FoldError(f"cannot reshape {tuple(shape)} to {list(target)}")
        out[out.index(-1)] = total // known
    if math.prod(out) != math.prod(shape):
        raise FoldError(f"cannot reshape {tuple(shape)} to {list(target)}")
    return tuple(out)


def flatten_shape(shape, axis) -> tuple:
    if axis < 0:
        axis += len(shape)
    return (math.prod(shape[:axis]), math.prod(shape[axis:]))


def squeeze(ins, at):
    return ins[0].reshape(squeeze_shape(ins[0].shape, _axes(ins, at)))


def unsqueeze(ins, at):
    return ins[0].reshape(unsqueeze_shape(ins[0].shape, _axes(ins, at)))


def reshape(ins, at):
    return ins[0].reshape(reshape_shape(ins[0].shape, ints(ins[1]), at.get("allowzero", 0)))


def flatten(ins, at):
    return ins[0].reshape(flatten_shape(ins[0].shape, at.get("axis", 1)))


def transpose(ins, at):
    return np.transpose(ins[0], at.get("perm"))


def expand(ins, at):
    return ins[0] * np.ones(ints(ins[1]), dtype=ins[0].dtype)


def tile(ins, at):
    return np.tile(ins[0], ints(ins[1]))


def reduce_axes(ins, at, rank) -> tuple | None:
    """The axes a Reduce* op reduces (None: all), or () for a no-op."""
    axes = _axes(ins, at)
    if not axes:
        return () if at.get("noop_with_empty_axes", 0) else None
    return tuple(a % rank for a in axes)


def reducer(fn):
    def run(ins, at):
        axes = reduce_axes(ins, at, ins[0].ndim)
        if axes == ():
            return ins[0]
        out = fn(ins[0], axis=axes, keepdims=bool(at.get("keepdims", 1)))
        return np.asarray(out).astype(ins[0].dtype)

    return run


def split_sizes(ins, at, dim: int) -> list:
    """Split's piece sizes along an axis of ``dim``: its second input, else ``num_outputs``
    (or one per node output, ``_outputs``) pieces of equal size, the last one smaller."""
    if len(ins) > 1 and ins[1] is not None:
        return ints(ins[1])
    n = at.get("num_outputs", at.get("_outputs", 1))
    step = -(-dim // n)
    return [min(step, dim - i * step) for i in range(n)]


def split(ins, at):
    axis = at.get("axis", 0)
    sizes = split_sizes(ins, at, ins[0].shape[axis])
    return np.split(ins[0], np.cumsum(sizes)[:-1], axis=axis)


def clip(ins, at):
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else None
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else None
    return np.clip(ins[0], lo, hi)


def matmul(ins, at):
    return np.matmul(ins[0], ins[1])


def variadic(fn):
    def run(ins, at):
        out = ins[0]
        for v in ins[1:]:
            out = fn(out, v)
        return out

    return run


def identity(ins, at):
    return ins[0]


def erf(ins, at):
    return erf_values(ins[0])


def logical_not(ins, at):
    return np.logical_not(ins[0])


def size(ins, at):
    return np.asarray(np.size(ins[0]), np.int64)


relu = unary(lambda x: np.maximum(x, 0))
sigmoid = unary(lambda x: 1.0 / (1.0 + np.exp(-x)))


def hard_sigmoid(ins, at):
    x = ins[0]
    return _same_kind(np.clip(x * at.get("alpha", 0.2) + at.get("beta", 0.5), 0, 1), x)


hard_swish = unary(lambda x: x * np.clip(x / 6 + 0.5, 0, 1))


def isnan(ins, at):
    return np.isnan(ins[0])


def isinf(ins, at):
    x = ins[0]
    hit = np.isinf(x)
    if not at.get("detect_negative", 1):
        hit &= x > 0
    if not at.get("detect_positive", 1):
        hit &= x < 0
    return hit


def trilu(ins, at):
    """ONNX Trilu: the upper (upper=1, the default) or lower triangle of the last two axes,
    shifted by k diagonals."""
    k = int(np.asarray(ins[1]).reshape(())) if len(ins) > 1 and ins[1] is not None else 0
    return np.triu(ins[0], k) if at.get("upper", 1) else np.tril(ins[0], k)


def cumsum(ins, at):
    x, axis = ins[0], int(np.asarray(ins[1]).reshape(()))
    ax = axis % max(x.ndim, 1)
    if at.get("reverse", 0):
        x = np.flip(x, ax)
    out = np.cumsum(x, axis=ax, dtype=x.dtype)
    if at.get("exclusive", 0):
        out = np.concatenate([np.zeros_like(np.take(out, [0], axis=ax)),
                              np.take(out, np.arange(out.shape[ax] - 1), axis=ax)], axis=ax)
    return np.flip(out, ax) if at.get("reverse", 0) else out


def _reduce_into(target, index, values, reduction):
    if reduction in ("none", None):
        target[index] = values
    elif reduction == "add":
        np.add.at(target, index, values)
    elif reduction == "mul":
        np.multiply.at(target, index, values)
    elif reduction == "max":
        np.maximum.at(target, index, values)
    elif reduction == "min":
        np.minimum.at(target, index, values)
    else:
        raise FoldError(f"unknown reduction {reduction!r}")


def _elements_index(idx, ax, size) -> tuple:
    idx = np.where(idx < 0, idx + size, idx)
    grid = list(np.indices(idx.shape, sparse=True))
    grid[ax] = idx
    return tuple(grid)


def scatter_elements(ins, at):
    data, idx, upd = ins
    ax = at.get("axis", 0) % max(data.ndim, 1)
    out = data.copy()
    _reduce_into(out, _elements_index(idx, ax, data.shape[ax]), upd, at.get("reduction", "none"))
    return out


def _nd_index(idx, shape, batch_dims) -> tuple:
    lead = idx.shape[:-1]
    grid = tuple(np.indices(lead, sparse=True))[:batch_dims]
    q = idx.shape[-1]
    return grid + tuple(np.where(idx[..., k] < 0, idx[..., k] + shape[batch_dims + k], idx[..., k])
                        for k in range(q))


def gather_nd(ins, at):
    data, idx = ins
    return data[_nd_index(idx, data.shape, at.get("batch_dims", 0))]


def scatter_nd(ins, at):
    data, idx, upd = ins
    out = data.copy()
    _reduce_into(out, _nd_index(idx, data.shape, 0), upd, at.get("reduction", "none"))
    return out


def nonzero(ins, at):
    return np.asarray(np.nonzero(ins[0]), np.int64).reshape(np.ndim(ins[0]), -1)
