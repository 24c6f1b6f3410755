"""Reductions: ``sum`` and ``mean`` over some axes or all, and ``argmax`` along one axis (an
int64 index without gradient) (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, INT, ShapeError, TensorType, axis_index, require_float


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


# ---------------------------------------------------------------- argmax


def _argmax_check(a):
    if isinstance(a["axis"], bool) or not isinstance(a["axis"], int):
        raise ShapeError(f"attribute 'axis' must be an int, got {a['axis']!r}")
    for k in ("keepdims", "select_last_index"):
        if not isinstance(a[k], bool):
            raise ShapeError(f"attribute '{k}' must be true or false, got {a[k]!r}")
    return a


def _argmax_type(types, a):
    x = types[0]
    ax = axis_index(a["axis"], x.ndim)
    if x.shape[ax] is None:
        raise ShapeError("argmax along the batch dim: each lane holds a slice of the batch")
    shape = tuple(1 if i == ax else d for i, d in enumerate(x.shape)) if a["keepdims"] else \
        tuple(d for i, d in enumerate(x.shape) if i != ax)
    return TensorType(shape, INT)


@defop("argmax", _argmax_type, (1, 1), attrs={"axis": 0, "keepdims": False, "select_last_index": False},
       check=_argmax_check)
def argmax(xp, args, a, ctx):
    """ONNX ArgMax on float or int64 data: the first largest entry's index, or the last with
    ``select_last_index`` (a decoder's last non-padding token, found as the largest position
    times the mask). An int64 output: no gradient."""
    x, ax = args[0], a["axis"] % args[0].ndim
    if a["select_last_index"]:
        out = x.shape[ax] - 1 - xp.flip(x, axis=ax).argmax(axis=ax)
    else:
        out = x.argmax(axis=ax)
    out = out.astype(xp.int64)
    return (xp.expand_dims(out, ax) if a["keepdims"] else out), None
