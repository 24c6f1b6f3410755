"""Running sums and index ops: ``cumsum``, ``gather_elements``, ``gather_nd``,
``scatter_elements`` and ``scatter_nd`` (conventions in ``hpc_rlx.graph.ops``). Semantics
follow ONNX (CumSum, GatherElements, GatherND, ScatterElements, ScatterND): negative indices
count from the end.

Each takes float or int64 data. On int64 data (position ids from the token ids, decoder ids
shifted right) they are computed at run time and never differentiated; on float data the
gradient flows to the data and, for the scatters, to the updates. Indices are int64 and carry
no gradient.

An index never addresses the batch dim: each lane holds a slice of the batch, so an index into
it would mean another sample on every lane. Per-sample indexing is ``batch_dims=1`` with the
batch the first dim of data, indices (and updates).
"""

from __future__ import annotations

import math

from hpc_rlx.base import backend
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import ShapeError, TensorType, axis_index, fmt_shape, require_int

_REDUCTIONS = ("none", "add")


def _int(value, name):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShapeError(f"attribute '{name}' must be an int, got {value!r}")
    return value


def _bool(value, name):
    if not isinstance(value, bool):
        raise ShapeError(f"attribute '{name}' must be true or false, got {value!r}")
    return value


def _reduction(value):
    if value not in _REDUCTIONS:
        raise ShapeError(f"attribute 'reduction' must be one of {', '.join(_REDUCTIONS)}, got {value!r}")
    return value


def _not_batch(shape, axis, what):
    if shape[axis] is None:
        raise ShapeError(f"{what} along axis {axis}, the batch dim: each lane holds only part of the batch")


def _one_batch(shape, what):
    if sum(d is None for d in shape) > 1:
        raise ShapeError(f"{what} would have two batch dims: {fmt_shape(shape)}")
    return shape


def wrap(xp, idx, size):
    """ONNX's negative indices, counted from the end of an axis of ``size``."""
    return xp.where(idx < 0, idx + size, idx)


# ---------------------------------------------------------------- cumsum


def _cumsum_type(types, a):
    x = types[0]
    ax = axis_index(a["axis"], x.ndim)
    _not_batch(x.shape, ax, "a running sum")
    return x


@defop("cumsum", _cumsum_type, (1, 1), attrs={"axis": 0, "exclusive": False, "reverse": False},
       check=lambda a: {"axis": _int(a["axis"], "axis"), "exclusive": _bool(a["exclusive"], "exclusive"),
                        "reverse": _bool(a["reverse"], "reverse")})
def cumsum(xp, args, a, ctx):
    return running_sum(xp, args[0], a["axis"] % args[0].ndim, a["exclusive"], a["reverse"]), None


def running_sum(xp, x, ax, exclusive, reverse):
    """ONNX CumSum along ``ax``: ``exclusive`` leaves each element out of its own sum,
    ``reverse`` sums from the end."""
    if reverse:
        x = xp.flip(x, axis=ax)
    out = xp.cumsum(x, axis=ax, dtype=x.dtype)
    if exclusive:  # shifted one place along ax, a zero first (slices: the same on every backend)
        body = tuple(slice(0, -1) if k == ax else slice(None) for k in range(out.ndim))
        first = tuple(1 if k == ax else d for k, d in enumerate(out.shape))
        out = xp.concatenate([xp.zeros(first, dtype=out.dtype), out[body]], axis=ax)
    return xp.flip(out, axis=ax) if reverse else out


def _cumsum_x(xp, g, args, ans, s, a, out):
    # Each input adds to the outputs after it (before it when reversed): the transpose of a
    # running sum is the running sum the other way, exclusive as the forward was.
    return running_sum(xp, g, a["axis"] % g.ndim, a["exclusive"], not a["reverse"])


defvjp("cumsum", _cumsum_x, needs_args=())


# ---------------------------------------------------------------- elements along an axis


def _axis_check(a):
    return {"axis": _int(a["axis"], "axis")}


def _elements_index(xp, idx, ax, size):
    """The full NumPy index of ``take_along_axis``: ``idx`` (wrapped) on ``ax``, each other axis
    its own position."""
    idx = wrap(xp, idx, size)
    grid = [xp.arange(n).reshape((1,) * k + (n,) + (1,) * (idx.ndim - k - 1)) for k, n in enumerate(idx.shape)]
    grid[ax] = idx
    return tuple(grid)


def _gather_elements_type(types, a):
    data, idx = types
    require_int(idx, "indices")
    if idx.ndim != data.ndim:
        raise ShapeError(f"indices {fmt_shape(idx.shape)} must have the rank of data {fmt_shape(data.shape)}")
    ax = axis_index(a["axis"], data.ndim)
    _not_batch(data.shape, ax, "gather_elements")
    for k, (d, i) in enumerate(zip(data.shape, idx.shape)):
        if k != ax and (d is None) != (i is None) or k != ax and d is not None and i > d:
            raise ShapeError(f"indices {fmt_shape(idx.shape)} do not fit data {fmt_shape(data.shape)} outside axis {ax}")
    return TensorType(idx.shape, data.dtype)


@defop("gather_elements", _gather_elements_type, (2, 2), attrs={"axis": 0}, check=_axis_check,
       arg_names=("data", "indices"))
def gather_elements(xp, args, a, ctx):
    data, idx = args
    ax = a["axis"] % data.ndim
    index = _elements_index(xp, idx, ax, data.shape[ax])
    return data[index], ((index, data.shape) if ctx.need_saved else None)


def _scatter_add_at(xp, shape, index, values):
    """Zeros of ``shape`` with ``values`` added at the advanced ``index`` (repeats accumulate)."""
    target = xp.zeros(math.prod(shape), dtype=values.dtype)
    flat = xp.ravel_multi_index(tuple(xp.broadcast_to(i, values.shape) for i in index), shape)
    backend.scatter_add(xp, target.reshape(-1, 1), flat.reshape(-1), values.reshape(-1, 1))
    return target.reshape(shape)


def _gather_elements_data(xp, g, args, ans, saved, a, out):
    index, shape = saved
    return _scatter_add_at(xp, shape, index, g)


defvjp("gather_elements", _gather_elements_data, None, needs_args=())


def _scatter_elements_type(types, a):
    data, idx, upd = types
    require_int(idx, "indices")
    if upd.dtype != data.dtype:
        raise ShapeError(f"updates are {upd.dtype} but data is {data.dtype}")
    if upd.shape != idx.shape:
        raise ShapeError(f"updates {fmt_shape(upd.shape)} must have the shape of indices {fmt_shape(idx.shape)}")
    _gather_elements_type((data, idx), a)
    return data


@defop("scatter_elements", _scatter_elements_type, (3, 3), attrs={"axis": 0, "reduction": "none"},
       check=lambda a: {**_axis_check(a), "reduction": _reduction(a["reduction"])},
       arg_names=("data", "indices", "updates"))
def scatter_elements(xp, args, a, ctx):
    data, idx, upd = args
    ax = a["axis"] % data.ndim
    index = _elements_index(xp, idx, ax, data.shape[ax])
    out = data.copy()
    if a["reduction"] == "add":
        out += _scatter_add_at(xp, data.shape, index, upd)
    else:
        out[index] = upd
    return out, (index if ctx.need_saved else None)


def _scatter_elements_data(xp, g, args, ans, index, a, out):
    if a["reduction"] == "add":
        return g
    gd = g.copy()
    gd[index] = 0  # overwritten entries do not reach the output
    return gd


def _scatter_elements_updates(xp, g, args, ans, index, a, out):
    return g[index]


defvjp("scatter_elements", _scatter_elements_data, None, _scatter_elements_updates, needs_args=())


# ---------------------------------------------------------------- index tuples (ND)


def _nd_check(a):
    b = _int(a["batch_dims"], "batch_dims")
    if b < 0:
        raise ShapeError(f"attribute 'batch_dims' must be 0 or more, got {b}")
    return {"batch_dims": b}


def _nd_depth(data, idx, b, what):
    """The length of the index tuples, checked against data."""
    require_int(idx, "indices")
    if idx.ndim < b + 1 or data.ndim < b:
        raise ShapeError(f"{what} with batch_dims={b} needs indices of rank > {b}, got {fmt_shape(idx.shape)}")
    if data.shape[:b] != idx.shape[:b]:
        raise ShapeError(f"the first {b} dims of data {fmt_shape(data.shape)} and indices {fmt_shape(idx.shape)} "
                         f"must agree")
    q = idx.shape[-1]
    if q is None or b + q > data.ndim:
        raise ShapeError(f"index tuples of length {q} do not fit data {fmt_shape(data.shape)} after {b} batch dims")
    for k in range(b, b + q):
        _not_batch(data.shape, k, what)
    return q


def _nd_index(xp, idx, shape, b):
    """The NumPy advanced index of ONNX index tuples ``idx`` (with ``b`` leading batch dims)
    into an array of ``shape``."""
    q = idx.shape[-1]
    lead = idx.shape[:-1]
    grid = [xp.arange(n).reshape((n,) + (1,) * (len(lead) - k - 1)) for k, n in enumerate(lead[:b])]
    return tuple(grid) + tuple(wrap(xp, idx[..., k], shape[b + k]) for k in range(q))


def _gather_nd_type(types, a):
    data, idx = types
    q = _nd_depth(data, idx, a["batch_dims"], "gather_nd")
    return TensorType(_one_batch(idx.shape[:-1] + data.shape[a["batch_dims"] + q:], "gather_nd's output"), data.dtype)


@defop("gather_nd", _gather_nd_type, (2, 2), attrs={"batch_dims": 0}, check=_nd_check, arg_names=("data", "indices"))
def gather_nd(xp, args, a, ctx):
    data, idx = args
    index = _nd_index(xp, idx, data.shape, a["batch_dims"])
    return data[index], ((index, data.shape) if ctx.need_saved else None)


def _nd_scatter_add(xp, shape, index, values):
    """Zeros of ``shape`` with ``values`` added at index tuples ``index`` (repeats accumulate)."""
    depth = len(index)
    rows = math.prod(shape[:depth])
    lead = values.shape[:values.ndim - (len(shape) - depth)]
    flat = xp.ravel_multi_index(tuple(xp.broadcast_to(i, lead) for i in index), shape[:depth])
    target = xp.zeros((rows, math.prod(shape[depth:])), dtype=values.dtype)
    backend.scatter_add(xp, target, flat.reshape(-1), values.reshape(flat.size, -1))
    return target.reshape(shape)


def _gather_nd_data(xp, g, args, ans, saved, a, out):
    index, shape = saved
    return _nd_scatter_add(xp, shape, index, g)


defvjp("gather_nd", _gather_nd_data, None, needs_args=())


def _scatter_nd_type(types, a):
    data, idx, upd = types
    if upd.dtype != data.dtype:
        raise ShapeError(f"updates are {upd.dtype} but data is {data.dtype}")
    q = _nd_depth(data, idx, a["batch_dims"], "scatter_nd")
    want = idx.shape[:-1] + data.shape[a["batch_dims"] + q:]
    if upd.shape != want:
        raise ShapeError(f"updates {fmt_shape(upd.shape)} must have shape {fmt_shape(want)} (indices "
                         f"{fmt_shape(idx.shape)} into data {fmt_shape(data.shape)})")
    return data


@defop("scatter_nd", _scatter_nd_type, (3, 3), attrs={"batch_dims": 0, "reduction": "none"},
       check=lambda a: {**_nd_check(a), "reduction": _reduction(a["reduction"])},
       arg_names=("data", "indices", "updates"))
def scatter_nd(xp, args, a, ctx):
    data, idx, upd = args
    index = _nd_index(xp, idx, data.shape, a["batch_dims"])
    out = data.copy()
    if a["reduction"] == "add":
        out += _nd_scatter_add(xp, data.shape, index, upd)
    else:
        out[index] = upd
    return out, (index if ctx.need_saved else None)


def _scatter_nd_data(xp, g, args, ans, index, a, out):
    if a["reduction"] == "add":
        return g
    gd = g.copy()
    gd[index] = 0
    return gd


def _scatter_nd_updates(xp, g, args, ans, index, a, out):
    return g[index]


defvjp("scatter_nd", _scatter_nd_data, None, _scatter_nd_updates, needs_args=())
