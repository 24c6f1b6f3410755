"""The batch-last image layout and the kernel-window geometry that ``conv`` and ``pool`` share,
for images (B, C, H, W) and volumes (B, C, D, H, W) alike.

Internally everything works batch-last, (C, *spatial, B): a kernel offset shifts whole runs of
W*B contiguous numbers (B at a stride), so every pass is a long, vectorised slice op rather
than one short row per image. Outputs are handed on as (B, C, *spatial) transposed views of
batch-last arrays. Elementwise ops keep the layout (NumPy and CuPy allocate results in the
operands' memory order), the next conv or pool reads it without a copy, and only a flatten (or
an input that arrives batch-first, like the data) pays one transposing copy.

Padding is never materialised: each kernel offset touches only the part of the output whose
input lies inside the image (``kernel_windows``). The code is the same for every spatial rank:
a window is a tuple of per-axis slices.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple


def out_size(n: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def out_sizes(size, kernel, stride, padding, dilation) -> tuple:
    """``out_size`` per spatial axis."""
    return tuple(out_size(*t) for t in zip(size, kernel, stride, padding, dilation))


def batch_last_view(x):
    """(B, C, *spatial) -> (C, *spatial, B): a view, no copy."""
    return x.transpose(*range(1, x.ndim), 0)


def batch_first_view(a):
    """(C, *spatial, B) -> (B, C, *spatial): a view, no copy."""
    return a.transpose(a.ndim - 1, *range(a.ndim - 1))


def batch_last(xp, x):
    """``x`` (B, C, *spatial) as (C, *spatial, B): a view when its batch is already the innermost
    axis (what conv and pool produce), else one transposing copy (the data, a flatten's
    cotangent)."""
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


def kernel_windows(in_size, out_size_, kernel, stride, padding, dilation=None):
    """Per kernel offset n (row-major over the kernel's axes): (n, output index, input index,
    kind, rim). The indexes are tuples ``(:, slice per spatial axis)`` into a batch-last
    (C, *spatial, B) array; kind is None (no output reads the image), "all" (every output
    position reads the image) or "part", and then rim lists the indexes of the output positions
    that read the padding. Cached: a step asks for the same few geometries every time."""
    nd = len(in_size)
    dilation = dilation or (1,) * nd
    return _windows_of(nd, *map(int, (*in_size, *out_size_, *kernel, *stride, *padding, *dilation)))


@functools.lru_cache(maxsize=256)
def _windows_of(nd, *geometry):
    size, out, kernel, stride, pad, dil = (geometry[i * nd:(i + 1) * nd] for i in range(6))
    axes = [[_span(size[a], out[a], i * dil[a] - pad[a], stride[a]) for i in range(kernel[a])] for a in range(nd)]
    every = slice(None)
    res = []
    for n, spans in enumerate(itertools.product(*axes)):
        osl = tuple(sp[0] for sp in spans)
        kind = None
        rim = ()
        if all(sp[2] for sp in spans):
            kind = "all" if all(o.stop - o.start == out[a] for a, o in enumerate(osl)) else "part"
        if kind == "part":  # per axis, the rows before and after the span (within the earlier axes' spans)
            rim = tuple((every,) + osl[:a] + (cut,) for a, o in enumerate(osl)
                        for cut in (slice(0, o.start), slice(o.stop, None)))
        res.append((n, (every,) + osl, (every,) + tuple(sp[1] for sp in spans), kind, rim))
    return tuple(res)


class Plan(NamedTuple):
    """One geometry's windows and what the kernels decide from them, computed once (cached)."""

    out: tuple  # the output's spatial size
    windows: tuple  # every kernel offset's window (``kernel_windows``)
    live: tuple  # the windows that read the image (kind not None)
    covering: tuple | None  # the first live window whose outputs read every input position once
    disjoint: bool  # no input position is in two windows
    tiles: bool  # the windows cover every input position exactly once (a 2x2/2 pool on even sizes)


def plan(size, kernel, stride, padding, dilation=None) -> Plan:
    """The ``Plan`` of a kernel over an input of spatial ``size``."""
    nd = len(size)
    return _plan_of(nd, *map(int, (*size, *kernel, *stride, *padding, *(dilation or (1,) * nd))))


@functools.lru_cache(maxsize=256)
def _plan_of(nd, *geometry):
    size, kernel, stride, pad, dil = (geometry[i * nd:(i + 1) * nd] for i in range(5))
    out = out_sizes(size, kernel, stride, pad, dil)
    windows = kernel_windows(size, out, kernel, stride, pad, dil)
    live = tuple(t for t in windows if t[3] is not None)
    unit = all(s == 1 for s in stride)
    covering = next((t for t in live if unit and all(i.start == 0 for i in t[2][1:])
                     and all(o.stop - o.start == n for o, n in zip(t[1][1:], size))), None)
    disjoint = all(s >= d * (k - 1) + 1 for s, d, k in zip(stride, dil, kernel))
    tiles = (not any(pad) and all(d == 1 for d in dil) and stride == kernel
             and all(o * k == n for o, k, n in zip(out, kernel, size)))
    return Plan(out, windows, live, covering, disjoint, tiles)
