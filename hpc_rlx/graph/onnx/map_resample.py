"""ONNX -> IR for the ops that change spatial sizes: Pad, Resize and ConvTranspose (see
``map_math`` for the mapping convention), plus Pad's NumPy evaluator for the constant folder.

Pad takes its pads (and constant value, and opset 18's axes) as constant inputs; only
dimensions that are one IR dimension and not the batch may be padded. Resize takes constant
scales or sizes over every dimension (or opset 18's axes), leaving the batch and channel
dimensions alone; scales are kept as the IR op's ``scales`` because ONNX's coordinate
transformations divide by the given scale, not by the size ratio. ConvTranspose reads 1-D
signals as (B, C, 1, L) images like Conv; uneven pads (from ``pads``, ``output_shape`` or
``auto_pad``) become an even padding plus more ``output_padding`` where that stays below the
stride, else the even padding of the smaller side and a slice that crops the rest.
"""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.graph.onnx.emit import decimal32, folded_scalar
from hpc_rlx.graph.onnx.fold import Folded, FoldError, ints
from hpc_rlx.graph.onnx.map_math import float_tensor
from hpc_rlx.graph.onnx.map_nn import image_input, with_one_dim
from hpc_rlx.graph.shapes import FLOAT

_NUMPY_PAD = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def _const_ints(em, v, what: str) -> list:
    if not isinstance(v, Folded) or not v.const:
        raise em.fail(f"{what} must be a constant")
    return ints(v.value)


def _onnx_pads(pads: list, axes, rank: int) -> list:
    """Pads over every axis (begins, then ends) from pads over ``axes`` (opset 18)."""
    if axes is None:
        if len(pads) != 2 * rank:
            raise ValueError(f"pads has {len(pads)} entries, the input has rank {rank}")
        return list(pads)
    full = [0] * (2 * rank)
    for k, ax in enumerate(axes):
        full[ax % rank], full[ax % rank + rank] = pads[k], pads[k + len(axes)]
    return full


# ---------------------------------------------------------------- Pad


def fold_pad(ins, at):
    data = ins[0]
    pads = ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(at.get("pads", []))
    axes = ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    pads = _onnx_pads(pads, axes, data.ndim)
    mode = at.get("mode", "constant")
    if mode not in _NUMPY_PAD:
        raise FoldError(f"Pad mode {mode!r}")
    rank = data.ndim
    crop = tuple(slice(max(-pads[i], 0), data.shape[i] - max(-pads[i + rank], 0)) for i in range(rank))
    width = [(max(pads[i], 0), max(pads[i + rank], 0)) for i in range(rank)]
    if mode == "constant":
        value = ins[2].reshape(()).item() if len(ins) > 2 and ins[2] is not None and ins[2].size else 0
        return np.pad(data[crop], width, mode="constant", constant_values=value)
    return np.pad(data[crop], width, mode=_NUMPY_PAD[mode])


def pad(em, ins, at, n):
    x = em.as_tensor(ins[0])
    mode = at.get("mode", "constant")
    if mode not in _NUMPY_PAD:
        raise em.fail(f"Pad mode {mode!r} is not supported (constant, reflect, edge and wrap are)")
    pads = _const_ints(em, ins[1], "Pad's pads") if len(ins) > 1 and ins[1] is not None else list(at.get("pads", []))
    axes = _const_ints(em, ins[3], "Pad's axes") if len(ins) > 3 and ins[3] is not None else None
    try:
        pads = _onnx_pads(pads, axes, x.rank)
    except ValueError as exc:
        raise em.fail(str(exc)) from None
    value = 0.0
    if len(ins) > 2 and ins[2] is not None and not (isinstance(ins[2], Folded) and ins[2].value.size == 0):
        value = folded_scalar(ins[2], "Pad's constant_value", em)
        value = decimal32(value) if x.dtype == FLOAT else int(value)
    ir_begin, ir_end, groups = [], [], []
    for i, g in enumerate(x.groups):
        begin, end = pads[i], pads[i + x.rank]
        if (begin or end) and not x.plain(i):
            raise em.fail(f"Pad of ONNX axis {i}, which holds the batch or is split in the IR, is not supported")
        ir_begin += [begin] + [0] * (len(g) - 1)
        ir_end += [end] + [0] * (len(g) - 1)
        groups.append((g[0] + begin + end,) if begin or end else g)
    if not any(pads):
        return [x]
    return [em.tensor("pad", [x], tuple(groups), pads=ir_begin + ir_end, mode=mode, value=value)]


# ---------------------------------------------------------------- Resize


def _empty(v) -> bool:
    return v is None or (isinstance(v, Folded) and v.const and v.value.size == 0)


def _sizes(em, v) -> list:
    """Resize's sizes; a batch-dependent entry (sizes built from Shape) may only be the batch's."""
    if not isinstance(v, Folded):
        raise em.fail("Resize's sizes must be a constant")
    a, b = ints(v.a), ints(v.b)
    if len(a) != len(b) or any(x != y for x, y in list(zip(a, b))[1:]):
        raise em.fail("Resize's sizes must be a constant (beyond the batch dim)")
    return a


def resize(em, ins, at, n):
    x = float_tensor(em, ins[0])
    mode = at.get("mode", "nearest")
    coordinates = at.get("coordinate_transformation_mode", "half_pixel")
    if mode not in ("nearest", "linear"):
        raise em.fail(f"Resize mode {mode!r} is not supported (nearest and linear are)")
    if coordinates == "tf_crop_and_resize":
        raise em.fail("Resize coordinate_transformation_mode 'tf_crop_and_resize' is not supported")
    if at.get("antialias", 0):
        raise em.fail("Resize with antialias=1 is not supported")
    if x.rank < 3 or x.groups[0] != (None,) or not all(x.plain(i) for i in range(1, x.rank)):
        raise em.fail(f"Resize needs (batch, C, spatial...) input, got ONNX rank {x.rank}")
    rank = x.rank
    axes = [a % rank for a in at["axes"]] if "axes" in at else list(range(rank))
    size_in = [None] + [x.groups[i][0] for i in range(1, rank)]
    scales_in = ins[2] if len(ins) > 2 else None
    sizes_in = ins[3] if len(ins) > 3 else None
    scales, sizes = [1.0] * rank, list(size_in)
    given_scales = not _empty(scales_in)
    if given_scales:
        if not isinstance(scales_in, Folded) or not scales_in.const:
            raise em.fail("Resize's scales must be a constant")
        for ax, s in zip(axes, scales_in.value.reshape(-1).tolist()):
            scales[ax] = decimal32(s)
        sizes = [None] + [int(math.floor(size_in[i] * scales[i])) for i in range(1, rank)]
    elif not _empty(sizes_in):
        if at.get("keep_aspect_ratio_policy", "stretch") != "stretch":
            raise em.fail("Resize keep_aspect_ratio_policy other than 'stretch' is not supported")
        for ax, s in zip(axes, _sizes(em, sizes_in)):
            if ax:  # the batch entry of sizes computed from the input's shape is the trace batch
                sizes[ax] = s
    else:
        raise em.fail("Resize needs scales or sizes")
    if scales[0] != 1.0 or sizes[1] != size_in[1] or scales[1] != 1.0:
        raise em.fail("Resize may only change the spatial dims (scale 1 on batch and channels)")
    if mode == "linear" and at.get("exclude_outside", 0):
        raise em.fail("Resize with exclude_outside=1 is not supported")
    attrs = {"size": sizes[2:], "mode": mode, "coordinates": coordinates,
             "nearest_mode": at.get("nearest_mode", "round_prefer_floor")}
    if given_scales:
        attrs["scales"] = scales[2:]
    if sizes[2:] == size_in[2:] and (not given_scales or all(s == 1.0 for s in scales[2:])):
        return [x]  # every coordinate transformation maps a size kept at scale 1 onto itself
    groups = x.groups[:2] + tuple((s,) for s in sizes[2:])
    return [em.tensor("resize", [x], groups, **attrs)]


# ---------------------------------------------------------------- ConvTranspose


def _conv_transpose2d(em, ins, at, n):
    x = image_input(em, ins[0])
    w = float_tensor(em, ins[1], "weight")
    if w.rank != 4:
        raise em.fail("only 1-D and 2-D transposed convolution are supported")
    group = at.get("group", 1)
    out_c, kernel = w.ir_shape[1] * group, list(w.ir_shape[2:])
    strides, dil = list(at.get("strides", [1, 1])), list(at.get("dilations", [1, 1]))
    extra = list(at.get("output_padding", [0, 0]))
    size = [x.groups[2][0], x.groups[3][0]]
    full = [(size[i] - 1) * strides[i] + extra[i] + (kernel[i] - 1) * dil[i] + 1 for i in range(2)]
    auto = at.get("auto_pad", "NOTSET")
    if "output_shape" in at or auto in ("SAME_UPPER", "SAME_LOWER"):
        # ONNX: the pads come from the output shape (SAME: the input's times the stride)
        want = list(at["output_shape"])[-2:] if "output_shape" in at else [size[i] * strides[i] for i in range(2)]
        total = [full[i] - want[i] for i in range(2)]
        if min(total) < 0:
            raise em.fail(f"output_shape {want} is larger than the transposed convolution gives ({full})")
        small, large = [t // 2 for t in total], [t - t // 2 for t in total]
        begin, end = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        begin, end = [0, 0], [0, 0]
    else:
        p = list(at.get("pads", [0, 0, 0, 0]))
        begin, end = p[:2], p[2:]
    if min(begin + end) < 0:
        raise em.fail(f"negative pads {begin + end} are not supported")
    if any(extra[i] >= strides[i] for i in range(2)):
        raise em.fail(f"output_padding {extra} at or above the stride {strides} is not supported")
    # the IR crops `padding` on both sides and adds `output_padding` at the end: a smaller end
    # crop is more output padding while that stays below the stride; the rest is a slice
    even, cut = [], []
    for i in range(2):
        if begin[i] > end[i] and extra[i] + begin[i] - end[i] < strides[i]:
            even.append(begin[i])
            extra[i] += begin[i] - end[i]
            cut.append((0, 0))
        else:
            p = min(begin[i], end[i])
            even.append(p)
            cut.append((begin[i] - p, end[i] - p))
    args = [x, w]
    b = ins[2] if len(ins) > 2 else None
    if b is not None and not (isinstance(b, Folded) and b.const and not b.value.any()):
        args.append(float_tensor(em, b, "bias"))
    hw = [full[i] - begin[i] - end[i] for i in range(2)]
    if min(hw) < 1:
        raise em.fail(f"pads {begin + end} leave no output of the transposed convolution ({full})")
    attrs = {"stride": strides, "padding": even}
    if extra != [0, 0]:
        attrs["output_padding"] = extra
    if dil != [1, 1]:
        attrs["dilation"] = dil
    if group != 1:
        attrs["groups"] = group
    wide = [hw[i] + sum(cut[i]) for i in range(2)]
    y = em.tensor("conv_transpose2d", args, ((None,), (out_c,), (wide[0],), (wide[1],)), **attrs)
    if not any(sum(c) for c in cut):
        return [y]
    return [em.tensor("slice", [y], ((None,), (out_c,), (hw[0],), (hw[1],)), axes=[2, 3],
                      starts=[cut[0][0], cut[1][0]], ends=[wide[0] - cut[0][1], wide[1] - cut[1][1]])]


conv_transpose = with_one_dim(_conv_transpose2d, weighted=True)
