"""VJPs of the ops in ``ops_shape`` (see ``vjps`` for the conventions)."""

from __future__ import annotations

from hpc_rlx.device import backend
from hpc_rlx.graph.ops_shape import MAX_CONCAT, slice_index
from hpc_rlx.graph.registry import defvjp
from hpc_rlx.graph.vjps import unbroadcast


def _concat_part(position):
    def vjp(xp, g, args, ans, saved, a, out):
        ax, bounds = saved
        lo, hi = bounds[position]
        return g[(slice(None),) * ax + (slice(lo, hi),)]

    return vjp


defvjp("concat", *(_concat_part(i) for i in range(MAX_CONCAT)), needs_args=())


def _slice_x(xp, g, args, ans, shape, a, out):
    gx = xp.zeros(shape, dtype=g.dtype)
    gx[slice_index(a, shape)] = g
    return gx


defvjp("slice", _slice_x, needs_args=())


def _gather_data(xp, g, args, ans, saved, a, out):
    """Scatter-add ``g`` back onto the gathered rows: repeated indices accumulate."""
    idx, shape = saved
    ax = a["axis"] % len(shape)
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
defvjp("expand", lambda xp, g, args, ans, shape, a, out: unbroadcast(xp, g, shape), needs_args=())
