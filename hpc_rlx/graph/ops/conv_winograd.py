"""3x3 convolution, stride 1, padding 1, by Winograd's minimal filtering F(2x2, 3x3) (Lavin and
Gray, "Fast Algorithms for Convolutional Neural Networks", 2016): the kernels ``conv2d`` picks
for a ResNet's or a VGG's 3x3 layers, which im2col runs as one GEMM with 9 rows per channel.

The output is cut into 2x2 tiles, each computed from a 4x4 tile of the padded input. With the
fixed matrices below, per tile and channel pair, ``Y = A^T [(G g G^T) * (B^T d B)] A``. The
elementwise product over the 16 positions of a 4x4 tile, summed over input channels, is 16
batched GEMMs ``M[p] = U[p] (O, C) @ V[p] (C, tiles)``: 16 multiply-adds per four outputs and
channel pair, where im2col does 36 (2.25x fewer). Training differentiates through the same
linear maps: the input's gradient is ``B gV B^T`` with ``gV[p] = U[p]^T gM[p]`` and the kernel's
``G^T gU G`` with ``gU[p] = gM[p] V[p]^T``, where ``gM = A gY A^T``. Everything works on the
batch-last layout of ``windows`` (C, H, W, B); each transform is four adds or subtractions of
quarter-size slices, never a matrix product over a short axis.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.ops.windows import batch_first_view, batch_last

# G (4 x 3): the kernel transform; KRON_G (16, 9) applies it on both axes of a flattened 3x3
G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
KRON_G = np.kron(G, G)


def applies(in_size, kernel, stride, padding, dilation, groups, in_channels, out_channels) -> bool:
    """Whether these kernels serve the convolution: 2-D, 3x3, stride 1, padding 1, no dilation,
    one group, on maps of at most 16 positions with at least 64 channels. Measured here (CPU
    time of forward + both gradients, batch 32, against im2col): 4x4 with 128 channels 0.70x,
    2x2 with 256 and 512 channels 0.85-0.92x, but 8x8 with 64 channels 1.38x and 16x16 1.02x:
    on larger maps the 16 tile gathers and scatters and the transforms' passes over four times
    the input cost more than the GEMMs save."""
    return (len(in_size) == 2 and tuple(kernel) == (3, 3) and tuple(stride) == (1, 1)
            and tuple(padding) == (1, 1) and tuple(dilation) == (1, 1) and groups == 1
            and min(in_channels, out_channels) >= 64 and in_size[0] * in_size[1] <= 16
            and min(in_size) >= 2)


def _input_transform(xp, d):
    """B^T d B over the two leading (4, 4) axes of ``d``, as one new (4, 4, ...) array."""
    rows = xp.empty_like(d)
    xp.subtract(d[0], d[2], out=rows[0])
    xp.add(d[1], d[2], out=rows[1])
    xp.subtract(d[2], d[1], out=rows[2])
    xp.subtract(d[1], d[3], out=rows[3])
    v = d  # d is ours and no longer needed: the columns land in it
    xp.subtract(rows[:, 0], rows[:, 2], out=v[:, 0])
    xp.add(rows[:, 1], rows[:, 2], out=v[:, 1])
    xp.subtract(rows[:, 2], rows[:, 1], out=v[:, 2])
    xp.subtract(rows[:, 1], rows[:, 3], out=v[:, 3])
    return v


def _input_transform_adjoint(xp, gv):
    """B gV B^T: the adjoint of ``_input_transform`` (B's rows are B^T's columns: (1, 0, 0, 0),
    (0, 1, -1, 1), (-1, 1, 1, 0), (0, 0, 0, -1))."""
    rows = xp.empty_like(gv)
    rows[0] = gv[0]
    xp.subtract(gv[1], gv[2], out=rows[1])
    rows[1] += gv[3]
    xp.add(gv[1], gv[2], out=rows[2])
    rows[2] -= gv[0]
    xp.negative(gv[3], out=rows[3])
    out = gv  # gv is ours and no longer needed
    out[:, 0] = rows[:, 0]
    xp.subtract(rows[:, 1], rows[:, 2], out=out[:, 1])
    out[:, 1] += rows[:, 3]
    xp.add(rows[:, 1], rows[:, 2], out=out[:, 2])
    out[:, 2] -= rows[:, 0]
    xp.negative(rows[:, 3], out=out[:, 3])
    return out


def _output_transform(xp, m):
    """A^T M A over the two leading (4, 4) axes: (2, 2, ...)."""
    rows = xp.empty((2,) + m.shape[1:], dtype=m.dtype)
    xp.add(m[0], m[1], out=rows[0])
    rows[0] += m[2]
    xp.subtract(m[1], m[2], out=rows[1])
    rows[1] -= m[3]
    y = xp.empty((2, 2) + m.shape[2:], dtype=m.dtype)
    xp.add(rows[:, 0], rows[:, 1], out=y[:, 0])
    y[:, 0] += rows[:, 2]
    xp.subtract(rows[:, 1], rows[:, 2], out=y[:, 1])
    y[:, 1] -= rows[:, 3]
    return y


def _output_transform_adjoint(xp, gy):
    """A gY A^T: the adjoint of ``_output_transform``, (2, 2, ...) -> (4, 4, ...)."""
    rows = xp.empty((4,) + gy.shape[1:], dtype=gy.dtype)
    rows[0] = gy[0]
    xp.add(gy[0], gy[1], out=rows[1])
    xp.subtract(gy[0], gy[1], out=rows[2])
    xp.negative(gy[1], out=rows[3])
    gm = xp.empty((4, 4) + gy.shape[2:], dtype=gy.dtype)
    gm[:, 0] = rows[:, 0]
    xp.add(rows[:, 0], rows[:, 1], out=gm[:, 1])
    xp.subtract(rows[:, 0], rows[:, 1], out=gm[:, 2])
    xp.negative(rows[:, 1], out=gm[:, 3])
    return gm


def _tiles(size):
    """Tiles per axis: ceil(n / 2)."""
    return tuple((n + 1) // 2 for n in size)


def forward(xp, x, w, b):
    """(y (B, O, H, W), saved) for x (B, C, H, W), w (O, C, 3, 3), b (O,) or None."""
    batch, c, h, wd = x.shape
    o = w.shape[0]
    th, tw = _tiles((h, wd))
    xb = batch_last(xp, x)
    padded = xp.zeros((c, 2 * th + 2, 2 * tw + 2, batch), dtype=x.dtype)
    padded[:, 1:h + 1, 1:wd + 1] = xb
    d = xp.empty((4, 4, c, th, tw, batch), dtype=x.dtype)
    for i in range(4):
        for j in range(4):
            d[i, j] = padded[:, i:i + 2 * th:2, j:j + 2 * tw:2]
    v = _input_transform(xp, d).reshape(16, c, -1)
    u = _kernel_transform(xp, w).reshape(16, o, c)
    m = xp.matmul(u, v).reshape(4, 4, o, th, tw, batch)
    tiles = _output_transform(xp, m)
    y = xp.empty((o, h, wd, batch), dtype=x.dtype)
    for i in range(2):
        for j in range(2):
            y[:, i::2, j::2] = tiles[i, j][:, :(h - i + 1) // 2, :(wd - j + 1) // 2]
    if b is not None:
        y += b.reshape(o, 1, 1, 1)
    return batch_first_view(y), (u, v, (h, wd))


def _kernel_transform(xp, w):
    """U (16, O, C) = G w G^T per channel pair: one GEMM, kron(G, G) (16, 9) against the
    kernels seen as (O * C, 9)."""
    o, c = w.shape[:2]
    return xp.matmul(xp.asarray(KRON_G, dtype=w.dtype), w.reshape(o * c, 9).T).reshape(16, o, c)


def _kernel_transform_adjoint(xp, gu, w_shape, out=None):
    """G^T gU G for every channel pair: gU (16, O, C) -> (O, C, 3, 3), one GEMM (into ``out``)."""
    o, c = w_shape[:2]
    k = xp.asarray(KRON_G, dtype=gu.dtype)
    if out is not None:
        xp.matmul(gu.reshape(16, o * c).T, k, out=out.reshape(o * c, 9))
        return out
    return xp.matmul(gu.reshape(16, o * c).T, k).reshape(w_shape)


def _tile_cotangent(xp, g, o, size):
    """gM (16, O, tiles) from the output cotangent g (B, O, H, W)."""
    h, wd = size
    th, tw = _tiles(size)
    gb = batch_last(xp, g)
    batch = gb.shape[-1]
    gy = xp.zeros((2, 2, o, th, tw, batch), dtype=g.dtype)
    for i in range(2):
        for j in range(2):
            gy[i, j][:, :(h - i + 1) // 2, :(wd - j + 1) // 2] = gb[:, i::2, j::2]
    return _output_transform_adjoint(xp, gy).reshape(16, o, -1)


def grad_x(xp, g, saved):
    u, v, (h, wd) = saved
    o, c = u.shape[1:]
    th, tw = _tiles((h, wd))
    gm = _tile_cotangent(xp, g, o, (h, wd))
    gv = xp.matmul(u.transpose(0, 2, 1), gm)  # (16, C, tiles)
    batch = gv.shape[2] // (th * tw)
    gd = _input_transform_adjoint(xp, gv.reshape(4, 4, c, th, tw, batch))
    padded = xp.zeros((c, 2 * th + 2, 2 * tw + 2, batch), dtype=g.dtype)
    for i in range(4):
        for j in range(4):
            padded[:, i:i + 2 * th:2, j:j + 2 * tw:2] += gd[i, j]
    return batch_first_view(xp.ascontiguousarray(padded[:, 1:h + 1, 1:wd + 1]))


def grad_w(xp, g, saved, out=None):
    u, v, size = saved
    o, c = u.shape[1:]
    gm = _tile_cotangent(xp, g, o, size)
    gu = xp.matmul(gm, v.transpose(0, 2, 1))  # (16, O, C)
    return _kernel_transform_adjoint(xp, gu, (o, c, 3, 3), out)
