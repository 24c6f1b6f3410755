"""Normalisations: ``layer_norm``, ``instance_norm``, ``batch_norm``, ``softmax`` and
``log_softmax`` (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

from math import prod

from hpc_rlx.graph.ops.common import int_attr, sum_to
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import ShapeError, axis_index, fmt_shape, require_float

RUNNING_MEAN, RUNNING_VAR = 3, 4  # batch_norm's buffer arguments


# ---------------------------------------------------------------- layer norm


def _eps_check(a):
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ShapeError(f"attribute 'eps' must be a positive number, got {eps!r}")
    return {"eps": float(eps)}


def _layer_norm_check(a):
    k = a["trailing_axes"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ShapeError(f"attribute 'trailing_axes' must be a positive int, got {k!r}")
    return {**_eps_check(a), "trailing_axes": k}


def _layer_norm_type(types, a):
    x, k = types[0], a["trailing_axes"]
    require_float(x, "input")
    if x.ndim < k or None in x.shape[x.ndim - k:]:
        raise ShapeError(f"layer_norm over the last {k} dim(s) needs them known (not the batch), "
                         f"got {fmt_shape(x.shape)}")
    dims = x.shape[x.ndim - k:]
    for t, what in zip(types[1:], ("gamma", "beta")):
        require_float(t, what)
        if t.shape != dims:
            raise ShapeError(f"{what} shape {fmt_shape(t.shape)} must be {fmt_shape(dims)}")
    return x


def _rows(g, k):
    """``g`` as (rows, features): the normalised trailing ``k`` axes flattened into one."""
    return g.reshape(-1, prod(g.shape[g.ndim - k:]))


def _row_means(xp, m):
    """Each row's mean of the (rows, features) ``m``, as a (rows, 1) column: a GEMV against
    1/features, which runs at memory speed on short rows where ``mean(axis=-1)`` pays a
    reduction loop per row (2x the time of the whole layer norm on 16 or 32 features)."""
    return xp.matmul(m, xp.full(m.shape[1], 1.0 / m.shape[1], dtype=m.dtype))[:, None]


@defop("layer_norm", _layer_norm_type, (3, 3), attrs={"eps": 1e-5, "trailing_axes": 1}, check=_layer_norm_check,
       arg_names=("x", "gamma", "beta"))
def layer_norm(xp, args, a, ctx):
    """Normalise over the last ``trailing_axes`` axes (PyTorch's ``normalized_shape``, ONNX's
    ``axis`` counted from the end); gamma and beta have those axes' shape."""
    x, gamma, beta = args
    x2 = _rows(x, a["trailing_axes"])
    xc = x2 - _row_means(xp, x2)
    sq = xc * xc
    rstd = _row_means(xp, sq)
    rstd += a["eps"]
    xp.sqrt(rstd, out=rstd)
    xp.divide(1.0, rstd, out=rstd)
    xhat = xc
    xhat *= rstd
    out = xp.multiply(xhat, gamma.reshape(-1), out=sq)
    out += beta.reshape(-1)
    return out.reshape(x.shape), ((xhat, rstd) if ctx.need_saved else None)


def _normalised_rows_x(xp, gx, xhat, rstd):
    """The input gradient of rows normalised to zero mean and unit variance, from the
    gradient `gx` of the normalised rows `xhat` (in place in `gx`): layer norm's and instance
    norm's rule."""
    m1 = _row_means(xp, gx)
    m2 = _row_means(xp, gx * xhat)
    gx -= m1
    gx -= xhat * m2
    gx *= rstd
    return gx


def _layer_norm_x(xp, g, args, ans, saved, a, out):
    xhat, rstd = saved
    gx = _rows(g, a["trailing_axes"]) * args[1].reshape(-1)
    return _normalised_rows_x(xp, gx, xhat, rstd).reshape(g.shape)


def _column_sums(xp, m, shape, out):
    """Sum over the rows of (rows, features) ``m``, shaped ``shape`` (into ``out`` if given)."""
    ones = xp.ones(m.shape[0], dtype=m.dtype)
    if out is not None:
        xp.matmul(ones, m, out=out.reshape(-1))
        return out
    return xp.matmul(ones, m).reshape(shape)


def _layer_norm_gamma(xp, g, args, ans, saved, a, out):
    return _column_sums(xp, _rows(g, a["trailing_axes"]) * saved[0], args[1].shape, out)


def _layer_norm_beta(xp, g, args, ans, saved, a, out):
    return _column_sums(xp, _rows(g, a["trailing_axes"]), args[1].shape, out)  # beta is shaped as gamma


defvjp("layer_norm", _layer_norm_x, _layer_norm_gamma, _layer_norm_beta, needs_args=(1,))


# ---------------------------------------------------------------- batch norm


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
    sync = getattr(ctx, "sync", None) if batch_stats else None
    count = None
    if batch_stats:
        if sync is None:
            axes = channel_axes(x)
            mean = x.mean(axis=axes)
            xc = x - per_channel(mean, nd)
            var = (xc * xc).mean(axis=axes)
            count = x.size // x.shape[1]
        else:  # model.sync_batch_norm: the statistics of the global batch
            mean, var, count, xc = global_moments(xp, x, running_mean, sync)
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
    return out, ((xhat, rstd, batch_stats, sync, count) if ctx.need_saved else None)


def _bn_x(xp, g, args, ans, saved, a, out):
    xhat, rstd, batch_stats, sync, count = saved
    nd = g.ndim
    k = per_channel(args[1] * rstd, nd)  # scale / std
    if not batch_stats:  # the running statistics are constants
        return g * k
    # The batch mean and variance depend on x too: the layer_norm rule, over the batch axes
    # (with model.sync_batch_norm, over the global batch: its sums from every part).
    axes = channel_axes(g)
    if sync is None:
        count = g.size // g.shape[1]
        g_sum, gx_sum = g.sum(axis=axes), (g * xhat).sum(axis=axes)
    else:
        g_sum, gx_sum = global_sums(xp, sync, (g.sum(axis=axes), (g * xhat).sum(axis=axes)), g.dtype)
    inv = 1.0 / max(count, 1)   # 0 rows in the whole micro-batch (stand-ins alone): all sums 0
    gx = g - per_channel(g_sum * inv, nd)
    gx -= xhat * per_channel(gx_sum * inv, nd)
    gx *= k
    return gx


def global_moments(xp, x, shift, allsum):
    """The mean, biased variance and count of ``x``'s channels over the global batch, of which
    ``x`` is one part, and ``x`` centred on that mean: ``allsum`` (the executor's ``ctx.sync``)
    returns an array summed over every part. One call carries the count and the sums of
    ``x - shift`` and of its squares, formed in float64 from this part's own mean and centred
    sum of squares (two passes in the compute dtype, as the unsynchronised layer does), so the
    variance is as accurate as that layer's however far the mean lies from ``shift`` (the
    running mean: equal in every part)."""
    c, axes = x.shape[1], channel_axes(x)
    n = x.size // c
    mean = x.mean(axis=axes)
    xc = x - per_channel(mean, x.ndim)
    d = mean.astype(xp.float64) - shift.astype(xp.float64)
    part = xp.empty(2 * c + 1, dtype=xp.float64)
    part[0] = n
    part[1:c + 1] = n * d
    part[c + 1:] = (xc * xc).sum(axis=axes).astype(xp.float64) + n * d * d
    total = allsum(part)
    count = float(total[0])
    dm = total[1:c + 1] / max(count, 1.0)      # 0: stand-ins alone (runtime/batch_sync.py)
    var = xp.maximum(total[c + 1:] / max(count, 1.0) - dm * dm, 0.0)
    xc += per_channel((d - dm).astype(x.dtype), x.ndim)    # x - the global mean
    return (shift + dm).astype(x.dtype), var.astype(x.dtype), count, xc


def global_sums(xp, allsum, sums, dtype):
    """Per-channel ``sums`` (all of one length) summed over every part by one ``allsum`` call."""
    total = allsum(xp.concatenate([s.astype(xp.float64) for s in sums]))
    return [t.astype(dtype) for t in xp.split(total, len(sums))]


def _bn_scale(xp, g, args, ans, saved, a, out):
    return sum_to(xp, g * saved[0], channel_axes(g), out)


def _bn_bias(xp, g, args, ans, saved, a, out):
    return sum_to(xp, g, channel_axes(g), out)


# The running statistics are buffers: never differentiated.
defvjp("batch_norm", _bn_x, _bn_scale, _bn_bias, None, None, needs_args=(1,))


# ---------------------------------------------------------------- instance norm


def _instance_norm_type(types, a):
    x = types[0]
    require_float(x, "input")
    if x.ndim < 3 or None in x.shape[1:]:
        raise ShapeError(f"instance_norm needs (B, C, spatial...) input with C and the spatial dims known, "
                         f"got {fmt_shape(x.shape)}")
    for t, what in zip(types[1:], ("scale", "bias")):
        require_float(t, what)
        if t.shape != (x.shape[1],):
            raise ShapeError(f"{what} shape {fmt_shape(t.shape)} must be ({x.shape[1]},)")
    return x


@defop("instance_norm", _instance_norm_type, (3, 3), attrs={"eps": 1e-5}, check=_eps_check,
       arg_names=("x", "scale", "bias"))
def instance_norm(xp, args, a, ctx):
    """ONNX InstanceNormalization: each sample's channel normalised over its spatial dims
    (biased variance), then a scale and bias per channel. PyTorch's GroupNorm exports as this
    over (B, groups, rest) with scale 1 and bias 0, its affine applied after."""
    x, scale, bias = args
    rows = _rows(x, x.ndim - 2)       # (B*C, spatial)
    xc = rows - _row_means(xp, rows)
    rstd = _row_means(xp, xc * xc)
    rstd += a["eps"]
    xp.sqrt(rstd, out=rstd)
    xp.divide(1.0, rstd, out=rstd)
    xc *= rstd
    xhat = xc.reshape(x.shape)
    out = xhat * per_channel(scale, x.ndim)
    out += per_channel(bias, x.ndim)
    return out, ((xhat, rstd) if ctx.need_saved else None)


def _instance_norm_x(xp, g, args, ans, saved, a, out):
    """The layer_norm rule per (sample, channel) row, with the channel's scale."""
    xhat, rstd = saved
    k = g.ndim - 2
    gx = _rows(g * per_channel(args[1], g.ndim), k)
    return _normalised_rows_x(xp, gx, _rows(xhat, k), rstd).reshape(g.shape)


defvjp("instance_norm", _instance_norm_x,
       lambda xp, g, args, ans, saved, a, out: sum_to(xp, g * saved[0], channel_axes(g), out),
       lambda xp, g, args, ans, saved, a, out: sum_to(xp, g, channel_axes(g), out), needs_args=(1,))


# ---------------------------------------------------------------- softmax


def _softmax_type(types, a):
    require_float(types[0], "input")
    axis_index(a["axis"], types[0].ndim)
    return types[0]


@defop("softmax", _softmax_type, (1, 1), attrs={"axis": -1}, check=int_attr("axis"))
def softmax(xp, args, a, ctx):
    x, ax = args[0], a["axis"]
    e = x - x.max(axis=ax, keepdims=True)
    xp.exp(e, out=e)
    e /= _sums_over(xp, e, ax)
    return e, None


def _sums_over(xp, m, ax):
    """``m.sum(axis=ax, keepdims=True)``; over the last axis of a C-ordered array, a GEMV
    (attention's rows of 16-64 scores: a tenth of the time)."""
    if ax % m.ndim == m.ndim - 1 and m.flags.c_contiguous:
        rows = m.reshape(-1, m.shape[-1])
        return xp.matmul(rows, xp.ones(rows.shape[1], dtype=m.dtype)).reshape(m.shape[:-1] + (1,))
    return m.sum(axis=ax, keepdims=True)


def _softmax_x(xp, g, args, ans, s, a, out):
    gx = g * ans
    dot = _sums_over(xp, gx, a["axis"])
    gx = g - dot
    gx *= ans
    return gx


defvjp("softmax", _softmax_x, needs_args=(), needs_ans=True)


@defop("log_softmax", _softmax_type, (1, 1), attrs={"axis": -1}, check=int_attr("axis"))
def log_softmax(xp, args, a, ctx):
    x, ax = args[0], a["axis"]
    out = x - x.max(axis=ax, keepdims=True)
    lse = xp.exp(out).sum(axis=ax, keepdims=True)
    out -= xp.log(lse)
    return out, None


def _log_softmax_x(xp, g, args, ans, s, a, out):
    gx = xp.exp(ans)
    gx *= g.sum(axis=a["axis"], keepdims=True)
    xp.subtract(g, gx, out=gx)
    return gx


defvjp("log_softmax", _log_softmax_x, needs_args=(), needs_ans=True)
