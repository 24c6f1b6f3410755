"""``conv2d``: im2col and GEMM kernels on the batch-last layout of ``windows``, the op and its
VJPs (conventions in ``hpc_rlx.graph.ops``). The op takes images (B, C, H, W) with (O, C /
groups, kh, kw) kernels and, with the same code, volumes (B, C, D, H, W) with (O, C / groups,
kd, kh, kw) kernels (the 3-D convolution); below, (H, W) stands for the spatial axes.

The im2col columns are (C, kh*kw, Ho, Wo, B); conv2d is one GEMM ``W(O, K) @ cols(K,
Ho*Wo*B)`` whose (O, Ho*Wo*B) result *is* the output in the batch-last layout. im2col copies
only the part of each kernel offset's rows whose input lies inside the image and zeroes the
rest; col2im is kh*kw strided adds, and the offset that covers the whole input (the centre of
a "same" convolution) is written instead of added, so the gradient buffer needs no zeroing.

Grouped convolution (``groups`` > 1, depthwise when it equals C) splits the same columns into
``groups`` row blocks and runs one batched GEMM over them; ``groups`` = 1 keeps the single GEMM.
Dilation only spreads the kernel offsets.
"""

from __future__ import annotations

from math import prod

from hpc_rlx.graph.ops import conv_dense, conv_winograd
from hpc_rlx.graph.ops.windows import batch_first_view, batch_last, out_sizes, plan
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import (
    FLOAT,
    ShapeError,
    TensorType,
    fmt_shape,
    geometry,
    per_axis,
    require_float,
)

def im2col(xp, x, kernel, stride, padding, dilation=None, extra_rows=0):
    """Columns (C*kh*kw, Ho*Wo*B) of ``x`` (B, C, H, W); returns (cols, (Ho, Wo)). With
    ``extra_rows``, cols has that many more rows at the end, left for the caller to fill."""
    b, c = x.shape[:2]
    p = plan(x.shape[2:], kernel, stride, padding, dilation)
    xb = batch_last(xp, x)
    kk = len(p.windows)
    k = c * kk
    flat = xp.empty((k + extra_rows, prod(p.out) * b), dtype=x.dtype)
    cols = flat[:k].reshape(c, kk, *p.out, b)
    for n, oidx, iidx, kind, rim in p.windows:
        dst = cols[:, n]
        if kind is None:
            dst[...] = 0
            continue
        dst[oidx] = xb[iidx]
        for r in rim:  # the rest reads the zero padding
            dst[r] = 0
    return flat, p.out


def col2im(xp, cols, x_shape, kernel, stride, padding, dilation=None):
    """Adjoint of ``im2col``: add the columns back onto a (B, C, H, W) array (batch-last view)."""
    b, c, *size = x_shape
    p = plan(size, kernel, stride, padding, dilation)
    c5 = cols.reshape(c, len(p.windows), *p.out, b)
    first = p.covering
    if first is not None:  # written, not added: no zeroing pass
        gx = xp.empty((c, *size, b), dtype=cols.dtype)
        gx[...] = c5[:, first[0]][first[1]]
    else:
        gx = xp.zeros((c, *size, b), dtype=cols.dtype)
    for n, oidx, iidx, _, _ in p.live:
        if first is None or n != first[0]:
            gx[iidx] += c5[:, n][oidx]
    return batch_first_view(gx)


def conv2d_forward(xp, x, w, b, stride, padding, dilation=None, groups=1):
    """Returns (out (B, O, Ho, Wo), cols) for x (B, C, H, W) and w (O, C / groups, kh, kw)."""
    o, k = w.shape[0], w[0].size * groups
    fused = b is not None and groups == 1
    cols, out = im2col(xp, x, w.shape[2:], stride, padding, dilation, extra_rows=int(fused))
    if fused:  # the bias rides in the GEMM: a row of ones under the columns, b beside W
        cols[k] = 1
        wb = xp.empty((o, k + 1), dtype=w.dtype)
        wb[:, :k] = w.reshape(o, k)
        wb[:, k] = b
        y = xp.matmul(wb, cols)  # (O, Ho*Wo*B): the output, batch-last
        cols = cols[:k]
    elif groups == 1:
        y = xp.matmul(w.reshape(o, k), cols)
    else:  # group k's output channels read group k's block of column rows
        y = xp.matmul(w.reshape(groups, o // groups, -1), cols.reshape(groups, -1, cols.shape[1]))
        y = y.reshape(o, -1)
    if b is not None and not fused:
        y += b.reshape(o, 1)
    return batch_first_view(y.reshape(o, *out, x.shape[0])), cols


def _g_matrix(xp, g):
    """(B, O, Ho, Wo) cotangent as the (O, Ho*Wo*B) matrix the GEMMs need (a view when ``g``
    is batch-last, as it is when it comes straight from elementwise VJPs)."""
    return batch_last(xp, g).reshape(g.shape[1], -1)


def conv2d_grad_x(xp, g, w, x_shape, stride, padding, dilation=None, groups=1):
    """Input cotangent. With one group, one GEMM per kernel offset, each (C, Ho*Wo*B) block
    added into the gradient while it is still in cache (the offset that covers the whole
    input *is* the gradient buffer); with groups, one batched GEMM and ``col2im``."""
    o = w.shape[0]
    gm = _g_matrix(xp, g)
    if groups != 1:
        wg = w.reshape(groups, o // groups, -1)
        gcols = xp.matmul(wg.transpose(0, 2, 1), gm.reshape(groups, o // groups, -1))
        return col2im(xp, gcols.reshape(-1, gcols.shape[2]), x_shape, w.shape[2:], stride, padding, dilation)
    b, c, *size = x_shape
    kernel = w.shape[2:]
    p = plan(size, kernel, stride, padding, dilation)
    out = p.out
    wt = xp.ascontiguousarray(w.reshape(o, c, len(p.windows)).transpose(2, 1, 0))  # (kh*kw, C, O)
    first = p.covering
    if first is not None and out == tuple(size):
        gx = xp.matmul(wt[first[0]], gm).reshape(c, *size, b)
    elif first is not None:  # padding wider than the kernel needs: the covering block is a crop
        gx = xp.empty((c, *size, b), dtype=g.dtype)
        gx[...] = xp.matmul(wt[first[0]], gm).reshape(c, *out, b)[first[1]]
    else:
        gx = xp.zeros((c, *size, b), dtype=g.dtype)
    for n, oidx, iidx, _, _ in p.live:
        if first is None or n != first[0]:
            gx[iidx] += xp.matmul(wt[n], gm).reshape(c, *out, b)[oidx]
    return batch_first_view(gx)


def conv2d_grad_w(xp, g, cols, w_shape, out=None, groups=1):
    o = w_shape[0]
    if groups != 1:
        gm = _g_matrix(xp, g).reshape(groups, o // groups, -1)
        cg = cols.reshape(groups, -1, cols.shape[1]).transpose(0, 2, 1)
        if out is not None:
            xp.matmul(gm, cg, out=out.reshape(groups, o // groups, -1))
            return out
        return xp.matmul(gm, cg).reshape(w_shape)
    if out is not None:
        xp.matmul(_g_matrix(xp, g), cols.T, out=out.reshape(o, -1))
        return out
    return xp.matmul(_g_matrix(xp, g), cols.T).reshape(w_shape)


def conv2d_grad_b(xp, g, out=None):
    """Sum of the cotangent over batch and space, per output channel: a GEMV against ones,
    which streams the rows at memory speed (a row-wise ``sum`` runs at a third of it)."""
    gm = _g_matrix(xp, g)
    ones = xp.ones(gm.shape[1], dtype=gm.dtype)
    if out is not None:
        xp.matmul(gm, ones, out=out)
        return out
    return xp.matmul(gm, ones)


# ---------------------------------------------------------------- the op


def smallest(value) -> int:
    """The smallest entry of a ``geometry`` attribute."""
    return value if isinstance(value, int) else min(value)


def _conv_check(a):
    s, p = geometry(a["stride"], "stride"), geometry(a["padding"], "padding")
    d, groups = geometry(a["dilation"], "dilation"), a["groups"]
    if smallest(s) < 1 or smallest(p) < 0 or smallest(d) < 1:
        raise ShapeError(f"stride and dilation must be >= 1 and padding >= 0, got stride={a['stride']} "
                         f"padding={a['padding']} dilation={a['dilation']}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ShapeError(f"attribute 'groups' must be a positive int, got {groups!r}")
    return {"stride": s, "padding": p, "dilation": d, "groups": groups}


def spatial_rank(x, what="input (B, C, H, W) or (B, C, D, H, W)") -> int:
    """2 for an image, 3 for a volume."""
    if x.ndim not in (4, 5):
        raise ShapeError(f"{what} must have 4 or 5 dims, got shape {fmt_shape(x.shape)}")
    return x.ndim - 2


def _conv_type(types, a):
    x, w = types[0], types[1]
    require_float(x, "input")
    require_float(w, "weight")
    nd = spatial_rank(x)
    if w.ndim != x.ndim:
        raise ShapeError(f"weight {fmt_shape(w.shape)} must have {x.ndim} dims (O, C, {'kd, ' * (nd == 3)}kh, kw) "
                         f"for input {fmt_shape(x.shape)}")
    if None in x.shape[1:] or None in w.shape:
        raise ShapeError("only the batch dim may be unknown")
    groups = a["groups"]
    if x.shape[1] != w.shape[1] * groups:
        raise ShapeError(f"input has {x.shape[1]} channels but weight {fmt_shape(w.shape)} expects "
                         f"{w.shape[1] * groups} ({groups} group(s) of {w.shape[1]})")
    if w.shape[0] % groups:
        raise ShapeError(f"{w.shape[0]} output channels do not split into {groups} groups")
    if len(types) == 3:
        require_float(types[2], "bias")
        if types[2].shape != (w.shape[0],):
            raise ShapeError(f"bias shape {fmt_shape(types[2].shape)} must be ({w.shape[0]},)")
    s, p, d = (per_axis(a[k], nd, k) for k in ("stride", "padding", "dilation"))
    out = out_sizes(x.shape[2:], w.shape[2:], s, p, d)
    if min(out) < 1:
        raise ShapeError(f"kernel {w.shape[2:]} does not fit input {fmt_shape(x.shape)} with the given padding")
    return TensorType((x.shape[0], w.shape[0], *out), FLOAT)


def _geometry(a, nd):
    return tuple(per_axis(a[k], nd, k) for k in ("stride", "padding", "dilation"))


@defop("conv2d", _conv_type, (2, 3), attrs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1},
       check=_conv_check, arg_names=("x", "weight", "bias"))
def conv2d(xp, args, a, ctx):
    # saved: ("im2col", columns, input shape), ("dense", its saved) or ("winograd", its saved);
    # the kernels are chosen by shape, in this order (conv_dense.py, conv_winograd.py)
    x, w = args[0], args[1]
    b = args[2] if len(args) == 3 else None
    stride, padding, dilation = _geometry(a, x.ndim - 2)
    if conv_dense.worth_it(x.shape[2:], w.shape[2:], w.shape[1], w.shape[0]):
        out, dense = conv_dense.forward(xp, x, w, b, stride, padding, dilation, a["groups"])
        return out, (("dense", dense) if ctx.need_saved else None)
    if conv_winograd.applies(x.shape[2:], w.shape[2:], stride, padding, dilation, a["groups"], x.shape[1], w.shape[0]):
        out, tiles = conv_winograd.forward(xp, x, w, b)
        return out, (("winograd", tiles) if ctx.need_saved else None)
    out, cols = conv2d_forward(xp, x, w, b, stride, padding, dilation, a["groups"])
    return out, (("im2col", cols, x.shape) if ctx.need_saved else None)


def _conv_x(xp, g, args, ans, saved, a, out):
    if saved[0] == "dense":
        return conv_dense.grad_x(xp, g, saved[1], a["groups"])
    if saved[0] == "winograd":
        return conv_winograd.grad_x(xp, g, saved[1])
    return conv2d_grad_x(xp, g, args[1], saved[2], *_geometry(a, g.ndim - 2), a["groups"])


def _conv_w(xp, g, args, ans, saved, a, out):
    if saved[0] == "dense":
        return conv_dense.grad_w(xp, g, saved[1], args[1].shape, *_geometry(a, g.ndim - 2), a["groups"], out)
    if saved[0] == "winograd":
        return conv_winograd.grad_w(xp, g, saved[1], out)
    return conv2d_grad_w(xp, g, saved[1], args[1].shape, out, a["groups"])


def _conv_b(xp, g, args, ans, saved, a, out):
    return conv2d_grad_b(xp, g, out)


defvjp("conv2d", _conv_x, _conv_w, _conv_b, needs_args=(1,))
