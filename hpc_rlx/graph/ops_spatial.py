"""Convolution and pooling ops: type rules and forwards (see ``ops`` for the conventions)."""

from __future__ import annotations

from hpc_rlx.graph import conv
from hpc_rlx.graph.registry import REQUIRED, defop
from hpc_rlx.graph.shapes import (
    FLOAT,
    ShapeError,
    TensorType,
    fmt_shape,
    pair,
    require_float,
    require_ndim,
)

# ---------------------------------------------------------------- convolution and pooling

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
    ho = conv.out_size(x.shape[2], w.shape[2], a["stride"][0], a["padding"][0], a["dilation"][0])
    wo = conv.out_size(x.shape[3], w.shape[3], a["stride"][1], a["padding"][1], a["dilation"][1])
    if ho < 1 or wo < 1:
        raise ShapeError(f"kernel {w.shape[2:]} does not fit input {fmt_shape(x.shape)} with the given padding")
    return TensorType((x.shape[0], w.shape[0], ho, wo), FLOAT)


@defop("conv2d", _conv_type, (2, 3), attrs={"stride": 1, "padding": 0, "dilation": 1, "groups": 1},
       check=_conv_check, arg_names=("x", "weight", "bias"))
def conv2d(xp, args, a, ctx):
    b = args[2] if len(args) == 3 else None
    out, cols = conv.conv2d_forward(xp, args[0], args[1], b, a["stride"], a["padding"], a["dilation"], a["groups"])
    return out, ((cols, args[0].shape) if ctx.need_saved else None)


def _pool_check(a):
    k = pair(a["kernel"], "kernel")
    s = k if a["stride"] is None else pair(a["stride"], "stride")
    p = pair(a["padding"], "padding")
    if min(k) < 1 or min(s) < 1 or min(p) < 0 or p[0] * 2 > k[0] or p[1] * 2 > k[1]:
        raise ShapeError(f"need kernel >= 1, stride >= 1, 0 <= padding <= kernel/2; got kernel={k} stride={s} padding={p}")
    return {"kernel": k, "stride": s, "padding": p}


def _max_pool_check(a):
    d = pair(a["dilation"], "dilation")
    if min(d) < 1:
        raise ShapeError(f"attribute 'dilation' must be >= 1, got {a['dilation']!r}")
    return {**_pool_check(a), "dilation": d}


def _avg_pool_check(a):
    if not isinstance(a["count_include_pad"], bool):
        raise ShapeError(f"attribute 'count_include_pad' must be true or false, got {a['count_include_pad']!r}")
    return {**_pool_check(a), "count_include_pad": a["count_include_pad"]}


def _pool_type(types, a):
    x = types[0]
    require_float(x, "input")
    require_ndim(x, 4, "input (B, C, H, W)")
    if None in x.shape[1:]:
        raise ShapeError("only the batch dim may be unknown")
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    dh, dw = a.get("dilation", (1, 1))
    ho, wo = conv.out_size(x.shape[2], kh, sh, ph, dh), conv.out_size(x.shape[3], kw, sw, pw, dw)
    if ho < 1 or wo < 1:
        raise ShapeError(f"pool window {a['kernel']} does not fit input {fmt_shape(x.shape)}")
    return TensorType((x.shape[0], x.shape[1], ho, wo), FLOAT)


_POOL_ATTRS = {"kernel": REQUIRED, "stride": None, "padding": 0}


@defop("max_pool2d", _pool_type, (1, 1), attrs={**_POOL_ATTRS, "dilation": 1}, check=_max_pool_check)
def max_pool2d(xp, args, a, ctx):
    out, index = conv.max_pool_forward(xp, args[0], a["kernel"], a["stride"], a["padding"], ctx.need_saved,
                                       a["dilation"])
    return out, ((index, args[0].shape) if ctx.need_saved else None)


@defop("avg_pool2d", _pool_type, (1, 1), attrs={**_POOL_ATTRS, "count_include_pad": True}, check=_avg_pool_check)
def avg_pool2d(xp, args, a, ctx):
    out = conv.avg_pool_forward(xp, args[0], a["kernel"], a["stride"], a["padding"], a["count_include_pad"])
    return out, (args[0].shape if ctx.need_saved else None)
