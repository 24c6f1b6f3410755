"""Reshaping, joining, cutting, picking and broadcasting: ``flatten``, ``reshape``, ``transpose``,
``concat``, ``slice``, ``gather`` and ``expand`` (conventions in ``hpc_rlx.graph.ops``). Index
attributes follow ONNX: negative values count from the end, slice bounds are clamped.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.base import backend
from hpc_rlx.graph.ops.common import unbroadcast
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import (
    ShapeError,
    TensorType,
    axis_index,
    broadcast,
    fmt_shape,
    known_prod,
    require_int,
)

MAX_CONCAT = 64
# A slice end at least this large on the batch dim means "to the end" (exporters write
# INT64_MAX, sometimes INT32_MAX).
FULL_END = 2**31 - 1


def _int(value, name):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShapeError(f"attribute '{name}' must be an int, got {value!r}")
    return value


def _int_list(value, name, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, (list, tuple)):
        raise ShapeError(f"attribute '{name}' must be a list of ints, got {value!r}")
    return tuple(_int(v, name) for v in value)


# ---------------------------------------------------------------- flatten, reshape, transpose


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


defvjp("flatten", lambda xp, g, args, ans, shape, a, out: g.reshape(shape), needs_args=())


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


defvjp("reshape", lambda xp, g, args, ans, shape, a, out: g.reshape(shape), needs_args=())


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


def _transpose_x(xp, g, args, ans, s, a, out):
    axes = a["axes"]
    inverse = [0] * len(axes)
    for i, ax in enumerate(axes):
        inverse[ax] = i
    return g.transpose(inverse)


defvjp("transpose", _transpose_x, needs_args=())


# ---------------------------------------------------------------- concat


def _concat_type(types, a):
    first = types[0]
    ax = axis_index(a["axis"], first.ndim)
    total = 0
    for i, t in enumerate(types):
        if t.dtype != first.dtype:
            raise ShapeError(f"input {i} is {t.dtype} but input 0 is {first.dtype}")
        if t.ndim != first.ndim or any(d != e for k, (d, e) in enumerate(zip(t.shape, first.shape)) if k != ax):
            raise ShapeError(f"input {i} {fmt_shape(t.shape)} does not match input 0 {fmt_shape(first.shape)} "
                             f"outside axis {ax}")
        if t.shape[ax] is None:
            if len(types) > 1:
                raise ShapeError("cannot concatenate along the batch dim")
            total = None
        else:
            total += t.shape[ax]
    return TensorType(first.shape[:ax] + (total,) + first.shape[ax + 1 :], first.dtype)


@defop("concat", _concat_type, (1, MAX_CONCAT), attrs={"axis": REQUIRED},
       check=lambda a: {"axis": _int(a["axis"], "axis")})
def concat(xp, args, a, ctx):
    ax = a["axis"] % args[0].ndim
    out = xp.concatenate(args, axis=ax)
    if not ctx.need_saved:
        return out, None
    bounds, at = [], 0
    for x in args:
        bounds.append((at, at + x.shape[ax]))
        at += x.shape[ax]
    return out, (ax, bounds)


def _concat_part(position):
    def vjp(xp, g, args, ans, saved, a, out):
        ax, bounds = saved
        lo, hi = bounds[position]
        return g[(slice(None),) * ax + (slice(lo, hi),)]

    return vjp


defvjp("concat", *(_concat_part(i) for i in range(MAX_CONCAT)), needs_args=())


# ---------------------------------------------------------------- slice


def _slice_check(a):
    starts, ends = _int_list(a["starts"], "starts"), _int_list(a["ends"], "ends")
    axes = _int_list(a["axes"], "axes", True)
    steps = _int_list(a["steps"], "steps", True)
    axes = tuple(range(len(starts))) if axes is None else axes
    steps = (1,) * len(starts) if steps is None else steps
    if not len(axes) == len(starts) == len(ends) == len(steps):
        raise ShapeError(f"axes, starts, ends and steps must have one entry per axis, got "
                         f"{len(axes)}, {len(starts)}, {len(ends)}, {len(steps)}")
    if 0 in steps:
        raise ShapeError("slice steps must be nonzero")
    return {"axes": axes, "starts": starts, "ends": ends, "steps": steps}


def slice_bounds(start: int, end: int, step: int, dim: int) -> tuple:
    """ONNX Slice's clamping for one axis of size ``dim``: (start, end, step, length); ``end``
    is -1 when a negative step runs through index 0."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        length = max(0, -(-(end - start) // step))
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        length = max(0, -(-(start - end) // -step))
    return start, end, step, length


def _slice_axes(a, ndim):
    axes = [axis_index(ax, ndim, "slice axis") for ax in a["axes"]]
    if len(set(axes)) != len(axes):
        raise ShapeError(f"slice axes repeat: {list(a['axes'])}")
    return list(zip(axes, a["starts"], a["ends"], a["steps"]))


def _slice_type(types, a):
    x = types[0]
    shape = list(x.shape)
    for ax, start, end, step in _slice_axes(a, x.ndim):
        if shape[ax] is None:
            if (start, step) != (0, 1) or end < FULL_END:
                raise ShapeError(f"the batch dim (axis {ax}) may only be sliced whole, got "
                                 f"start={start} end={end} step={step}")
            continue
        shape[ax] = slice_bounds(start, end, step, shape[ax])[3]
        if shape[ax] == 0:
            raise ShapeError(f"slice of axis {ax} of {fmt_shape(x.shape)} is empty")
    return TensorType(tuple(shape), x.dtype)


def slice_index(a, shape):
    """The basic index (a tuple of Python slices) of an ONNX slice of an array of ``shape``."""
    index = [slice(None)] * len(shape)
    for ax, start, end, step in _slice_axes(a, len(shape)):
        start, end, step, _ = slice_bounds(start, end, step, shape[ax])
        index[ax] = slice(start, None if end < 0 else end, step)
    return tuple(index)


@defop("slice", _slice_type, (1, 1), attrs={"starts": REQUIRED, "ends": REQUIRED, "axes": None, "steps": None},
       check=_slice_check)
def slice_(xp, args, a, ctx):
    x = args[0]
    return x[slice_index(a, x.shape)], (x.shape if ctx.need_saved else None)


def _slice_x(xp, g, args, ans, shape, a, out):
    gx = xp.zeros(shape, dtype=g.dtype)
    gx[slice_index(a, shape)] = g
    return gx


defvjp("slice", _slice_x, needs_args=())


# ---------------------------------------------------------------- gather


def _gather_type(types, a):
    data, idx = types
    require_int(idx, "indices")
    ax = axis_index(a["axis"], data.ndim)
    return TensorType(data.shape[:ax] + idx.shape + data.shape[ax + 1 :], data.dtype)


def wrap_indices(xp, idx, size):
    """Negative indices count from the end (ONNX)."""
    return xp.where(idx < 0, idx + size, idx)


def _selected(idx, ax):
    """The basic index that picks one position on axis ``ax`` when ``idx`` is one number on the
    host (a transformer's q, k, v = qkv[0], qkv[1], qkv[2]), else None: a view forward and one
    strided write backward instead of a copy and a sorted scatter-add."""
    if idx.ndim or not isinstance(idx, np.ndarray):
        return None
    return (slice(None),) * ax + (int(idx),)


@defop("gather", _gather_type, (2, 2), attrs={"axis": 0}, check=lambda a: {"axis": _int(a["axis"], "axis")},
       arg_names=("data", "indices"))
def gather(xp, args, a, ctx):
    data, idx = args
    ax = a["axis"] % data.ndim
    idx = wrap_indices(xp, idx, data.shape[ax])
    one = _selected(idx, ax)
    out = data[one] if one is not None else xp.take(data, idx, axis=ax)
    return out, ((idx, data.shape) if ctx.need_saved else None)


def _gather_data(xp, g, args, ans, saved, a, out):
    """Scatter-add ``g`` back onto the gathered rows: repeated indices accumulate."""
    idx, shape = saved
    ax = a["axis"] % len(shape)
    one = _selected(idx, ax)
    if one is not None:
        target = xp.zeros(shape, dtype=g.dtype)
        target[one] = g
        return target
    rows = shape[ax]
    # Bring the gathered axis to the front on both sides: target (rows, rest), values (n, rest).
    lead = tuple(range(ax, ax + idx.ndim))
    gm = xp.moveaxis(g, lead, tuple(range(idx.ndim)))  # a scalar index moves nothing
    rest = shape[:ax] + shape[ax + 1 :]
    target = xp.zeros((rows,) + rest, dtype=g.dtype)
    width = target.size // rows if rows else 0
    backend.scatter_add(xp, target.reshape(rows, width), idx.reshape(-1), gm.reshape(-1, width))
    return xp.moveaxis(target, 0, ax)


defvjp("gather", _gather_data, None, needs_args=())


# ---------------------------------------------------------------- expand


def _expand_check(a):
    s = a["shape"]
    if not isinstance(s, (list, tuple)) or not all(
        d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1) for d in s
    ):
        raise ShapeError(f"attribute 'shape' must list positive ints or null (the batch), got {s!r}")
    return {"shape": tuple(s)}


def _expand_type(types, a):
    x, target = types[0], a["shape"]
    pad = len(target) - x.ndim
    for k, d in enumerate(target):
        if d is None and (k < pad or x.shape[k - pad] is not None):
            raise ShapeError(f"expand of {fmt_shape(x.shape)} to {list(target)}: null must line up with the "
                             "input's batch dim")
    return TensorType(broadcast(x.shape, target, "input and target"), x.dtype)


@defop("expand", _expand_type, (1, 1), attrs={"shape": REQUIRED}, check=_expand_check)
def expand(xp, args, a, ctx):
    x = args[0]
    return xp.broadcast_to(x, _broadcast_runtime(x.shape, a["shape"])), (x.shape if ctx.need_saved else None)


def _broadcast_runtime(shape, target):
    """NumPy broadcasting of an array's shape with a target whose nulls mean the batch (they
    line up with the array's batch dim, so a null acts as 1)."""
    n = max(len(shape), len(target))
    s = (1,) * (n - len(shape)) + tuple(shape)
    t = (1,) * (n - len(target)) + tuple(1 if d is None else d for d in target)
    return tuple(d if e == 1 else e for d, e in zip(s, t))


defvjp("expand", lambda xp, g, args, ans, shape, a, out: unbroadcast(xp, g, shape), needs_args=())
