"""Convolution and pooling kernels on (B, C, H, W) arrays, written once against ``xp``.

Internally everything works batch-last, (C, H, W, B): a kernel offset shifts whole runs of
W*B contiguous numbers (B at a stride), so every pass below is a long, vectorised slice op
rather than one short row per image. The im2col columns are (C, kh*kw, Ho, Wo, B); conv2d is
one GEMM ``W(O, K) @ cols(K, Ho*Wo*B)`` whose (O, Ho*Wo*B) result *is* the output in that
layout, and outputs are handed on as (B, C, H, W) transposed views of it. Elementwise ops keep
the layout (NumPy and CuPy allocate results in the operands' memory order), the next conv or
pool reads it without a copy, and only a flatten (or an input that arrives batch-first, like
the data) pays one transposing copy.

Padding is never materialised: each kernel offset copies (im2col), accumulates (col2im) or
compares (pooling) only the part of the output whose input lies inside the image, and im2col
zeroes the rest of its rows. col2im is kh*kw strided adds; the offset that covers the whole
input (the centre of a "same" convolution) is written instead of added, so the gradient
buffer needs no zeroing. Max pooling keeps the first maximum's offset per window as int8 (as
PyTorch, the first maximum wins on ties).

Grouped convolution (``groups`` > 1, depthwise when it equals C) splits the same columns into
``groups`` row blocks and runs one batched GEMM over them; ``groups`` = 1 keeps the single GEMM.
Dilation only spreads the kernel offsets.
"""

from __future__ import annotations

import functools


def out_size(n: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _bl(x):
    """(B, C, H, W) -> (C, H, W, B): a view, no copy."""
    return x.transpose(1, 2, 3, 0)


def _bf(a):
    """(C, H, W, B) -> (B, C, H, W): a view, no copy."""
    return a.transpose(3, 0, 1, 2)


def batch_last(xp, x):
    """``x`` (B, C, H, W) as (C, H, W, B): a view when its batch is already the innermost axis
    (what this module produces), else one transposing copy (the data, a flatten's cotangent)."""
    if x.shape[0] == 1 or x.strides[0] == x.itemsize:
        return _bl(x)
    return xp.ascontiguousarray(_bl(x))


def _span(n_in, n_out, off, s):
    """Output positions [r0, r1) whose input position ``r * s + off`` lies in [0, n_in), and
    the input slice they read."""
    r0 = max(0, -(off // s))
    r1 = max(r0, min(n_out, (n_in - 1 - off) // s + 1))
    start = r0 * s + off
    return slice(r0, r1), slice(start, start + (r1 - r0 - 1) * s + 1, s), r1 > r0


def _windows(in_hw, out_hw, kernel, stride, padding, dilation=(1, 1)):
    """Per kernel offset n (row-major): (n, output rows, output cols, input rows, input cols,
    kind) where kind is None (no output reads the image), "all" (every output position reads
    the image) or "part". Cached: a step asks for the same few geometries every time."""
    return _windows_of(*map(int, (*in_hw, *out_hw, *kernel, *stride, *padding, *dilation)))


@functools.lru_cache(maxsize=256)
def _windows_of(h, w, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw):
    res = []
    for i in range(kh):
        orow, irow, rok = _span(h, ho, i * dh - ph, sh)
        for j in range(kw):
            ocol, icol, cok = _span(w, wo, j * dw - pw, sw)
            full = orow.stop - orow.start == ho and ocol.stop - ocol.start == wo
            kind = None if not (rok and cok) else ("all" if full else "part")
            res.append((i * kw + j, orow, ocol, irow, icol, kind))
    return tuple(res)


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
    for n, orow, ocol, irow, icol, kind in _windows((h, w), (ho, wo), kernel, stride, padding, dilation):
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
    wins = [t for t in _windows((h, w), (ho, wo), kernel, stride, padding, dilation) if t[5] is not None]
    first = next((t for t in wins if _covers_input((h, w), *t[1:5], stride)), None)
    if first is not None:  # written, not added: no zeroing pass
        gx = xp.empty((c, h, w, b), dtype=cols.dtype)
        gx[...] = c5[:, first[0], first[1], first[2]]
    else:
        gx = xp.zeros((c, h, w, b), dtype=cols.dtype)
    for n, orow, ocol, irow, icol, _ in wins:
        if first is None or n != first[0]:
            gx[:, irow, icol] += c5[:, n, orow, ocol]
    return _bf(gx)


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
    return _bf(y.reshape(o, ho, wo, x.shape[0])), cols


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
    wins = [t for t in _windows((h, wd), (ho, wo), kernel, stride, padding, dilation) if t[5] is not None]
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
    return _bf(gx)


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


def _pool_windows(x_shape, kernel, stride, padding, dilation=(1, 1)):
    h, w = x_shape[2], x_shape[3]
    ho, wo = out_size(h, kernel[0], stride[0], padding[0], dilation[0]), out_size(w, kernel[1], stride[1], padding[1], dilation[1])
    return (ho, wo), [t for t in _windows((h, w), (ho, wo), kernel, stride, padding, dilation) if t[5] is not None]


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
    return _bf(out), (None if index is None else _bf(index))


def max_pool_grad(xp, g, index, x_shape, kernel, stride, padding, dilation=(1, 1)):
    (ho, wo), wins = _pool_windows(x_shape, kernel, stride, padding, dilation)
    b, c, h, w = x_shape
    disjoint = stride[0] >= dilation[0] * (kernel[0] - 1) + 1 and stride[1] >= dilation[1] * (kernel[1] - 1) + 1
    gb, ib = batch_last(xp, g), _bl(index)
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
    return _bf(gx)


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
    return _bf(out)


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
    return _bf(gx)
