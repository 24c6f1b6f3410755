"""The IR-op -> ONNX table: one translation per op, each writing the node's value to ``s.out``.

A translation gets the writer and a ``Site`` (the IR node's ONNX input names, normalised
attributes and static types) and appends the ONNX nodes that compute the same inference
forward. Loss and metric ops have no entry: they are never on the path to the model output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpc_rlx.export.onnx_writer import OnnxWriter
from hpc_rlx.graph.shapes import TensorType, per_axis


@dataclass
class Site:
    name: str  # the IR node
    ins: list  # ONNX tensor names of its inputs
    out: str  # the ONNX tensor name its value must get
    attrs: dict  # normalised IR attributes
    in_types: list  # TensorType per input
    out_type: TensorType


TABLE: dict = {}


def onnx_op(*names):
    def register(fn):
        for name in names:
            TABLE[name] = fn
        return fn
    return register


def _same_op(op_type):
    """An IR op that is one ONNX op with the same inputs."""
    def translate(w: OnnxWriter, s: Site):
        w.add(op_type, s.ins, s.out)
    return translate


for _ir, _onnx in {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "matmul": "MatMul",
                   "relu": "Relu", "tanh": "Tanh", "sigmoid": "Sigmoid", "erf": "Erf", "neg": "Neg",
                   "sqrt": "Sqrt", "exp": "Exp", "log": "Log", "reciprocal": "Reciprocal",
                   "pow": "Pow"}.items():
    TABLE[_ir] = _same_op(_onnx)


@onnx_op("dropout")
def _dropout(w, s):
    w.add("Identity", s.ins[:1], s.out)  # inverted dropout is the identity at inference


@onnx_op("bernoulli")
def _bernoulli(w, s):
    w.add("Identity", s.ins[:1], s.out)  # a random mask at inference: its expectation, p


@onnx_op("random_like")
def _random_like(w, s):
    # at inference a draw is its expectation (hpc_rlx/graph/ops/random.py), shaped like the input
    a, b = s.attrs["a"], s.attrs["b"]
    mean = (a + b) / 2 if s.attrs["dist"] == "uniform" else a
    w.add("Expand", [w.const(np.float32(mean)), w.add("Shape", [s.ins[0]], base=s.name)], s.out)


@onnx_op("linear")
def _linear(w, s):
    x, weight = s.ins[0], s.ins[1]
    if s.attrs.get("weight_layout", "in_out") == "out_in":
        weight = w.add("Transpose", [weight], base=s.name, perm=[1, 0])
    if len(s.ins) == 2:
        w.add("MatMul", [x, weight], s.out)
    else:
        w.add("Add", [w.add("MatMul", [x, weight], base=s.name), s.ins[2]], s.out)


@onnx_op("bias_add")
def _bias_add(w, s):
    ndim = s.in_types[0].ndim
    axis = s.attrs["axis"] % ndim
    bias = s.ins[1]
    if axis != ndim - 1:
        bias = w.add("Reshape", [bias, w.ints([-1] + [1] * (ndim - 1 - axis))], base=s.name)
    w.add("Add", [s.ins[0], bias], s.out)


@onnx_op("scale")
def _scale(w, s):
    w.add("Mul", [s.ins[0], w.const(s.attrs["value"])], s.out)


@onnx_op("gelu")
def _gelu(w, s):
    x = s.ins[0]
    half_x = w.add("Mul", [x, w.const(0.5)], base=s.name)
    if s.attrs.get("approximate", "tanh") == "none":
        inner = w.add("Erf", [w.add("Mul", [x, w.const(1.0 / math.sqrt(2.0))], base=s.name)], base=s.name)
    else:  # tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = w.add("Mul", [w.add("Mul", [x, x], base=s.name), x], base=s.name)
        arg = w.add("Add", [x, w.add("Mul", [cube, w.const(0.044715)], base=s.name)], base=s.name)
        inner = w.add("Tanh", [w.add("Mul", [arg, w.const(math.sqrt(2.0 / math.pi))], base=s.name)], base=s.name)
    w.add("Mul", [half_x, w.add("Add", [inner, w.const(1.0)], base=s.name)], s.out)


@onnx_op("leaky_relu")
def _leaky_relu(w, s):
    w.add("LeakyRelu", s.ins, s.out, alpha=float(s.attrs.get("alpha", 0.01)))


@onnx_op("clip")
def _clip(w, s):
    lo, hi = s.attrs.get("min"), s.attrs.get("max")
    w.add("Clip", [s.ins[0], "" if lo is None else w.const(lo), "" if hi is None else w.const(hi)], s.out)


@onnx_op("where")
def _where(w, s):
    # IR: nonzero = true, whatever the condition's dtype
    cond = w.add("Cast", [s.ins[0]], base=s.name, to=w.onnx.TensorProto.BOOL)
    w.add("Where", [cond, s.ins[1], s.ins[2]], s.out)


@onnx_op("cast")
def _cast(w, s):
    to = w.onnx.TensorProto.INT64 if s.attrs["to"] == "int64" else w.onnx.TensorProto.FLOAT
    w.add("Cast", s.ins, s.out, to=to)


@onnx_op("constant")
def _constant(w, s):
    dtype = np.int64 if s.attrs.get("dtype", "float") == "int64" else np.float32
    value = np.asarray(s.attrs["value"], dtype=dtype).reshape(s.attrs["shape"])
    w.add("Identity", [w.const(value, dtype)], s.out)


@onnx_op("concat")
def _concat(w, s):
    w.add("Concat", s.ins, s.out, axis=int(s.attrs["axis"]))


@onnx_op("slice")
def _slice(w, s):
    a = s.attrs
    steps = a.get("steps") or [1] * len(a["axes"])
    w.add("Slice", [s.ins[0], w.ints(a["starts"]), w.ints(a["ends"]), w.ints(a["axes"]), w.ints(steps)], s.out)


@onnx_op("gather")
def _gather(w, s):
    w.add("Gather", s.ins, s.out, axis=int(s.attrs.get("axis", 0)))


@onnx_op("expand")
def _expand(w, s):
    # a null lines up with the input's batch dim: 1 keeps that dim under ONNX's broadcasting
    w.add("Expand", [s.ins[0], w.ints([1 if d is None else d for d in s.attrs["shape"]])], s.out)


@onnx_op("conv2d")
def _conv2d(w, s):
    kernel = list(s.in_types[1].shape[2:])
    nd = len(kernel)
    pads = list(per_axis(s.attrs["padding"], nd, "padding"))
    w.add("Conv", s.ins, s.out, kernel_shape=kernel, strides=list(per_axis(s.attrs["stride"], nd, "stride")),
          pads=pads + pads, dilations=list(per_axis(s.attrs.get("dilation", 1), nd, "dilation")),
          group=int(s.attrs.get("groups", 1)))


def _pool_attrs(s) -> dict:
    nd = s.in_types[0].ndim - 2
    pads = list(per_axis(s.attrs["padding"], nd, "padding"))
    return {"kernel_shape": list(per_axis(s.attrs["kernel"], nd, "kernel")),
            "strides": list(per_axis(s.attrs["stride"] or s.attrs["kernel"], nd, "stride")), "pads": pads + pads}


@onnx_op("max_pool2d")
def _max_pool2d(w, s):
    extra = {}
    dilation = per_axis(s.attrs.get("dilation", 1), s.in_types[0].ndim - 2, "dilation")
    if any(d != 1 for d in dilation):
        extra["dilations"] = list(dilation)
    w.add("MaxPool", s.ins, s.out, **_pool_attrs(s), **extra)


@onnx_op("avg_pool2d")
def _avg_pool2d(w, s):
    w.add("AveragePool", s.ins, s.out, **_pool_attrs(s),
          count_include_pad=int(bool(s.attrs.get("count_include_pad", True))))


@onnx_op("flatten")
def _flatten(w, s):
    w.add("Flatten", s.ins, s.out, axis=1)


@onnx_op("reshape")
def _reshape(w, s):
    # 0 copies the input's dim at the same position: the batch stays the batch
    w.add("Reshape", [s.ins[0], w.ints([0 if d is None else d for d in s.attrs["shape"]])], s.out)


@onnx_op("transpose")
def _transpose(w, s):
    w.add("Transpose", s.ins, s.out, perm=list(s.attrs["axes"]))


@onnx_op("sum")
def _sum(w, s):
    axes = s.attrs["axes"]
    ins = s.ins if axes is None else [s.ins[0], w.ints(axes)]
    w.add("ReduceSum", ins, s.out, keepdims=int(s.attrs["keepdims"]))


@onnx_op("mean")
def _mean(w, s):
    extra = {} if s.attrs["axes"] is None else {"axes": list(s.attrs["axes"])}  # an attribute up to opset 17
    w.add("ReduceMean", s.ins, s.out, keepdims=int(s.attrs["keepdims"]), **extra)


@onnx_op("embedding")
def _embedding(w, s):
    w.add("Gather", [s.ins[1], s.ins[0]], s.out, axis=0)


@onnx_op("layer_norm")
def _layer_norm(w, s):
    w.add("LayerNormalization", s.ins, s.out, axis=-int(s.attrs.get("trailing_axes", 1)),
          epsilon=float(s.attrs["eps"]))


@onnx_op("batch_norm")
def _batch_norm(w, s):
    # inference form: normalise with the running statistics
    w.add("BatchNormalization", s.ins, s.out, epsilon=float(s.attrs.get("eps", 1e-5)), training_mode=0)


@onnx_op("softmax")
def _softmax(w, s):
    w.add("Softmax", s.ins, s.out, axis=int(s.attrs["axis"]))


@onnx_op("log_softmax")
def _log_softmax(w, s):
    w.add("LogSoftmax", s.ins, s.out, axis=int(s.attrs.get("axis", -1)))


@onnx_op("causal_mask")
def _causal_mask(w, s):
    t = s.in_types[0].shape[-1]
    hidden = w.const(np.triu(np.ones((t, t), dtype=bool), 1), np.bool_)  # keys after the query
    w.add("Where", [hidden, w.const(s.attrs["fill"]), s.ins[0]], s.out)
