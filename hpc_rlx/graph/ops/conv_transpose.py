"""``conv_transpose2d``: the adjoint of ``conv2d`` in its input, built from conv's kernels
(conventions in ``hpc_rlx.graph.ops``).

A transposed convolution of x with weight W (C_in, C_out / groups, kh, kw) is the input
cotangent of the convolution that maps a (C_out, Ho, Wo) image to x's (C_in, H, W) with the
same W read as (O = C_in, C / groups = C_out / groups, kh, kw): ``conv2d_grad_x`` is the
forward. So its VJPs are the convolution itself: the input's is ``conv2d`` of the output
cotangent with W, the weight's is conv's weight gradient with x as the cotangent and the output
cotangent's im2col columns.

``output_padding`` adds rows and columns at the bottom and right that only the bias reaches;
it must be below the stride (each of conv's input rows then stays inside some window grid).
"""

from __future__ import annotations

from hpc_rlx.graph.ops.conv import conv2d_forward, conv2d_grad_b, conv2d_grad_w, conv2d_grad_x, im2col
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType, fmt_shape, pair, require_float, require_ndim


def transposed_size(n, k, s, p, d, output_padding) -> int:
    return (n - 1) * s - 2 * p + d * (k - 1) + output_padding + 1


def _check(a):
    s, p = pair(a["stride"], "stride"), pair(a["padding"], "padding")
    d, op = pair(a["dilation"], "dilation"), pair(a["output_padding"], "output_padding")
    groups = a["groups"]
    if min(s) < 1 or min(p) < 0 or min(d) < 1 or min(op) < 0:
        raise ShapeError(f"stride and dilation must be >= 1, padding and output_padding >= 0, got stride={a['stride']} "
                         f"padding={a['padding']} dilation={a['dilation']} output_padding={a['output_padding']}")
    if op[0] >= s[0] or op[1] >= s[1]:
        raise ShapeError(f"output_padding {list(op)} must be below the stride {list(s)}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ShapeError(f"attribute 'groups' must be a positive int, got {groups!r}")
    return {"stride": s, "padding": p, "dilation": d, "output_padding": op, "groups": groups}


def _type(types, a):
    x, w = types[0], types[1]
    require_float(x, "input")
    require_float(w, "weight")
    require_ndim(x, 4, "input (B, C, H, W)")
    require_ndim(w, 4, "weight (C_in, C_out / groups, kh, kw)")
    if None in x.shape[1:] or None in w.shape:
        raise ShapeError("only the batch dim may be unknown")
    groups = a["groups"]
    if x.shape[1] != w.shape[0]:
        raise ShapeError(f"input has {x.shape[1]} channels but weight {fmt_shape(w.shape)} expects {w.shape[0]}")
    if w.shape[0] % groups:
        raise ShapeError(f"{w.shape[0]} input channels do not split into {groups} groups")
    out_c = w.shape[1] * groups
    if len(types) == 3:
        require_float(types[2], "bias")
        if types[2].shape != (out_c,):
            raise ShapeError(f"bias shape {fmt_shape(types[2].shape)} must be ({out_c},)")
    hw = [transposed_size(x.shape[2 + i], w.shape[2 + i], a["stride"][i], a["padding"][i], a["dilation"][i],
                          a["output_padding"][i]) for i in range(2)]
    if min(hw) < 1:
        raise ShapeError(f"padding {list(a['padding'])} leaves no output for input {fmt_shape(x.shape)} "
                         f"and kernel {w.shape[2:]}")
    return TensorType((x.shape[0], out_c, hw[0], hw[1]), FLOAT)


def _out_shape(x_shape, w_shape, a):
    hw = [transposed_size(x_shape[2 + i], w_shape[2 + i], a["stride"][i], a["padding"][i], a["dilation"][i],
                          a["output_padding"][i]) for i in range(2)]
    return (x_shape[0], w_shape[1] * a["groups"], hw[0], hw[1])


@defop("conv_transpose2d", _type, (2, 3),
       attrs={"stride": 1, "padding": 0, "output_padding": 0, "dilation": 1, "groups": 1},
       check=_check, arg_names=("x", "weight", "bias"))
def conv_transpose2d(xp, args, a, ctx):
    x, w = args[0], args[1]
    y = conv2d_grad_x(xp, x, w, _out_shape(x.shape, w.shape, a), a["stride"], a["padding"], a["dilation"],
                      a["groups"])
    if len(args) == 3:
        y += args[2].reshape(-1, 1, 1)
    return y, None


def _x(xp, g, args, ans, saved, a, out):
    return conv2d_forward(xp, g, args[1], None, a["stride"], a["padding"], a["dilation"], a["groups"])[0]


def _w(xp, g, args, ans, saved, a, out):
    w = args[1]
    cols = im2col(xp, g, w.shape[2:], a["stride"], a["padding"], a["dilation"])[0]
    return conv2d_grad_w(xp, args[0], cols, w.shape, out, a["groups"])


def _b(xp, g, args, ans, saved, a, out):
    return conv2d_grad_b(xp, g, out)


defvjp("conv_transpose2d", _x, _w, _b, needs_args=(0, 1))
