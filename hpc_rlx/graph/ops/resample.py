"""``pad`` and ``resize``: index maps along one axis at a time, the ops and their VJPs
(conventions in ``hpc_rlx.graph.ops``).

Both are separable: each output position along an axis reads one input position (nearest
resize, reflect, edge and wrap padding) or a weighted pair (linear resize). The forward gathers along
each axis in turn; the VJP is the transposed map, built once per geometry on the host as a
table that lists, for every input position, the output positions that read it (padded with a
zero slot). It runs as a few gathers, with no scatter-add, on NumPy and CuPy alike. Constant
padding, the common case, is plain slicing. Negative pads crop, before the other side is
padded (ONNX Pad): reflect, edge and wrap read the cropped axis.

Resize follows ONNX's coordinate transformations (``half_pixel``, ``pytorch_half_pixel``,
``align_corners``, ``asymmetric``, ``half_pixel_symmetric``) and nearest rounding modes, so
a PyTorch ``F.interpolate`` export (nearest: ``asymmetric`` and ``floor``; bilinear:
``half_pixel`` or ``align_corners``) computes what PyTorch does.
"""

from __future__ import annotations

import functools

import numpy as np

from hpc_rlx.graph.ops.common import finite_number
from hpc_rlx.graph.registry import REQUIRED, defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType, fmt_shape, require_float

PAD_MODES = ("constant", "reflect", "edge", "wrap")
RESIZE_MODES = ("nearest", "linear")
COORDINATES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


# ---------------------------------------------------------------- one axis


class AxisMap:
    """A linear map along one axis, ``out[j] = sum_k x[pos[j, k]] * weight[j, k]`` (weights
    None: all ones), and its transpose in the same form over ``len(out) + 1`` positions, the
    last being a zero slot that pads the rows. ``repeat`` > 0: each input is repeated that many
    times (nearest upsampling by a whole factor), computed by ``repeat`` and a reshaped sum."""

    __slots__ = ("n_in", "n_out", "pos", "weight", "back_pos", "back_weight", "identity", "repeat")

    def __init__(self, n_in, pos, weight=None):
        self.n_in, self.n_out = n_in, pos.shape[0]
        self.pos, self.weight = pos, weight
        self.identity = (self.n_out == n_in and pos.shape[1] == 1 and np.array_equal(pos[:, 0], np.arange(n_in))
                         and (weight is None or np.all(weight == 1.0)))
        r = self.n_out // n_in
        self.repeat = r if (weight is None and pos.shape[1] == 1 and r * n_in == self.n_out
                            and np.array_equal(pos[:, 0], np.arange(self.n_out) // r)) else 0
        self.back_pos, self.back_weight = self._transpose()

    def _transpose(self):
        entries = [[] for _ in range(self.n_in)]
        for j in range(self.n_out):
            for k in range(self.pos.shape[1]):
                w = 1.0 if self.weight is None else float(self.weight[j, k])
                if w != 0.0:
                    entries[int(self.pos[j, k])].append((j, w))
        width = max(1, max(len(e) for e in entries))
        pos = np.full((self.n_in, width), self.n_out, np.int64)  # the zero slot
        weight = np.zeros((self.n_in, width))
        for i, e in enumerate(entries):
            for k, (j, w) in enumerate(e):
                pos[i, k], weight[i, k] = j, w
        unit = self.weight is None or np.all((weight == 1.0) | (pos == self.n_out))
        return pos, (None if unit else weight)


def _weighted_gather(xp, x, pos, weight, axis):
    """``sum_k take(x, pos[:, k], axis) * weight[:, k]`` (broadcast along ``axis``)."""
    shape = (-1,) + (1,) * (x.ndim - axis - 1)
    out = None
    for k in range(pos.shape[1]):
        term = xp.take(x, xp.asarray(pos[:, k]), axis=axis)
        if weight is not None:
            term *= xp.asarray(weight[:, k], dtype=x.dtype).reshape(shape)
        if out is None:
            out = term
        else:
            out += term
    return out


def apply_map(xp, x, m: AxisMap, axis):
    if m.identity:
        return x
    if m.repeat:
        return xp.repeat(x, m.repeat, axis=axis)
    return _weighted_gather(xp, x, m.pos, m.weight, axis)


def apply_transpose(xp, g, m: AxisMap, axis):
    """The VJP of ``apply_map``: the cotangent along ``axis`` summed back onto the input."""
    if m.identity:
        return g
    if m.repeat:
        shape = g.shape[:axis] + (m.n_in, m.repeat) + g.shape[axis + 1:]
        return g.reshape(shape).sum(axis=axis + 1)
    if (m.back_pos == m.n_out).any():
        zero = xp.zeros(g.shape[:axis] + (1,) + g.shape[axis + 1:], dtype=g.dtype)
        g = xp.concatenate([g, zero], axis=axis)
    return _weighted_gather(xp, g, m.back_pos, m.back_weight, axis)


# ---------------------------------------------------------------- pad


def _pad_check(a):
    pads = a["pads"]
    if not isinstance(pads, (list, tuple)) or len(pads) % 2 or not pads or \
            any(isinstance(p, bool) or not isinstance(p, int) for p in pads):
        raise ShapeError(f"attribute 'pads' must be an even-length list of ints (begins, then ends), got {pads!r}")
    if a["mode"] not in PAD_MODES:
        raise ShapeError(f"attribute 'mode' must be one of {', '.join(PAD_MODES)}, got {a['mode']!r}")
    return {"pads": tuple(pads), "mode": a["mode"], "value": finite_number(a["value"], "value")}


def _pad_type(types, a):
    x = types[0]
    rank, pads = x.ndim, a["pads"]
    if len(pads) != 2 * rank:
        raise ShapeError(f"'pads' needs {2 * rank} entries for input {fmt_shape(x.shape)}, got {len(pads)}")
    if a["mode"] != "constant" and x.dtype != FLOAT:
        raise ShapeError(f"{a['mode']} padding needs a float input, got {x.dtype}")
    shape = []
    for i, d in enumerate(x.shape):
        begin, end = pads[i], pads[i + rank]
        if d is None:
            if begin or end:
                raise ShapeError(f"the batch dim (axis {i}) cannot be padded, got pads {begin}, {end}")
            shape.append(None)
            continue
        if d + begin + end < 1:
            raise ShapeError(f"pads {begin}, {end} leave nothing of axis {i} (size {d})")
        kept = d - max(-begin, 0) - max(-end, 0)  # what the non-constant modes read
        if a["mode"] != "constant" and (begin or end) and kept < 1:
            raise ShapeError(f"pads {begin}, {end} crop all of axis {i} (size {d}), leaving {a['mode']} padding "
                             f"nothing to read")
        if a["mode"] == "reflect" and max(begin, end) >= kept:
            raise ShapeError(f"reflect padding of axis {i} must be below its size ({kept} after cropping), "
                             f"got {begin}, {end}")
        shape.append(d + begin + end)
    return TensorType(tuple(shape), x.dtype)


@functools.lru_cache(maxsize=256)
def pad_map(n, begin, end, mode) -> AxisMap:
    """Negative pads crop the axis to ``[lo, hi)``; then output position j reads position
    j - begin of that, reflected (without repeating the edge), clamped (edge) or wrapped
    around where it lies outside."""
    lo, hi = max(-begin, 0), n - max(-end, 0)
    m = hi - lo
    src = np.arange(m + max(begin, 0) + max(end, 0)) - max(begin, 0)
    if mode == "reflect":
        period = 2 * (m - 1) if m > 1 else 1
        src = np.abs(src) % period
        src = np.where(src >= m, period - src, src)
    elif mode == "wrap":
        src = src % m
    else:
        src = np.clip(src, 0, m - 1)
    return AxisMap(n, (src + lo).reshape(-1, 1).astype(np.int64))


def _pad_slices(shape, pads):
    """(output index, input index) of the part of the input the output keeps (negative pads crop)."""
    rank = len(shape)
    dst, src = [], []
    for i, d in enumerate(shape):
        begin, end = pads[i], pads[i + rank]
        lo, hi = max(-begin, 0), d - max(-end, 0)
        dst.append(slice(max(begin, 0), max(begin, 0) + hi - lo))
        src.append(slice(lo, hi))
    return tuple(dst), tuple(src)


def _padded_axes(shape, pads):
    rank = len(shape)
    return [(i, pads[i], pads[i + rank]) for i in range(rank) if pads[i] or pads[i + rank]]


@defop("pad", _pad_type, (1, 1), attrs={"pads": REQUIRED, "mode": "constant", "value": 0.0}, check=_pad_check)
def pad(xp, args, a, ctx):
    x = args[0]
    if a["mode"] == "constant":
        shape = tuple(d + b + e for d, b, e in zip(x.shape, a["pads"], a["pads"][x.ndim:]))
        out = xp.full(shape, a["value"] if x.dtype.kind == "f" else int(a["value"]), dtype=x.dtype)
        dst, src = _pad_slices(x.shape, a["pads"])
        out[dst] = x[src]
    else:
        out = x
        for axis, begin, end in _padded_axes(x.shape, a["pads"]):
            out = apply_map(xp, out, pad_map(out.shape[axis], begin, end, a["mode"]), axis)
    return out, (x.shape if ctx.need_saved else None)


def _pad_x(xp, g, args, ans, shape, a, out):
    if a["mode"] == "constant":
        dst, src = _pad_slices(shape, a["pads"])
        if all(s.start == 0 and s.stop == d for s, d in zip(src, shape)):
            return g[dst]
        gx = xp.zeros(shape, dtype=g.dtype)
        gx[src] = g[dst]
        return gx
    axes = _padded_axes(shape, a["pads"])
    for axis, begin, end in reversed(axes):
        g = apply_transpose(xp, g, pad_map(shape[axis], begin, end, a["mode"]), axis)
    return g


defvjp("pad", _pad_x, needs_args=())


# ---------------------------------------------------------------- resize


def _resize_check(a):
    size = a["size"]
    if not isinstance(size, (list, tuple)) or not size or \
            any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size):
        raise ShapeError(f"attribute 'size' must be a list of positive ints (one per spatial axis), got {size!r}")
    for key, allowed in (("mode", RESIZE_MODES), ("coordinates", COORDINATES), ("nearest_mode", NEAREST_MODES)):
        if a[key] not in allowed:
            raise ShapeError(f"attribute '{key}' must be one of {', '.join(allowed)}, got {a[key]!r}")
    scales = a["scales"]
    if scales is not None:
        if not isinstance(scales, (list, tuple)) or len(scales) != len(size):
            raise ShapeError(f"attribute 'scales' must be null or one number per spatial axis, got {scales!r}")
        scales = tuple(finite_number(s, "scales") for s in scales)
        if min(scales) <= 0:
            raise ShapeError(f"attribute 'scales' must be positive, got {list(scales)}")
    return {"size": tuple(size), "mode": a["mode"], "coordinates": a["coordinates"],
            "nearest_mode": a["nearest_mode"], "scales": scales}


def _resize_type(types, a):
    x = types[0]
    require_float(x, "input")
    if x.ndim < 3:
        raise ShapeError(f"input must be (B, C, spatial...), got {fmt_shape(x.shape)}")
    if None in x.shape[1:]:
        raise ShapeError("only the batch dim may be unknown")
    if len(a["size"]) != x.ndim - 2:
        raise ShapeError(f"'size' needs {x.ndim - 2} entries for input {fmt_shape(x.shape)}, got {len(a['size'])}")
    return TensorType(tuple(x.shape[:2]) + tuple(a["size"]), FLOAT)


def source_coordinates(n_in, n_out, scale, coordinates) -> np.ndarray:
    """ONNX Resize's input coordinate of each output position along one axis; ``scale`` is
    the given scale, or None for ``n_out / n_in``."""
    x = np.arange(n_out, dtype=np.float64)
    s = n_out / n_in if scale is None else scale
    if coordinates == "asymmetric":
        return x / s
    if coordinates == "align_corners":
        return x * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
    if coordinates == "pytorch_half_pixel" and n_out == 1:
        return np.zeros(1)
    if coordinates == "half_pixel_symmetric":
        adjustment = n_out / (s * n_in)
        return n_in / 2 * (1 - adjustment) + (x + 0.5) / s - 0.5
    return (x + 0.5) / s - 0.5


@functools.lru_cache(maxsize=256)
def resize_map(n_in, n_out, mode, coordinates, nearest_mode, scale) -> AxisMap:
    src = source_coordinates(n_in, n_out, scale, coordinates)
    if mode == "nearest":
        rounded = {"round_prefer_floor": np.ceil(src - 0.5), "round_prefer_ceil": np.floor(src + 0.5),
                   "floor": np.floor(src), "ceil": np.ceil(src)}[nearest_mode]
        return AxisMap(n_in, np.clip(rounded, 0, n_in - 1).astype(np.int64).reshape(-1, 1))
    src = np.clip(src, 0, n_in - 1)
    low = np.floor(src).astype(np.int64)
    high = np.minimum(low + 1, n_in - 1)
    frac = src - low
    return AxisMap(n_in, np.stack([low, high], 1), np.stack([1.0 - frac, frac], 1))


def _resize_maps(in_shape, a):
    scales = a["scales"] or (None,) * len(a["size"])
    return [(2 + k, resize_map(int(in_shape[2 + k]), int(n), a["mode"], a["coordinates"], a["nearest_mode"], s))
            for k, (n, s) in enumerate(zip(a["size"], scales))]


@defop("resize", _resize_type, (1, 1),
       attrs={"size": REQUIRED, "mode": "nearest", "coordinates": "half_pixel", "nearest_mode": "round_prefer_floor",
              "scales": None},
       check=_resize_check)
def resize(xp, args, a, ctx):
    x = args[0]
    out = x
    for axis, m in reversed(_resize_maps(x.shape, a)):  # the last axis first, as PyTorch sums
        out = apply_map(xp, out, m, axis)
    return out, (x.shape if ctx.need_saved else None)


def _resize_x(xp, g, args, ans, shape, a, out):
    for axis, m in _resize_maps(shape, a):
        g = apply_transpose(xp, g, m, axis)
    return g


defvjp("resize", _resize_x, needs_args=())

