"""``conv2d``: im2col and GEMM kernels on the batch-last layout of ``windows``, the op and its
VJPs (conventions in ``hpc_rlx.graph.ops``).

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

from hpc_rlx.graph.ops.windows import batch_first_view, batch_last, kernel_windows, out_size
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import (
    FLOAT,
    ShapeError,
    TensorType,
    fmt_shape,
    pair,
    require_float,
    require_ndim,
)


def _covers_input(x_hw, orow, ocol, irow, icol, stride):
    """Whether one offset's output positions read every input position exactly once."""
    h, w = x_hw
    return (stride == (1, 1) and irow.start == 0 and icol.start == 0
            and orow.stop - orow.start == h and ocol.stop - ocol.start == w)


def im2col(xp, x, kernel, stride, padding, dilation=(1, 1), extra_rows=0):
    """Columns (C*kh*kw, Ho*Wo*B) of ``x`` (B, C, H, W); returns (cols, ho, wo). With
    ``extra_rows``, cols has that many more rows at the end, left for the caller to fill."""
    b, c, h, w = x.shape
    ho, wo = out_size(h, kernel[0], stride[0], padding[0], dilation[0]), out_size(w, kernel[1], stride[1], padding[1], dilation[1])
    xb = batch_last(xp, x)
    k = c * kernel[0] * kernel[1]
    flat = xp.empty((k + extra_rows, ho * wo * b), dtype=x.dtype)
    cols = flat[:k].reshape(c, kernel[0] * kernel[1], ho, wo, b)
    for n, orow, ocol, irow, icol, kind in kernel_windows((h, w), (ho, wo), kernel, stride, padding, dilation):
        dst = cols[:, n]
        if kind is None:
            dst[...] = 0
            continue
        dst[:, orow, ocol] = xb[:, irow, icol]
        if kind == "part":  # the rest reads the zero padding
            dst[:, : orow.start] = 0
            dst[:, orow.stop :] = 0
            dst[:, orow, : ocol.start] = 0
            dst[:, orow, ocol.stop :] = 0
    return flat, ho, wo


def col2im(xp, cols, x_shape, kernel, stride, padding, dilation=(1, 1)):
    """Adjoint of ``im2col``: add the columns back onto a (B, C, H, W) array (batch-last view)."""
    b, c, h, w = x_shape
    ho, wo = out_size(h, kernel[0], stride[0], padding[0], dilation[0]), out_size(w, kernel[1], stride[1], padding[1], dilation[1])
    c5 = cols.reshape(c, kernel[0] * kernel[1], ho, wo, b)
    wins = [t for t in kernel_windows((h, w), (ho, wo), kernel, stride, padding, dilation) if t[5] is not None]
    first = next((t for t in wins if _covers_input((h, w), *t[1:5], stride)), None)
    if first is not None:  # written, not added: no zeroing pass
        gx = xp.empty((c, h, w, b), dtype=cols.dtype)
        gx[...] = c5[:, first[0], first[1], first[2]]
    else:
        gx = xp.zeros((c, h, w, b), dtype=cols.dtype)
    for n, orow, ocol, irow, icol, _ in wins:
        if first is None or n != first[0]:
            gx[:, irow, icol] += c5[:, n, orow, ocol]
    return batch_first_view(gx)


def conv2d_forward(xp, x, w, b, stride, padding, dilation=(1, 1), groups=1):
    """Returns (out (B, O, Ho, Wo), cols) for x (B, C, H, W) and w (O, C / groups, kh, kw)."""
    o, k = w.shape[0], w[0].size * groups
    fused = b is not None and groups == 1
    cols, ho, wo = im2col(xp, x, w.shape[2:], stride, padding, dilation, extra_rows=int(fused))
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
    return batch_first_view(y.reshape(o, ho, wo, x.shape[0])), cols


def _g_matrix(xp, g):
    """(B, O, Ho, Wo) cotangent as the (O, Ho*Wo*B) matrix the GEMMs need (a view when ``g``
    is batch-last, as it is when it comes straight from elementwise VJPs)."""
    return batch_last(xp, g).reshape(g.shape[1], -1)


def conv2d_grad_x(xp, g, w, x_shape, stride, padding, dilation=(1, 1), groups=1):
    """Input cotangent. With one group, one GEMM per kernel offset, each (C, Ho*Wo*B) block
    added into the gradient while it is still in cache (the offset that covers the whole
    input *is* the gradient buffer); with groups, one batched GEMM and ``col2im``."""
    o = w.shape[0]
    gm = _g_matrix(xp, g)
    if groups != 1:
        wg = w.reshape(groups, o // groups, -1)
        gcols = xp.matmul(wg.transpose(0, 2, 1), gm.reshape(groups, o // groups, -1))
        return col2im(xp, gcols.reshape(-1, gcols.shape[2]), x_shape, w.shape[2:], stride, padding, dilation)
    b, c, h, wd = x_shape
    kernel = w.shape[2:]
    ho, wo = out_size(h, kernel[0], stride[0], padding[0], dilation[0]), out_size(wd, kernel[1], stride[1], padding[1], dilation[1])
    wt = xp.ascontiguousarray(w.reshape(o, c, kernel[0] * kernel[1]).transpose(2, 1, 0))  # (kh*kw, C, O)
    wins = [t for t in kernel_windows((h, wd), (ho, wo), kernel, stride, padding, dilation) if t[5] is not None]
    first = next((t for t in wins if _covers_input((h, wd), *t[1:5], stride)), None)
    if first is not None and (ho, wo) == (h, wd):
        gx = xp.matmul(wt[first[0]], gm).reshape(c, h, wd, b)
    elif first is not None:  # padding wider than the kernel needs: the covering block is a crop
        gx = xp.empty((c, h, wd, b), dtype=g.dtype)
        gx[...] = xp.matmul(wt[first[0]], gm).reshape(c, ho, wo, b)[:, first[1], first[2]]
    else:
        gx = xp.zeros((c, h, wd, b), dtype=g.dtype)
    for n, orow, ocol, irow, icol, _ in wins:
        if first is None or n != first[0]:
            gx[:, irow, icol] += xp.matmul(wt[n], gm).reshape(c, ho, wo, b)[:, orow, ocol]
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


def _conv_check(a):
    s, p = pair(a["stride"], "stride"), pair(a["padding"], "padding")
    d, groups = pair(a["dilation"], "dilation"), a["groups"]
    if min(s) < 1 or min(p) < 0 or min(d) < 1:
        raise ShapeError(f"stride and dilation must be >= 1 and padding >= 0, got stride={a['stride']} "
                         f"padding={a['padding']} dilation={a['dilation']}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ShapeError(f"attribute 'groups' must be a positive int, got {groups!r}")
    return {"stride": s, "padding": p, "dilation": d, "groups": groups}


def _conv_type(types, a):
    x, w = types[0], types[1]
    require_float(x, "input")
    require_float(w, "weight")
    require_ndim(x, 4, "input (B, C, H, W)")
    require_ndim(w, 4, "weight (O, C, kh, kw)")
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
    ho = out_size(x.shape[2], w.shape[2], a["stride"][0], a["padding"][0], a["dilation"][0])
    wo = out_size(x.shape[3], w.shape[3], a["stride"][1], a["padding"][1], a["dilation"][1])
    if ho < 1 or wo < 1:
        raise ShapeError(f"kernel {w.shape[2:]} does not fit input {fmt_shape(x.shape)} with the given padding")
    return TensorType((x.shape[0], w.shape[0], ho, wo), FLOAT)


@defop("conv2d", _conv_type, (2, 3), attrs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1},
       check=_conv_check, arg_names=("x", "weight", "bias"))
def conv2d(xp, args, a, ctx):
    b = args[2] if len(args) == 3 else None
    out, cols = conv2d_forward(xp, args[0], args[1], b, a["stride"], a["padding"], a["dilation"], a["groups"])
    return out, ((cols, args[0].shape) if ctx.need_saved else None)


def _conv_x(xp, g, args, ans, saved, a, out):
    return conv2d_grad_x(xp, g, args[1], saved[1], a["stride"], a["padding"], a["dilation"], a["groups"])


def _conv_w(xp, g, args, ans, saved, a, out):
    return conv2d_grad_w(xp, g, saved[0], args[1].shape, out, a["groups"])


def _conv_b(xp, g, args, ans, saved, a, out):
    return conv2d_grad_b(xp, g, out)


defvjp("conv2d", _conv_x, _conv_w, _conv_b, needs_args=(1,))
