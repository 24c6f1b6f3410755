"""ONNX -> IR for the network layers: convolution, pooling, normalisation and dropout (see
``map_math`` for the mapping convention).

Conv, MaxPool and AveragePool take images (rank 4) and volumes (rank 5, the 3-D layers) to
the same IR ops, which work over either spatial rank; 1-D signals (rank 3) become (B, C, 1, L)
images. LayerNormalization normalises over every axis from ``axis`` on; InstanceNormalization
(PyTorch's GroupNorm and InstanceNorm) over every axis from 2 on, per sample and channel.

Batch norm and dropout come in two forms. A training-form export (TorchScript with
``training=TrainingMode.TRAINING``) marks them: BatchNormalization ``training_mode=1``, Dropout
with a true ``training_mode`` input. The dynamo exporter writes a training batch norm as a
plain BatchNormalization node but records the PyTorch call in the node's metadata
(``_native_batch_norm_legit_functional(..., True, momentum, eps)``), which is read here.
(Before opset 14 a training BatchNormalization is one with its statistics outputs.) ONNX's
``momentum`` is the weight of the old running value (PyTorch's is 1 minus it).
"""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.graph.onnx.emit import Tensor, decimal32, folded_scalar, single
from hpc_rlx.graph.onnx.fold import Folded
from hpc_rlx.graph.onnx.map_math import float_tensor
from hpc_rlx.graph.onnx.params import fx_batch_norm


def torch_momentum(onnx_momentum: float) -> float:
    """PyTorch's momentum (the weight of the new statistic) from ONNX's (of the old value)."""
    for digits in range(1, 10):
        d = round(1.0 - onnx_momentum, digits)
        if np.float32(1.0 - d) == np.float32(onnx_momentum):
            return d
    return 1.0 - float(onnx_momentum)


def image_input(em, v, what="input", volumes=False) -> Tensor:
    """A (B, C, H, W) tensor with the batch first (with ``volumes``, also (B, C, D, H, W))."""
    x = float_tensor(em, v, what)
    ranks = (4, 5) if volumes else (4,)
    if x.rank not in ranks or x.groups[0] != (None,) or not all(x.plain(i) for i in range(1, x.rank)):
        shapes = "(batch, C, L), (batch, C, H, W) or (batch, C, D, H, W)" if volumes else \
            "(batch, C, L) or (batch, C, H, W)"
        raise em.fail(f"{what} must be {shapes}, got ONNX rank {x.rank}")
    return x


def _pad_ends(at, size, kernel, strides, dilations) -> tuple[list, list]:
    """Padding before and after each spatial axis, from ``pads`` or ``auto_pad``. SAME_UPPER
    puts an odd one at the end (TensorFlow's and PyTorch's 'same': a k=2 kernel pads 0, 1)."""
    nd = len(size)
    auto = at.get("auto_pad", "NOTSET")
    if auto == "VALID":
        return [0] * nd, [0] * nd
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, k, s, d in zip(size, kernel, strides, dilations):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if auto == "SAME_UPPER" else large)
            end.append(large if auto == "SAME_UPPER" else small)
        return begin, end
    p = list(at.get("pads", [0] * (2 * nd)))
    return p[:nd], p[nd:]


def _pads(em, at, size, kernel, strides, dilations) -> list:
    """Symmetric padding per spatial axis (pooling's IR form: uneven pads are refused)."""
    begin, end = _pad_ends(at, size, kernel, strides, dilations)
    if begin != end:
        auto = at.get("auto_pad", "NOTSET")
        how = f"auto_pad={auto}" if auto != "NOTSET" else f"pads {begin + end}"
        raise em.fail(f"uneven padding ({how}: begin != end) is not supported for pooling")
    return begin


def _evened(em, x, begin, end) -> tuple:
    """``x`` with the uneven part of the padding (begin != end) written as zeros by an explicit
    ``pad``, and the symmetric rest, which the convolution pads itself. Zero padding is zeros
    wherever it is added, so this is the convolution with the uneven pads exactly."""
    even = [min(b, e) for b, e in zip(begin, end)]
    extra_b, extra_e = [b - p for b, p in zip(begin, even)], [e - p for e, p in zip(end, even)]
    if not any(extra_b + extra_e):
        return x, even
    if min(even) < 0:
        raise em.fail(f"negative pads {begin + end} are not supported")
    nd = len(begin)
    groups = x.groups[:2] + tuple((x.groups[2 + i][0] + extra_b[i] + extra_e[i],) for i in range(nd))
    padded = em.tensor("pad", [x], groups, pads=[0, 0] + extra_b + [0, 0] + extra_e, mode="constant", value=0.0)
    return padded, even


def _out_size(n, k, s, p, d, ceil_mode=False) -> int:
    span = n + 2 * p - d * (k - 1) - 1
    return (-(-span // s) if ceil_mode else span // s) + 1


def with_one_dim(emit, weighted: bool = False):
    """``emit`` for 2-D images, also taking 1-D signals (B, C, L) as (B, C, 1, L) images (and
    a ``weighted`` op's (O, C, k) kernel as (O, C, 1, k))."""

    def run(em, ins, at, n):
        x = float_tensor(em, ins[0])
        if x.rank != 3:
            return emit(em, ins, at, n)

        def lift(t):
            return em.reshape(t, t.groups[:2] + ((1,),) + t.groups[2:])

        ins = [lift(x)] + list(ins[1:])
        if weighted:
            ins[1] = lift(float_tensor(em, ins[1], "weight"))
        lifted = {"kernel_shape": 1, "strides": 1, "dilations": 1, "output_padding": 0, "output_shape": 1}
        at = {**at, **{k: [first] + list(at[k]) for k, first in lifted.items() if k in at}}
        if "pads" in at:
            at["pads"] = [0, at["pads"][0], 0, at["pads"][1]]
        outs = emit(em, ins, at, n)
        y = outs[0]
        return [em.reshape(y, y.groups[:2] + y.groups[3:])] + outs[1:]

    return run


def _conv2d(em, ins, at, n):
    """2-D and 3-D convolution: the IR's conv2d takes images and volumes alike."""
    x = image_input(em, ins[0], volumes=True)
    w = float_tensor(em, ins[1], "weight")
    if w.rank != x.rank:
        raise em.fail("only 1-D, 2-D and 3-D convolution are supported")
    nd = x.rank - 2
    out_c, kernel = w.ir_shape[0], list(w.ir_shape[2:])
    strides, dil = list(at.get("strides", [1] * nd)), list(at.get("dilations", [1] * nd))
    size = [x.groups[i][0] for i in range(2, x.rank)]
    begin, end = _pad_ends(at, size, kernel, strides, dil)
    x, pads = _evened(em, x, begin, end)
    size = [x.groups[i][0] for i in range(2, x.rank)]
    args = [x, w]
    b = ins[2] if len(ins) > 2 else None
    if b is not None and not (isinstance(b, Folded) and b.const and not b.value.any()):  # a zero bias is none
        args.append(float_tensor(em, b, "bias"))
    out = [_out_size(size[i], kernel[i], strides[i], pads[i], dil[i]) for i in range(nd)]
    attrs = {"stride": strides, "padding": pads}
    if dil != [1] * nd:
        attrs["dilation"] = dil
    if at.get("group", 1) != 1:
        attrs["groups"] = at["group"]
    return [em.tensor("conv2d", args, ((None,), (out_c,)) + tuple((d,) for d in out), **attrs)]


conv = with_one_dim(_conv2d, weighted=True)


def _pool(op: str):
    """2-D and 3-D pooling (the IR's pool ops take images and volumes alike)."""
    def emit(em, ins, at, n):
        x = image_input(em, ins[0], volumes=True)
        nd = x.rank - 2
        kernel = list(at["kernel_shape"])
        strides, dil = list(at.get("strides", [1] * nd)), list(at.get("dilations", [1] * nd))
        size = [x.groups[i][0] for i in range(2, x.rank)]
        pads = _pads(em, at, size, kernel, strides, dil)
        out = [_out_size(size[i], kernel[i], strides[i], pads[i], dil[i]) for i in range(nd)]
        if at.get("ceil_mode", 0) and out != [_out_size(size[i], kernel[i], strides[i], pads[i], dil[i], True)
                                               for i in range(nd)]:
            raise em.fail("ceil_mode=1 that changes the output size is not supported")
        attrs = {"kernel": kernel, "stride": strides, "padding": pads}
        if dil != [1] * nd:
            if op != "max_pool2d":
                raise em.fail("dilated average pooling is not supported")
            attrs["dilation"] = dil
        if op == "avg_pool2d" and any(pads):
            attrs["count_include_pad"] = bool(at.get("count_include_pad", 0))
        y = em.tensor(op, [x], ((None,), x.groups[1]) + tuple((d,) for d in out), **attrs)
        return [y] + [None] * (n - 1)

    return emit


max_pool = with_one_dim(_pool("max_pool2d"))
average_pool = with_one_dim(_pool("avg_pool2d"))


def global_average_pool(em, ins, at, n):
    x = float_tensor(em, ins[0])
    if x.rank < 3 or x.batch_axis not in (0, None) or not all(x.plain(i) for i in range(1, x.rank)):
        raise em.fail("GlobalAveragePool needs (batch, C, spatial...)")
    groups = x.groups[:2] + ((1,),) * (x.rank - 2)
    return [em.tensor("mean", [x], groups, axes=list(range(2, x.rank)), keepdims=True)]


def _rows_of_samples(x):
    """For a (B*k, C) input, the IR transposes to (B, C, k) and back; else None."""
    if x.rank != 2 or len(x.groups[0]) != 2 or None not in x.groups[0] or not x.plain(1):
        return None
    to_ir = [0, 2, 1] if x.groups[0][0] is None else [1, 2, 0]
    return to_ir, [int(i) for i in np.argsort(to_ir)]


def batch_norm(em, ins, at, n):
    x = float_tensor(em, ins[0])
    rows = _rows_of_samples(x)
    if rows is not None:
        # (B*k, C): each sample's k rows (timm LeViT's tokens, flattened into the batch) are
        # statistics rows like the batch's; the IR op takes them as a length axis: (B, C, k)
        to_ir, back = rows
        y, *rest = batch_norm(em, [em.tensor("transpose", [x], single(tuple(x.ir_shape[i] for i in to_ir)),
                                             axes=to_ir), *ins[1:]], at, n)
        return [em.tensor("transpose", [y], x.groups, axes=back)] + rest
    if x.rank < 2 or x.groups[0] != (None,) or not x.plain(1):
        raise em.fail("BatchNormalization needs (batch, C, ...) input")
    scale, bias = (float_tensor(em, v, what) for v, what in zip(ins[1:3], ("scale", "bias")))
    stats = ins[3:5]
    if not all(isinstance(v, Tensor) for v in stats):
        raise em.fail("the running mean and variance must be initializers")
    eps = decimal32(float(at.get("epsilon", 1e-5)))
    momentum = torch_momentum(float(at.get("momentum", 0.9)))
    # opset 14 added training_mode; before it a training batch norm has the statistics outputs
    training = bool(at.get("training_mode", 0)) or (em.opset < 14 and sum(1 for o in em.proto.output if o) > 1)
    recorded = fx_batch_norm(em.proto)
    if not training and recorded is not None and recorded[0]:
        training, momentum, eps = True, recorded[1], recorded[2]
    em.forms["bn_train" if training else "bn_frozen"].append(em.node)
    y = em.tensor("batch_norm", [x, scale, bias, *stats], x.groups, eps=eps, momentum=momentum, training=training)
    return [y] + [None] * (n - 1)


def layer_norm(em, ins, at, n):
    """Over the axes from ``axis`` on (PyTorch's ``normalized_shape`` of one or more dims):
    the IR op's ``trailing_axes``, with scale and bias of those axes' shape."""
    x = float_tensor(em, ins[0])
    axis = at.get("axis", -1) % x.rank
    axes = list(range(axis, x.rank))
    if not all(x.plain(i) for i in axes):
        raise em.fail(f"LayerNormalization over axes {axes}: each normalised axis must be one dimension "
                      "that is not the batch")
    dims = tuple(x.groups[i][0] for i in axes)
    scale = float_tensor(em, ins[1], "scale")
    bias = float_tensor(em, ins[2] if len(ins) > 2 and ins[2] is not None else Folded(np.zeros(dims, np.float32)))
    for t in (scale, bias):
        if t.ir_shape != dims:
            raise em.fail(f"scale and bias must be {dims}, got {t.ir_shape}")
    eps = decimal32(float(at.get("epsilon", 1e-5)))
    attrs = {"eps": eps} if len(axes) == 1 else {"eps": eps, "trailing_axes": len(axes)}
    return [em.tensor("layer_norm", [x, scale, bias], x.groups, **attrs)] + [None] * (n - 1)


def instance_norm(em, ins, at, n):
    """Per sample and channel over the spatial dims, then scale and bias per channel: both
    exporters write nn.GroupNorm as this over (B, groups, rest), scale 1 and bias 0, between
    two reshapes, with the module's affine after."""
    x = float_tensor(em, ins[0])
    if x.rank < 3 or x.groups[0] != (None,) or not x.plain(1) or any(None in g for g in x.groups[2:]):
        raise em.fail(f"InstanceNormalization of dims {x.groups}: it needs (batch, channels, spatial...) "
                      f"with the batch first and on its own")
    channels = x.groups[1][0]
    scale, bias = (float_tensor(em, v, what) for v, what in zip(ins[1:3], ("scale", "bias")))
    for t in (scale, bias):
        if t.ir_shape != (channels,):
            raise em.fail(f"scale and bias must be ({channels},), got {t.ir_shape}")
    return [em.tensor("instance_norm", [x, scale, bias], x.groups, eps=decimal32(float(at.get("epsilon", 1e-5))))]


def dropout(em, ins, at, n):
    x = ins[0]
    ratio = 0.5 if len(ins) < 2 or ins[1] is None else decimal32(float(folded_scalar(ins[1], "Dropout's ratio", em)))
    training = False if len(ins) < 3 or ins[2] is None else bool(folded_scalar(ins[2], "Dropout's training_mode", em))
    if training and ratio > 0:
        em.forms["dropout"].append(em.node)
        x = float_tensor(em, x)
        return [em.tensor("dropout", [x], x.groups, p=ratio)] + [None] * (n - 1)
    if not training:
        em.forms["dropout_off"].append(em.node)
    return [x] + [None] * (n - 1)
