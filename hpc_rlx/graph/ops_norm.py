"""``batch_norm`` and ``log_softmax``: type rules and forwards (see ``ops`` for the conventions,
``vjps_norm`` for the VJPs)."""

from __future__ import annotations

from hpc_rlx.graph.registry import defop
from hpc_rlx.graph.shapes import ShapeError, axis_index, fmt_shape, require_float

RUNNING_MEAN, RUNNING_VAR = 3, 4  # batch_norm's buffer arguments


def _bn_check(a):
    eps, momentum, training = a["eps"], a["momentum"], a["training"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ShapeError(f"attribute 'eps' must be a positive number, got {eps!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0:
        raise ShapeError(f"attribute 'momentum' must be a number in [0, 1], got {momentum!r}")
    if not isinstance(training, bool):
        raise ShapeError(f"attribute 'training' must be true or false, got {training!r}")
    return {"eps": float(eps), "momentum": float(momentum), "training": training}


def _bn_type(types, a):
    x = types[0]
    require_float(x, "input")
    if x.ndim < 2 or x.shape[1] is None:
        raise ShapeError(f"batch_norm needs (B, C, ...) input with a known C, got {fmt_shape(x.shape)}")
    for t, what in zip(types[1:], ("scale", "bias", "running_mean", "running_var")):
        require_float(t, what)
        if t.shape != (x.shape[1],):
            raise ShapeError(f"{what} shape {fmt_shape(t.shape)} must be ({x.shape[1]},)")
    return x


def channel_axes(x):
    """Every axis but the channel axis 1: what batch norm reduces over."""
    return (0,) + tuple(range(2, x.ndim))


def per_channel(v, ndim):
    """A (C,) vector shaped to broadcast against (B, C, ...)."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@defop("batch_norm", _bn_type, (5, 5), attrs={"eps": 1e-5, "momentum": 0.1, "training": True}, check=_bn_check,
       arg_names=("x", "scale", "bias", "running_mean", "running_var"))
def batch_norm(xp, args, a, ctx):
    """Training (``training`` and ``ctx.train``): normalise with the batch statistics (biased
    variance, as PyTorch) and publish the batch mean and unbiased variance for the running
    buffers. Otherwise normalise with the running statistics."""
    x, scale, bias, running_mean, running_var = args
    nd = x.ndim
    batch_stats = a["training"] and ctx.train
    if batch_stats:
        axes = channel_axes(x)
        mean = x.mean(axis=axes)
        xc = x - per_channel(mean, nd)
        var = (xc * xc).mean(axis=axes)
        count = x.size // x.shape[1]
        emit = getattr(ctx, "emit", None)
        if emit is not None:
            emit(RUNNING_MEAN, mean)
            emit(RUNNING_VAR, var * (count / (count - 1)) if count > 1 else var)
    else:
        mean, var = running_mean, running_var
        if not ctx.need_saved:  # inference: one fused scale and shift
            k = scale / xp.sqrt(var + a["eps"])
            out = x * per_channel(k, nd)
            out += per_channel(bias - mean * k, nd)
            return out, None
        xc = x - per_channel(mean, nd)
    rstd = 1.0 / xp.sqrt(var + a["eps"])
    xhat = xc
    xhat *= per_channel(rstd, nd)
    out = xhat * per_channel(scale, nd)
    out += per_channel(bias, nd)
    return out, ((xhat, rstd, batch_stats) if ctx.need_saved else None)


def _check_axis(a):
    if isinstance(a["axis"], bool) or not isinstance(a["axis"], int):
        raise ShapeError(f"attribute 'axis' must be an int, got {a['axis']!r}")
    return a


def _log_softmax_type(types, a):
    require_float(types[0], "input")
    axis_index(a["axis"], types[0].ndim)
    return types[0]


@defop("log_softmax", _log_softmax_type, (1, 1), attrs={"axis": -1}, check=_check_axis)
def log_softmax(xp, args, a, ctx):
    x, ax = args[0], a["axis"]
    out = x - x.max(axis=ax, keepdims=True)
    lse = xp.exp(out).sum(axis=ax, keepdims=True)
    out -= xp.log(lse)
    return out, None


