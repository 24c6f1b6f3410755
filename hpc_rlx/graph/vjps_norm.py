"""VJPs of the ops in ``ops_norm`` (see ``vjps`` for the conventions)."""

from __future__ import annotations

from hpc_rlx.graph.ops_norm import channel_axes, per_channel
from hpc_rlx.graph.registry import defvjp
from hpc_rlx.graph.vjps import _sum_to


def _bn_x(xp, g, args, ans, saved, a, out):
    xhat, rstd, batch_stats = saved
    nd = g.ndim
    k = per_channel(args[1] * rstd, nd)  # scale / std
    if not batch_stats:  # the running statistics are constants
        return g * k
    # The batch mean and variance depend on x too: the layer_norm rule, over the batch axes.
    axes = channel_axes(g)
    count = g.size // g.shape[1]
    gx = g - per_channel(g.sum(axis=axes) * (1.0 / count), nd)
    gx -= xhat * per_channel((g * xhat).sum(axis=axes) * (1.0 / count), nd)
    gx *= k
    return gx


def _bn_scale(xp, g, args, ans, saved, a, out):
    return _sum_to(xp, g * saved[0], channel_axes(g), out)


def _bn_bias(xp, g, args, ans, saved, a, out):
    return _sum_to(xp, g, channel_axes(g), out)


# The running statistics are buffers: never differentiated.
defvjp("batch_norm", _bn_x, _bn_scale, _bn_bias, None, None, needs_args=(1,))


def _log_softmax_x(xp, g, args, ans, s, a, out):
    gx = xp.exp(ans)
    gx *= g.sum(axis=a["axis"], keepdims=True)
    xp.subtract(g, gx, out=gx)
    return gx


defvjp("log_softmax", _log_softmax_x, needs_args=(), needs_ans=True)
