"""Convolution and pooling kernels on (B, C, H, W) arrays, written once against ``xp``.

Internally everything works channel-major, (C, B, H, W): the im2col columns are
(C, kh, kw, B, Ho, Wo), so filling them is kh*kw contiguous-ish slice copies, conv2d is one
GEMM ``W(O, K) @ cols(K, B*Ho*Wo)`` whose (O, B*Ho*Wo) result *is* the output in that layout,
and the outputs are handed on as (B, C, H, W) transposed views of it. Elementwise ops keep the
layout, the next conv or pool reads it without a transpose copy, and only a flatten copies
once. Pooling loops over the window offsets; each pass is one vectorised slice op.

Grouped convolution (``groups`` > 1, depthwise when it equals C) splits the same columns into
``groups`` row blocks and runs one batched GEMM over them; ``groups`` = 1 keeps the single GEMM.
Dilation only spreads the kernel offsets.
"""

from __future__ import annotations


def out_size(n: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _offsets(kh, kw, sh, sw, ho, wo, dilation=(1, 1)):
    """(index, row slice, col slice) of every kernel offset over the padded input; the
    offset's kernel position is ``divmod(index, kw)``."""
    dh, dw = dilation
    n = 0
    for i in range(kh):
        for j in range(kw):
            yield n, slice(i * dh, i * dh + sh * (ho - 1) + 1, sh), slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            n += 1


def _cm(x):
    """(B, C, H, W) <-> (C, B, H, W): a view, no copy."""
    return x.transpose(1, 0, 2, 3)


def _pad_cm(xp, xc, ph: int, pw: int, value: float = 0.0):
    """Pad a channel-major array's spatial dims (no copy when there is no padding)."""
    if ph == 0 and pw == 0:
        return xc
    c, b, h, w = xc.shape
    out = xp.full((c, b, h + 2 * ph, w + 2 * pw), value, dtype=xc.dtype)
    out[:, :, ph : ph + h, pw : pw + w] = xc
    return out


def _crop_cm(xc, ph, pw):
    if ph == 0 and pw == 0:
        return xc
    return xc[:, :, ph : xc.shape[2] - ph, pw : xc.shape[3] - pw]


def im2col(xp, x, kernel, stride, padding, dilation=(1, 1)):
    """Columns (C*kh*kw, B*Ho*Wo) of ``x`` (B, C, H, W); returns (cols, ho, wo)."""
    b, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = out_size(h, kh, sh, ph, dilation[0]), out_size(w, kw, sw, pw, dilation[1])
    xc = _pad_cm(xp, _cm(x), ph, pw)
    cols = xp.empty((c, kh, kw, b, ho, wo), dtype=x.dtype)
    for n, rs, cs in _offsets(kh, kw, sh, sw, ho, wo, dilation):
        i, j = divmod(n, kw)
        cols[:, i, j] = xc[:, :, rs, cs]
    return cols.reshape(c * kh * kw, b * ho * wo), ho, wo


def col2im(xp, cols, x_shape, kernel, stride, padding, dilation=(1, 1)):
    """Adjoint of ``im2col``: scatter-add the columns back onto a (B, C, H, W) array."""
    b, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = out_size(h, kh, sh, ph, dilation[0]), out_size(w, kw, sw, pw, dilation[1])
    c6 = cols.reshape(c, kh, kw, b, ho, wo)
    gxc = xp.zeros((c, b, h + 2 * ph, w + 2 * pw), dtype=cols.dtype)
    for n, rs, cs in _offsets(kh, kw, sh, sw, ho, wo, dilation):
        i, j = divmod(n, kw)
        gxc[:, :, rs, cs] += c6[:, i, j]
    return _cm(_crop_cm(gxc, ph, pw))


def conv2d_forward(xp, x, w, b, stride, padding, dilation=(1, 1), groups=1):
    """Returns (out (B, O, Ho, Wo), cols) for x (B, C, H, W) and w (O, C / groups, kh, kw)."""
    o = w.shape[0]
    cols, ho, wo = im2col(xp, x, w.shape[2:], stride, padding, dilation)
    if groups == 1:
        y = xp.matmul(w.reshape(o, -1), cols)  # (O, B*Ho*Wo): the output, channel-major
    else:  # group k's output channels read group k's block of column rows
        y = xp.matmul(w.reshape(groups, o // groups, -1), cols.reshape(groups, -1, cols.shape[1]))
        y = y.reshape(o, -1)
    if b is not None:
        y += b.reshape(o, 1)
    return _cm(y.reshape(o, x.shape[0], ho, wo)), cols


def _g_matrix(g):
    """(B, O, Ho, Wo) cotangent as the (O, B*Ho*Wo) matrix the GEMMs need (a view when
    ``g`` is channel-major, as it is when it comes straight from elementwise VJPs)."""
    return _cm(g).reshape(g.shape[1], -1)


def conv2d_grad_x(xp, g, w, x_shape, stride, padding, dilation=(1, 1), groups=1):
    o = w.shape[0]
    if groups == 1:
        gcols = xp.matmul(w.reshape(o, -1).T, _g_matrix(g))
    else:
        wg = w.reshape(groups, o // groups, -1)
        gcols = xp.matmul(wg.transpose(0, 2, 1), _g_matrix(g).reshape(groups, o // groups, -1))
        gcols = gcols.reshape(-1, gcols.shape[2])
    return col2im(xp, gcols, x_shape, w.shape[2:], stride, padding, dilation)


def conv2d_grad_w(xp, g, cols, w_shape, out=None, groups=1):
    o = w_shape[0]
    if groups != 1:
        gm = _g_matrix(g).reshape(groups, o // groups, -1)
        cg = cols.reshape(groups, -1, cols.shape[1]).transpose(0, 2, 1)
        if out is not None:
            xp.matmul(gm, cg, out=out.reshape(groups, o // groups, -1))
            return out
        return xp.matmul(gm, cg).reshape(w_shape)
    if out is not None:
        xp.matmul(_g_matrix(g), cols.T, out=out.reshape(o, -1))
        return out
    return xp.matmul(_g_matrix(g), cols.T).reshape(w_shape)


def max_pool_forward(xp, x, kernel, stride, padding, keep_index, dilation=(1, 1)):
    """Max over each window; with ``keep_index`` also the winning offset (the first max wins,
    as in PyTorch). Offsets only grow, so the last strict improvement is a running maximum of
    ``offset * improved``: cheap elementwise passes instead of masked assignment."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = out_size(x.shape[2], kh, sh, ph, dilation[0]), out_size(x.shape[3], kw, sw, pw, dilation[1])
    xc = _pad_cm(xp, _cm(x), ph, pw, value=-float("inf"))
    out = index = scratch = None
    for n, rs, cs in _offsets(kh, kw, sh, sw, ho, wo, dilation):
        win = xc[:, :, rs, cs]
        if out is None:
            out = xp.empty(win.shape, dtype=x.dtype)
            out[...] = win
            if keep_index:
                itype = xp.int8 if kh * kw <= 127 else xp.int32
                index = xp.zeros(out.shape, dtype=itype)
                scratch = xp.empty(out.shape, dtype=itype)
            continue
        if keep_index:
            xp.multiply(win > out, n, out=scratch)
            xp.maximum(index, scratch, out=index)
        xp.maximum(out, win, out=out)
    return _cm(out), (None if index is None else _cm(index))


def max_pool_grad(xp, g, index, x_shape, kernel, stride, padding, dilation=(1, 1)):
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    b, c, h, w = x_shape
    disjoint = sh >= dilation[0] * (kh - 1) + 1 and sw >= dilation[1] * (kw - 1) + 1
    gc, ic = _cm(g), _cm(index)
    gxc = xp.zeros((c, b, h + 2 * ph, w + 2 * pw), dtype=g.dtype)
    for n, rs, cs in _offsets(kh, kw, sh, sw, g.shape[2], g.shape[3], dilation):
        if disjoint:  # each input cell is in one window at most: write, don't accumulate
            xp.multiply(gc, ic == n, out=gxc[:, :, rs, cs])
        else:
            gxc[:, :, rs, cs] += gc * (ic == n)
    return _cm(_crop_cm(gxc, ph, pw))


def _window_counts(xp, h, w, ho, wo, kernel, stride, padding, dtype):
    """(Ho, Wo): how many input cells (padding not counted) each pooling window covers."""
    def along(n, no, k, s, p):
        start = xp.arange(no) * s - p
        return xp.clip(start + k, 0, n) - xp.clip(start, 0, n)

    rows = along(h, ho, kernel[0], stride[0], padding[0])
    cols = along(w, wo, kernel[1], stride[1], padding[1])
    return (rows[:, None] * cols[None, :]).astype(dtype)


def avg_pool_forward(xp, x, kernel, stride, padding, count_include_pad=True):
    """Mean over each window; zero padding counted unless ``count_include_pad`` is false."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho, wo = out_size(x.shape[2], kh, sh, ph), out_size(x.shape[3], kw, sw, pw)
    xc = _pad_cm(xp, _cm(x), ph, pw)
    out = None
    for _, rs, cs in _offsets(kh, kw, sh, sw, ho, wo):
        win = xc[:, :, rs, cs]
        if out is None:
            out = xp.empty(win.shape, dtype=x.dtype)
            out[...] = win
        else:
            out += win
    if count_include_pad or (ph == 0 and pw == 0):
        out *= 1.0 / (kh * kw)
    else:
        out /= _window_counts(xp, x.shape[2], x.shape[3], ho, wo, kernel, stride, padding, x.dtype)
    return _cm(out)


def avg_pool_grad(xp, g, x_shape, kernel, stride, padding, count_include_pad=True):
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    b, c, h, w = x_shape
    if count_include_pad or (ph == 0 and pw == 0):
        gs = _cm(g) * (1.0 / (kh * kw))
    else:
        gs = _cm(g) / _window_counts(xp, h, w, g.shape[2], g.shape[3], kernel, stride, padding, g.dtype)
    disjoint = sh >= kh and sw >= kw
    gxc = xp.zeros((c, b, h + 2 * ph, w + 2 * pw), dtype=g.dtype)
    for _, rs, cs in _offsets(kh, kw, sh, sw, g.shape[2], g.shape[3]):
        if disjoint:
            gxc[:, :, rs, cs] = gs
        else:
            gxc[:, :, rs, cs] += gs
    return _cm(_crop_cm(gxc, ph, pw))
