"""ONNX -> IR for the network layers: convolution, pooling, normalisation and dropout (see
``map_math`` for the mapping convention).

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

from hpc_rlx.graph.onnx.emit import Tensor, decimal32, folded_scalar
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


def _image(em, v, what="input") -> Tensor:
    """A (B, C, H, W) tensor with the batch first."""
    x = float_tensor(em, v, what)
    if x.rank != 4 or x.groups[0] != (None,) or not all(x.plain(i) for i in (1, 2, 3)):
        raise em.fail(f"{what} must be (batch, C, L) or (batch, C, H, W), got ONNX rank {x.rank}")
    return x


def _pads(em, at, size, kernel, strides, dilations) -> list:
    """Symmetric [top/bottom, left/right] padding from ``pads`` or ``auto_pad``."""
    auto = at.get("auto_pad", "NOTSET")
    if auto == "VALID":
        return [0, 0]
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for n, k, s, d in zip(size, kernel, strides, dilations):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            if total % 2:
                raise em.fail(f"auto_pad={auto} needs uneven padding ({total} in all), which the IR lacks")
            pads.append(total // 2)
        return pads
    p = list(at.get("pads", [0, 0, 0, 0]))
    if p[0] != p[2] or p[1] != p[3]:
        raise em.fail(f"uneven padding {p} (begin != end) is not supported")
    return [p[0], p[1]]


def _out_size(n, k, s, p, d, ceil_mode=False) -> int:
    span = n + 2 * p - d * (k - 1) - 1
    return (-(-span // s) if ceil_mode else span // s) + 1


def _with_one_dim(emit, weighted: bool = False):
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
    x = _image(em, ins[0])
    w = float_tensor(em, ins[1], "weight")
    if w.rank != 4:
        raise em.fail("only 1-D and 2-D convolution are supported")
    out_c, kernel = w.ir_shape[0], list(w.ir_shape[2:])
    strides, dil = list(at.get("strides", [1, 1])), list(at.get("dilations", [1, 1]))
    size = [x.groups[2][0], x.groups[3][0]]
    pads = _pads(em, at, size, kernel, strides, dil)
    args = [x, w]
    b = ins[2] if len(ins) > 2 else None
    if b is not None and not (isinstance(b, Folded) and b.const and not b.value.any()):  # a zero bias is none
        args.append(float_tensor(em, b, "bias"))
    hw = [_out_size(size[i], kernel[i], strides[i], pads[i], dil[i]) for i in range(2)]
    attrs = {"stride": strides, "padding": pads}
    if dil != [1, 1]:
        attrs["dilation"] = dil
    if at.get("group", 1) != 1:
        attrs["groups"] = at["group"]
    return [em.tensor("conv2d", args, ((None,), (out_c,), (hw[0],), (hw[1],)), **attrs)]


conv = _with_one_dim(_conv2d, weighted=True)


def _pool(op: str):
    def emit(em, ins, at, n):
        x = _image(em, ins[0])
        kernel = list(at["kernel_shape"])
        strides, dil = list(at.get("strides", [1, 1])), list(at.get("dilations", [1, 1]))
        size = [x.groups[2][0], x.groups[3][0]]
        pads = _pads(em, at, size, kernel, strides, dil)
        hw = [_out_size(size[i], kernel[i], strides[i], pads[i], dil[i]) for i in range(2)]
        if at.get("ceil_mode", 0) and hw != [_out_size(size[i], kernel[i], strides[i], pads[i], dil[i], True)
                                              for i in range(2)]:
            raise em.fail("ceil_mode=1 that changes the output size is not supported")
        attrs = {"kernel": kernel, "stride": strides, "padding": pads}
        if dil != [1, 1]:
            if op != "max_pool2d":
                raise em.fail("dilated average pooling is not supported")
            attrs["dilation"] = dil
        if op == "avg_pool2d" and any(pads):
            attrs["count_include_pad"] = bool(at.get("count_include_pad", 0))
        y = em.tensor(op, [x], ((None,), x.groups[1], (hw[0],), (hw[1],)), **attrs)
        return [y] + [None] * (n - 1)

    return emit


max_pool = _with_one_dim(_pool("max_pool2d"))
average_pool = _with_one_dim(_pool("avg_pool2d"))


def global_average_pool(em, ins, at, n):
    x = float_tensor(em, ins[0])
    if x.rank < 3 or x.batch_axis not in (0, None) or not all(x.plain(i) for i in range(1, x.rank)):
        raise em.fail("GlobalAveragePool needs (batch, C, spatial...)")
    groups = x.groups[:2] + ((1,),) * (x.rank - 2)
    return [em.tensor("mean", [x], groups, axes=list(range(2, x.rank)), keepdims=True)]


def batch_norm(em, ins, at, n):
    x = float_tensor(em, ins[0])
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
    x = float_tensor(em, ins[0])
    axis = at.get("axis", -1) % x.rank
    if axis != x.rank - 1 or not x.plain(axis):
        raise em.fail(f"LayerNormalization over axes {list(range(axis, x.rank))}: only the last axis is supported")
    d = x.groups[-1][0]
    scale = float_tensor(em, ins[1], "scale")
    bias = float_tensor(em, ins[2] if len(ins) > 2 and ins[2] is not None else Folded(np.zeros(d, np.float32)))
    for t in (scale, bias):
        if t.ir_shape != (d,):
            raise em.fail(f"scale and bias must be ({d},), got {t.ir_shape}")
    eps = decimal32(float(at.get("epsilon", 1e-5)))
    return [em.tensor("layer_norm", [x, scale, bias], x.groups, eps=eps)] + [None] * (n - 1)


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
