"""``max_pool2d`` and ``avg_pool2d``: window kernels on the batch-last layout of ``windows``,
the ops and their VJPs (conventions in ``hpc_rlx.graph.ops``).

Pooling compares or adds only the part of each window that lies inside the image. Max pooling
keeps the first maximum's offset per window as int8 (as PyTorch, the first maximum wins on
ties).
"""

from __future__ import annotations

from hpc_rlx.graph.ops.windows import batch_first_view, batch_last, batch_last_view, kernel_windows, out_size
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType, fmt_shape, pair, require_float, require_ndim


def _pool_windows(x_shape, kernel, stride, padding, dilation=(1, 1)):
    h, w = x_shape[2], x_shape[3]
    ho, wo = out_size(h, kernel[0], stride[0], padding[0], dilation[0]), out_size(w, kernel[1], stride[1], padding[1], dilation[1])
    wins = kernel_windows((h, w), (ho, wo), kernel, stride, padding, dilation)
    return (ho, wo), [t for t in wins if t[5] is not None]


def _tiles_input(x_shape, out_hw, kernel, stride, padding, dilation=(1, 1)):
    """Whether the windows cover every input position exactly once (a 2x2/2 pool on even sizes)."""
    return (tuple(padding) == (0, 0) and tuple(dilation) == (1, 1) and tuple(stride) == tuple(kernel)
            and out_hw[0] * kernel[0] == x_shape[2] and out_hw[1] * kernel[1] == x_shape[3])


def max_pool_forward(xp, x, kernel, stride, padding, keep_index, dilation=(1, 1)):
    """Max over each window; with ``keep_index`` also the winning offset (the first max wins,
    as in PyTorch). Offsets only grow, so the last strict improvement is a running maximum of
    ``offset * improved``: cheap int8 passes instead of masked assignment. Returns the output
    and the index as (B, C, Ho, Wo) views of batch-last arrays."""
    (ho, wo), wins = _pool_windows(x.shape, kernel, stride, padding, dilation)
    xb = batch_last(xp, x)
    shape = (x.shape[1], ho, wo, x.shape[0])
    out = xp.empty(shape, dtype=x.dtype)
    index = scratch = None
    if keep_index:
        itype = xp.int8 if kernel[0] * kernel[1] <= 127 else xp.int32
        index = xp.zeros(shape, dtype=itype)
    if wins[0][5] != "all":
        out.fill(-float("inf"))
    for k, (n, orow, ocol, irow, icol, kind) in enumerate(wins):
        win, dst = xb[:, irow, icol], out[:, orow, ocol]
        if k == 0 and kind == "all":
            dst[...] = win
            continue
        if keep_index:
            better = xp.greater(win, dst)
            if itype == xp.int8:
                better = better.view(xp.int8)  # same bytes: no cast pass
            if scratch is None:
                scratch = xp.empty(shape, dtype=itype)
            sc = scratch[:, orow, ocol]
            xp.multiply(better, n, out=sc)
            idx = index[:, orow, ocol]
            xp.maximum(idx, sc, out=idx)
        xp.maximum(dst, win, out=dst)
    return batch_first_view(out), (None if index is None else batch_first_view(index))


def max_pool_grad(xp, g, index, x_shape, kernel, stride, padding, dilation=(1, 1)):
    (ho, wo), wins = _pool_windows(x_shape, kernel, stride, padding, dilation)
    b, c, h, w = x_shape
    disjoint = stride[0] >= dilation[0] * (kernel[0] - 1) + 1 and stride[1] >= dilation[1] * (kernel[1] - 1) + 1
    gb, ib = batch_last(xp, g), batch_last_view(index)
    if disjoint and _tiles_input(x_shape, (ho, wo), kernel, stride, padding, dilation):
        gx = xp.empty((c, h, w, b), dtype=g.dtype)  # every cell gets written once
    else:
        gx = xp.zeros((c, h, w, b), dtype=g.dtype)
    for n, orow, ocol, irow, icol, _ in wins:
        hit = ib[:, orow, ocol] == n
        if disjoint:  # each input cell is in one window at most: write, don't accumulate
            xp.multiply(gb[:, orow, ocol], hit, out=gx[:, irow, icol])
        else:
            gx[:, irow, icol] += gb[:, orow, ocol] * hit
    return batch_first_view(gx)


def _window_counts(xp, h, w, ho, wo, kernel, stride, padding, dtype):
    """(Ho, Wo, 1): how many input cells (padding not counted) each pooling window covers."""
    def along(n, no, k, s, p):
        start = xp.arange(no) * s - p
        return xp.clip(start + k, 0, n) - xp.clip(start, 0, n)

    rows = along(h, ho, kernel[0], stride[0], padding[0])
    cols = along(w, wo, kernel[1], stride[1], padding[1])
    return (rows[:, None] * cols[None, :]).astype(dtype)[:, :, None]


def avg_pool_forward(xp, x, kernel, stride, padding, count_include_pad=True):
    """Mean over each window; zero padding counted unless ``count_include_pad`` is false."""
    (ho, wo), wins = _pool_windows(x.shape, kernel, stride, padding)
    xb = batch_last(xp, x)
    shape = (x.shape[1], ho, wo, x.shape[0])
    if wins[0][5] == "all":
        out = xp.empty(shape, dtype=x.dtype)
    else:
        out = xp.zeros(shape, dtype=x.dtype)
    for k, (n, orow, ocol, irow, icol, kind) in enumerate(wins):
        if k == 0 and kind == "all":
            out[...] = xb[:, irow, icol]
        else:
            out[:, orow, ocol] += xb[:, irow, icol]
    if count_include_pad or tuple(padding) == (0, 0):
        out *= 1.0 / (kernel[0] * kernel[1])
    else:
        out /= _window_counts(xp, x.shape[2], x.shape[3], ho, wo, kernel, stride, padding, x.dtype)
    return batch_first_view(out)


def avg_pool_grad(xp, g, x_shape, kernel, stride, padding, count_include_pad=True):
    (ho, wo), wins = _pool_windows(x_shape, kernel, stride, padding)
    b, c, h, w = x_shape
    if count_include_pad or tuple(padding) == (0, 0):
        gs = batch_last(xp, g) * (1.0 / (kernel[0] * kernel[1]))
    else:
        gs = batch_last(xp, g) / _window_counts(xp, h, w, ho, wo, kernel, stride, padding, g.dtype)
    disjoint = stride[0] >= kernel[0] and stride[1] >= kernel[1]
    if disjoint and _tiles_input(x_shape, (ho, wo), kernel, stride, padding):
        gx = xp.empty((c, h, w, b), dtype=g.dtype)
    else:
        gx = xp.zeros((c, h, w, b), dtype=g.dtype)
    for n, orow, ocol, irow, icol, _ in wins:
        if disjoint:
            gx[:, irow, icol] = gs[:, orow, ocol]
        else:
            gx[:, irow, icol] += gs[:, orow, ocol]
    return batch_first_view(gx)


# ---------------------------------------------------------------- the ops


def _pool_check(a):
    k = pair(a["kernel"], "kernel")
    s = k if a["stride"] is None else pair(a["stride"], "stride")
    p = pair(a["padding"], "padding")
    if min(k) < 1 or min(s) < 1 or min(p) < 0 or p[0] * 2 > k[0] or p[1] * 2 > k[1]:
        raise ShapeError(f"need kernel >= 1, stride >= 1, 0 <= padding <= kernel/2; got kernel={k} stride={s} padding={p}")
    return {"kernel": k, "stride": s, "padding": p}


def _max_pool_check(a):
    d = pair(a["dilation"], "dilation")
    if min(d) < 1:
        raise ShapeError(f"attribute 'dilation' must be >= 1, got {a['dilation']!r}")
    return {**_pool_check(a), "dilation": d}


def _avg_pool_check(a):
    if not isinstance(a["count_include_pad"], bool):
        raise ShapeError(f"attribute 'count_include_pad' must be true or false, got {a['count_include_pad']!r}")
    return {**_pool_check(a), "count_include_pad": a["count_include_pad"]}


def _pool_type(types, a):
    x = types[0]
    require_float(x, "input")
    require_ndim(x, 4, "input (B, C, H, W)")
    if None in x.shape[1:]:
        raise ShapeError("only the batch dim may be unknown")
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    dh, dw = a.get("dilation", (1, 1))
    ho, wo = out_size(x.shape[2], kh, sh, ph, dh), out_size(x.shape[3], kw, sw, pw, dw)
    if ho < 1 or wo < 1:
        raise ShapeError(f"pool window {a['kernel']} does not fit input {fmt_shape(x.shape)}")
    return TensorType((x.shape[0], x.shape[1], ho, wo), FLOAT)


_POOL_ATTRS = {"kernel": REQUIRED, "stride": None, "padding": 0}


@defop("max_pool2d", _pool_type, (1, 1), attrs={**_POOL_ATTRS, "dilation": 1}, check=_max_pool_check)
def max_pool2d(xp, args, a, ctx):
    out, index = max_pool_forward(xp, args[0], a["kernel"], a["stride"], a["padding"], ctx.need_saved,
                                  a["dilation"])
    return out, ((index, args[0].shape) if ctx.need_saved else None)


defvjp(
    "max_pool2d",
    lambda xp, g, args, ans, saved, a, out: max_pool_grad(
        xp, g, saved[0], saved[1], a["kernel"], a["stride"], a["padding"], a["dilation"]
    ),
    needs_args=(),
)


@defop("avg_pool2d", _pool_type, (1, 1), attrs={**_POOL_ATTRS, "count_include_pad": True}, check=_avg_pool_check)
def avg_pool2d(xp, args, a, ctx):
    out = avg_pool_forward(xp, args[0], a["kernel"], a["stride"], a["padding"], a["count_include_pad"])
    return out, (args[0].shape if ctx.need_saved else None)


defvjp(
    "avg_pool2d",
    lambda xp, g, args, ans, shape, a, out: avg_pool_grad(xp, g, shape, a["kernel"], a["stride"], a["padding"],
                                                          a["count_include_pad"]),
    needs_args=(),
)
