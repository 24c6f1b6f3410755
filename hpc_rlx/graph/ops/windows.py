"""The batch-last image layout and the kernel-window geometry that ``conv`` and ``pool`` share.

Internally everything works batch-last, (C, H, W, B): a kernel offset shifts whole runs of
W*B contiguous numbers (B at a stride), so every pass is a long, vectorised slice op rather
than one short row per image. Outputs are handed on as (B, C, H, W) transposed views of
batch-last arrays. Elementwise ops keep the layout (NumPy and CuPy allocate results in the
operands' memory order), the next conv or pool reads it without a copy, and only a flatten (or
an input that arrives batch-first, like the data) pays one transposing copy.

Padding is never materialised: each kernel offset touches only the part of the output whose
input lies inside the image (``kernel_windows``).
"""

from __future__ import annotations

import functools


def out_size(n: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def batch_last_view(x):
    """(B, C, H, W) -> (C, H, W, B): a view, no copy."""
    return x.transpose(1, 2, 3, 0)


def batch_first_view(a):
    """(C, H, W, B) -> (B, C, H, W): a view, no copy."""
    return a.transpose(3, 0, 1, 2)


def batch_last(xp, x):
    """``x`` (B, C, H, W) as (C, H, W, B): a view when its batch is already the innermost axis
    (what conv and pool produce), else one transposing copy (the data, a flatten's cotangent)."""
    if x.shape[0] == 1 or x.strides[0] == x.itemsize:
        return batch_last_view(x)
    return xp.ascontiguousarray(batch_last_view(x))


def _span(n_in, n_out, off, s):
    """Output positions [r0, r1) whose input position ``r * s + off`` lies in [0, n_in), and
    the input slice they read."""
    r0 = max(0, -(off // s))
    r1 = max(r0, min(n_out, (n_in - 1 - off) // s + 1))
    start = r0 * s + off
    return slice(r0, r1), slice(start, start + (r1 - r0 - 1) * s + 1, s), r1 > r0


def kernel_windows(in_hw, out_hw, kernel, stride, padding, dilation=(1, 1)):
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
