"""Convolution on small maps as one dense matrix per group: the kernels ``conv2d`` picks when
the input's spatial size is no larger than the kernel's (a ResNet's 3x3 convolutions on 2x2
and 1x1 maps, a ConvNeXt's 7x7 depthwise convolution on 4x4 maps).

There im2col spends most of its GEMM on kernel taps that read padding (on a 1x1 map, 8 of a
3x3 kernel's 9), and a depthwise kernel pays ~150 slice copies a step for a few thousand
numbers. Here each group's convolution is the linear map it is: T (O_g*Ho*Wo, C_g*H*W), built
from the kernel by one gather (``taps``: which kernel tap links output position p to input
position q, or none), so

    forward   y (G, O_g*Ho*Wo, B) = T @ x (G, C_g*H*W, B)     (x, y batch-last, as in conv.py)
    input     gx = T^T @ g
    kernel    gT = g @ x^T, then each tap's entries of gT summed: gT (O*C_g, Ho*Wo*H*W) @ M,
              M the 0/1 (Ho*Wo*H*W, taps) matrix of ``taps``

It does H*W multiply-adds per output value and channel where im2col does kh*kw, hence the
rule in ``worth_it``. Stride, padding and dilation only change ``taps``; volumes work alike.
"""

from __future__ import annotations

import functools
from math import prod

import numpy as np

from hpc_rlx.graph.ops.windows import batch_first_view, batch_last, out_sizes

MAX_MATRIX = 1 << 22  # T's entries at most (16 MiB in float32), whatever the flop count
FEW_PAIRS = 16  # up to this many (output, input) position pairs, the kernel gradient is summed by columns


def worth_it(in_size, kernel, in_per_group, out_channels) -> bool:
    """Whether the dense kernels beat im2col (measured here on ResNet and ConvNeXt shapes,
    batch 32): with one input channel per group (depthwise), up to 8x the kernel's area in
    input positions, since im2col then runs one tiny GEMM per channel behind ~kh*kw slice
    copies (a 7x7 on 8x8: 0.45 against 5.3 ms, a 3x3 on 16x16: 26 against 12 ms); otherwise
    only where at most a quarter of the kernel reads the image (3x3 on 1x1: 5.4 against 9.8
    ms, on 2x2 it loses 6.7 against 5.7 ms to building T). T must stay small either way."""
    area, k = prod(in_size), prod(kernel)
    fits = area <= (8 * k if in_per_group == 1 else k / 4)
    return fits and out_channels * in_per_group * area * area <= MAX_MATRIX


@functools.lru_cache(maxsize=128)
def taps(size, kernel, stride, padding, dilation):
    """(out size, index, dead): index (prod(out), prod(size)) is the kernel tap joining each
    output and input position (0 where none does), dead the mask of those pairs (None if every
    pair has a tap)."""
    out = out_sizes(size, kernel, stride, padding, dilation)
    tap, valid = np.zeros((), np.int64), np.ones((), bool)
    for n, k, o, s, p, d in zip(size, kernel, out, stride, padding, dilation):
        offset = np.arange(n)[None, :] - (np.arange(o)[:, None] * s - p)  # (o, n)
        index, rest = np.divmod(offset, d)
        ok = (rest == 0) & (index >= 0) & (index < k)
        tap = tap[..., None, None] * k + index  # axes interleaved: (o0, i0, o1, i1, ...)
        valid = valid[..., None, None] & ok
    nd = len(size)
    order = [2 * a for a in range(nd)] + [2 * a + 1 for a in range(nd)]
    valid = valid.transpose(order).reshape(prod(out), prod(size))
    index = np.where(valid, tap.transpose(order).reshape(valid.shape), 0)
    dead = None if valid.all() else ~valid
    for a in (index, dead):
        if a is not None:
            a.flags.writeable = False
    return out, index, dead


@functools.lru_cache(maxsize=64)
def tap_sums(size, kernel, stride, padding, dilation, dtype):
    """M: (prod(out) * prod(size), prod(kernel)), 1 where ``taps`` names that tap."""
    _, index, dead = taps(size, kernel, stride, padding, dilation)
    m = np.zeros((index.size, prod(kernel)), dtype)
    live = np.arange(index.size) if dead is None else np.flatnonzero(~dead)
    m[live, index.ravel()[live]] = 1
    m.flags.writeable = False
    return m


def _matrix(xp, w, index, dead, groups):
    """T (G, O_g * P, C_g * Q) from w (O, C_g, *kernel) and ``taps``' index and dead (P, Q)."""
    o, cg = w.shape[:2]
    p, q = index.shape
    t = xp.take(w.reshape(o, cg, -1), xp.asarray(index), axis=2)  # (O, C_g, P, Q)
    if dead is not None:
        t[:, :, xp.asarray(dead)] = 0
    return xp.ascontiguousarray(t.transpose(0, 2, 1, 3)).reshape(groups, (o // groups) * p, cg * q)


def forward(xp, x, w, b, stride, padding, dilation, groups):
    """(y (B, O, *out), saved) for x (B, C, *size)."""
    size, kernel = tuple(x.shape[2:]), tuple(w.shape[2:])
    out, index, dead = taps(size, kernel, tuple(stride), tuple(padding), tuple(dilation))
    t = _matrix(xp, w, index, dead, groups)
    batch = x.shape[0]
    xg = batch_last(xp, x).reshape(groups, -1, batch)
    y = xp.matmul(t, xg).reshape(w.shape[0], -1)
    if b is not None:
        y += b.reshape(-1, 1)
    return batch_first_view(y.reshape(w.shape[0], *out, batch)), (t, xg, size)


def grad_x(xp, g, saved, groups):
    t, xg, size = saved
    gm = batch_last(xp, g).reshape(groups, t.shape[1], -1)
    gx = xp.matmul(t.transpose(0, 2, 1), gm)
    return batch_first_view(gx.reshape(-1, *size, gm.shape[2]))


def grad_w(xp, g, saved, w_shape, stride, padding, dilation, groups, out=None):
    t, xg, size = saved
    o, cg, kernel = w_shape[0], w_shape[1], tuple(w_shape[2:])
    gm = batch_last(xp, g).reshape(groups, t.shape[1], -1)
    gt = xp.matmul(gm, xg.transpose(0, 2, 1))  # (G, O_g * P, C_g * Q)
    p, q = t.shape[1] // (o // groups), t.shape[2] // cg
    gt = xp.ascontiguousarray(gt.reshape(o, p, cg, q).transpose(0, 2, 1, 3)).reshape(o * cg, p * q)
    geometry = (size, kernel, tuple(stride), tuple(padding), tuple(dilation))
    if p * q <= FEW_PAIRS:  # a column add per live pair: a GEMM against M with k = 1 or 4 crawls
        _, index, dead = taps(*geometry)
        target = out.reshape(o * cg, -1) if out is not None else xp.empty((o * cg, prod(kernel)), gt.dtype)
        target[...] = 0
        for pair in range(p * q):
            if dead is None or not dead.flat[pair]:
                target[:, int(index.flat[pair])] += gt[:, pair]
        return out if out is not None else target.reshape(w_shape)
    m = xp.asarray(tap_sums(*geometry, np.dtype(gt.dtype).str))
    if out is not None:
        xp.matmul(gt, m, out=out.reshape(o * cg, -1))
        return out
    return xp.matmul(gt, m).reshape(w_shape)
