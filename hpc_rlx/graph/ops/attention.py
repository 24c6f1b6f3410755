"""``causal_mask``: attention scores with the keys after each query hidden (conventions in
``hpc_rlx.graph.ops``)."""

from __future__ import annotations

import math

from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import ShapeError, fmt_shape, require_float


def _causal_type(types, a):
    x = types[0]
    require_float(x, "input")
    if x.ndim < 2 or x.shape[-1] != x.shape[-2] or x.shape[-1] is None:
        raise ShapeError(f"causal_mask needs (..., T, T) scores, got {fmt_shape(x.shape)}")
    return x


def _fill_check(a):
    f = a["fill"]
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
        raise ShapeError(f"attribute 'fill' must be a finite number, got {f!r}")
    return {"fill": float(f)}


def causal_mask_array(xp, t: int):
    """True above the diagonal: key positions a query may not attend to."""
    return xp.triu(xp.ones((t, t), dtype=bool), 1)


@defop("causal_mask", _causal_type, (1, 1), attrs={"fill": -1e9}, check=_fill_check)
def causal_mask(xp, args, a, ctx):
    # A large finite fill rather than -inf: softmax still gives exact zeros, and no
    # inf - inf = nan can appear in anything downstream.
    x = args[0]
    mask = causal_mask_array(xp, x.shape[-1])
    return xp.where(mask, a["fill"], x).astype(x.dtype, copy=False), (mask if ctx.need_saved else None)


defvjp("causal_mask", lambda xp, g, args, ans, mask, a, out: xp.where(mask, 0.0, g).astype(g.dtype, copy=False),
       needs_args=())
