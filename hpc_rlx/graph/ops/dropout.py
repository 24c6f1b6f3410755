"""``dropout``: inverted dropout, its masks drawn from the step seed and the node (conventions
in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

from hpc_rlx.base import backend
from hpc_rlx.graph.ops.common import same_float
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import ShapeError


def _check_dropout(a):
    p = a["p"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ShapeError(f"attribute 'p' must be a probability in [0, 1), got {p!r}")
    return {"p": float(p)}


@defop("dropout", same_float, (1, 1), attrs={"p": REQUIRED}, check=_check_dropout)
def dropout(xp, args, a, ctx):
    x, p = args[0], a["p"]
    if not ctx.train or p == 0.0:
        return x, None
    if ctx.seed is None:
        raise ValueError(f"dropout node '{ctx.node}' runs in train mode and needs a seed")
    u = backend.uniform(xp, backend.derive_seed(ctx.seed, ctx.index), x.shape, x.dtype)
    mask = (u >= p).astype(x.dtype)
    mask *= 1.0 / (1.0 - p)
    return x * mask, mask


defvjp("dropout", lambda xp, g, args, ans, mask, a, out: g if mask is None else g * mask, needs_args=())
