"""``max_pool2d`` and ``avg_pool2d``: window kernels on the batch-last layout of ``windows``,
the ops and their VJPs (conventions in ``hpc_rlx.graph.ops``). Both take images (B, C, H, W)
and, with the same code, volumes (B, C, D, H, W) (3-D pooling).

Pooling compares or adds only the part of each window that lies inside the image. Max pooling
keeps the first maximum's offset per window as int8 (as PyTorch, the first maximum wins on
ties).
"""

from __future__ import annotations

from hpc_rlx.graph.ops.conv import smallest, spatial_rank
from hpc_rlx.graph.ops.windows import batch_first_view, batch_last, batch_last_view, out_sizes, plan
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType, fmt_shape, geometry, per_axis, require_float


def max_pool_forward(xp, x, kernel, stride, padding, keep_index, dilation=None):
    """Max over each window; with ``keep_index`` also the winning offset (the first max wins,
    as in PyTorch). Offsets only grow, so the last strict improvement is a running maximum of
    ``offset * improved``: cheap int8 passes instead of masked assignment. Returns the output
    and the index as (B, C, Ho, Wo) views of batch-last arrays."""
    p = plan(x.shape[2:], kernel, stride, padding, dilation)
    wins = p.live
    xb = batch_last(xp, x)
    shape = (x.shape[1], *p.out, x.shape[0])
    out = xp.empty(shape, dtype=x.dtype)
    index = scratch = None
    if keep_index:
        itype = xp.int8 if len(p.windows) <= 127 else xp.int32
        index = xp.zeros(shape, dtype=itype)
    if wins[0][3] != "all":
        out.fill(-float("inf"))
    for k, (n, oidx, iidx, kind, _) in enumerate(wins):
        win, dst = xb[iidx], out[oidx]
        if k == 0 and kind == "all":
            dst[...] = win
            continue
        if keep_index:
            better = xp.greater(win, dst)
            if itype == xp.int8:
                better = better.view(xp.int8)  # same bytes: no cast pass
            if scratch is None:
                scratch = xp.empty(shape, dtype=itype)
            sc = scratch[oidx]
            xp.multiply(better, n, out=sc)
            idx = index[oidx]
            xp.maximum(idx, sc, out=idx)
        xp.maximum(dst, win, out=dst)
    return batch_first_view(out), (None if index is None else batch_first_view(index))


def max_pool_grad(xp, g, index, x_shape, kernel, stride, padding, dilation=None):
    b, c, *size = x_shape
    p = plan(size, kernel, stride, padding, dilation)
    gb, ib = batch_last(xp, g), batch_last_view(index)
    if p.disjoint and p.tiles:
        gx = xp.empty((c, *size, b), dtype=g.dtype)  # every cell gets written once
    else:
        gx = xp.zeros((c, *size, b), dtype=g.dtype)
    for n, oidx, iidx, _, _ in p.live:
        hit = ib[oidx] == n
        if p.disjoint:  # each input cell is in one window at most: write, don't accumulate
            xp.multiply(gb[oidx], hit, out=gx[iidx])
        else:
            gx[iidx] += gb[oidx] * hit
    return batch_first_view(gx)


def _window_counts(xp, size, out, kernel, stride, padding, dtype):
    """(Ho, Wo, 1): how many input cells (padding not counted) each pooling window covers."""
    def along(n, no, k, s, p):
        start = xp.arange(no) * s - p
        return xp.clip(start + k, 0, n) - xp.clip(start, 0, n)

    nd = len(size)
    counts = None
    for a in range(nd):  # the product over the axes, each count along its own axis
        c = along(size[a], out[a], kernel[a], stride[a], padding[a]).reshape((-1,) + (1,) * (nd - 1 - a))
        counts = c if counts is None else counts * c
    return counts.astype(dtype)[..., None]


def avg_pool_forward(xp, x, kernel, stride, padding, count_include_pad=True):
    """Mean over each window; zero padding counted unless ``count_include_pad`` is false."""
    p = plan(x.shape[2:], kernel, stride, padding)
    xb = batch_last(xp, x)
    shape = (x.shape[1], *p.out, x.shape[0])
    if p.live[0][3] == "all":
        out = xp.empty(shape, dtype=x.dtype)
    else:
        out = xp.zeros(shape, dtype=x.dtype)
    for k, (n, oidx, iidx, kind, _) in enumerate(p.live):
        if k == 0 and kind == "all":
            out[...] = xb[iidx]
        else:
            out[oidx] += xb[iidx]
    if count_include_pad or not any(padding):
        out *= 1.0 / len(p.windows)
    else:
        out /= _window_counts(xp, x.shape[2:], p.out, kernel, stride, padding, x.dtype)
    return batch_first_view(out)


def avg_pool_grad(xp, g, x_shape, kernel, stride, padding, count_include_pad=True):
    b, c, *size = x_shape
    p = plan(size, kernel, stride, padding)
    if count_include_pad or not any(padding):
        gs = batch_last(xp, g) * (1.0 / len(p.windows))
    else:
        gs = batch_last(xp, g) / _window_counts(xp, size, p.out, kernel, stride, padding, g.dtype)
    if p.disjoint and p.tiles:
        gx = xp.empty((c, *size, b), dtype=g.dtype)
    else:
        gx = xp.zeros((c, *size, b), dtype=g.dtype)
    for n, oidx, iidx, _, _ in p.live:
        if p.disjoint:
            gx[iidx] = gs[oidx]
        else:
            gx[iidx] += gs[oidx]
    return batch_first_view(gx)


# ---------------------------------------------------------------- the ops


def _pool_check(a):
    k = geometry(a["kernel"], "kernel")
    s = k if a["stride"] is None else geometry(a["stride"], "stride")
    p = geometry(a["padding"], "padding")
    lengths = {len(v) for v in (k, s, p) if not isinstance(v, int)}
    if len(lengths) > 1:
        raise ShapeError(f"kernel, stride and padding must have one value per spatial axis alike; got kernel={k} "
                         f"stride={s} padding={p}")
    nd = lengths.pop() if lengths else 1
    ks, ps = per_axis(k, nd, "kernel"), per_axis(p, nd, "padding")
    if smallest(k) < 1 or smallest(s) < 1 or smallest(p) < 0 or any(pi * 2 > ki for pi, ki in zip(ps, ks)):
        raise ShapeError(f"need kernel >= 1, stride >= 1, 0 <= padding <= kernel/2; got kernel={k} stride={s} padding={p}")
    return {"kernel": k, "stride": s, "padding": p}


def _max_pool_check(a):
    d = geometry(a["dilation"], "dilation")
    if smallest(d) < 1:
        raise ShapeError(f"attribute 'dilation' must be >= 1, got {a['dilation']!r}")
    return {**_pool_check(a), "dilation": d}


def _avg_pool_check(a):
    if not isinstance(a["count_include_pad"], bool):
        raise ShapeError(f"attribute 'count_include_pad' must be true or false, got {a['count_include_pad']!r}")
    return {**_pool_check(a), "count_include_pad": a["count_include_pad"]}


def _geometry(a, nd):
    """(kernel, stride, padding, dilation), one int per spatial axis."""
    return tuple(per_axis(a.get(key, 1), nd, key) for key in ("kernel", "stride", "padding", "dilation"))


def _pool_type(types, a):
    x = types[0]
    require_float(x, "input")
    nd = spatial_rank(x)
    if None in x.shape[1:]:
        raise ShapeError("only the batch dim may be unknown")
    out = out_sizes(x.shape[2:], *_geometry(a, nd))
    if min(out) < 1:
        raise ShapeError(f"pool window {a['kernel']} does not fit input {fmt_shape(x.shape)}")
    return TensorType((x.shape[0], x.shape[1], *out), FLOAT)


_POOL_ATTRS = {"kernel": REQUIRED, "stride": None, "padding": 0}


@defop("max_pool2d", _pool_type, (1, 1), attrs={**_POOL_ATTRS, "dilation": 1}, check=_max_pool_check)
def max_pool2d(xp, args, a, ctx):
    k, s, p, d = _geometry(a, args[0].ndim - 2)
    out, index = max_pool_forward(xp, args[0], k, s, p, ctx.need_saved, d)
    return out, ((index, args[0].shape) if ctx.need_saved else None)


def _max_pool_x(xp, g, args, ans, saved, a, out):
    k, s, p, d = _geometry(a, g.ndim - 2)
    return max_pool_grad(xp, g, saved[0], saved[1], k, s, p, d)


defvjp("max_pool2d", _max_pool_x, needs_args=())


@defop("avg_pool2d", _pool_type, (1, 1), attrs={**_POOL_ATTRS, "count_include_pad": True}, check=_avg_pool_check)
def avg_pool2d(xp, args, a, ctx):
    k, s, p, _ = _geometry(a, args[0].ndim - 2)
    out = avg_pool_forward(xp, args[0], k, s, p, a["count_include_pad"])
    return out, (args[0].shape if ctx.need_saved else None)


def _avg_pool_x(xp, g, args, ans, shape, a, out):
    k, s, p, _ = _geometry(a, g.ndim - 2)
    return avg_pool_grad(xp, g, shape, k, s, p, a["count_include_pad"])


defvjp("avg_pool2d", _avg_pool_x, needs_args=())
