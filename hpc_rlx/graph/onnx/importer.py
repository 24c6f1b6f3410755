"""Import an ONNX file (opsets 13 and newer, as PyTorch's exporters write them) as a trainable
IR graph.

    from hpc_rlx.graph.onnx.importer import import_onnx
    imported = import_onnx("model.onnx")            # or the file's bytes
    imported.graph      # a Graph with inputs x (the model input) and y (the labels), a loss head
    imported.initial    # {IR parameter or buffer name: float64 value}
    imported.warnings   # what the import could not keep as the file says (see below)

The walk visits the ONNX nodes in order. Every op type has one entry in ``ONNX_OPS``, its only
home: a NumPy evaluator (``fold``) used when all of a node's inputs are known without the
data (constants, and shapes: the batch size enters as two trace sizes), and a mapping to IR ops
(``map_*``) used otherwise. The batch dimension of the model input is the IR's batch (null); other dimensions
must be static.

``graph.meta["onnx"]``: ``opset``, ``exporter`` ("dynamo", "torchscript" or "other"),
``form`` ("training": batch norm and dropout train as in module.train(); "inference": some
were exported in eval mode and stay frozen), ``input`` / ``output`` (the ONNX names of the model
input and output), ``output_node`` (the IR node holding the model output), ``params`` ({IR
parameter: the initializer holding it}), ``transposed`` ({IR parameter: PyTorch name} for those
whose initializer holds the transpose), ``tied`` ({initializer: IR parameter} for initializers
that are a transposed copy of a parameter stored elsewhere too), ``torch_names`` ({IR
parameter: PyTorch state-dict name} where the file says it), ``slices`` ({IR parameter: the
PyTorch parameter it is a part of}, folded by dynamo's optimizer), ``aliases`` ({PyTorch name:
the IR parameter it is tied to}), ``removed`` (PyTorch parameters the optimizer dropped) and,
for a model that draws random values, ``expectations`` ({ONNX tensor: its value at inference}:
map_random).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.onnx import fold as f
from hpc_rlx.graph.onnx import loss as loss_head
from hpc_rlx.graph.onnx import map_index as ix
from hpc_rlx.graph.onnx import map_math as m
from hpc_rlx.graph.onnx.packed_inputs import pack_inputs, packed_layout
from hpc_rlx.graph.onnx import map_nn as nn
from hpc_rlx.graph.onnx import map_random as r
from hpc_rlx.graph.onnx import map_recurrent as rc
from hpc_rlx.graph.onnx import map_resample as rs
from hpc_rlx.graph.onnx import map_rows as rows
from hpc_rlx.graph.onnx import map_shape as s
from hpc_rlx.graph.ir import Graph
from hpc_rlx.graph.onnx.emit import Emitter, Tensor, dims_at, sanitise
from hpc_rlx.graph.onnx.fold import TRACE_BATCHES, Folded, FoldError, evaluate
from hpc_rlx.graph.onnx.params import exporter_of, load_model, opset_of, plan_initializers, record_folded
from hpc_rlx.graph.onnx.refusals import unsupported_error
from hpc_rlx.graph.onnx.untie import untie_merged_initializers
from hpc_rlx.graph.shapes import FLOAT, INT


@dataclass(frozen=True)
class Rule:
    """How one ONNX op type is imported: ``fold`` evaluates it on folded inputs, ``emit``
    writes IR nodes for it (None: the op is only supported on constants and shapes)."""

    fold: object = None
    emit: object = None


ONNX_OPS = {
    # arithmetic and activations
    "Add": Rule(f.binary(np.add), m.binary("add")),
    "Sub": Rule(f.binary(np.subtract), m.binary("sub")),
    "Mul": Rule(f.binary(np.multiply), m.binary("mul")),
    "Div": Rule(f.binary(f.div), m.binary("div")),
    "Pow": Rule(f.binary(f.pow_), m.binary("pow")),
    "Sqrt": Rule(f.unary(np.sqrt), m.unary("sqrt")),
    "Neg": Rule(f.unary(np.negative), m.unary("neg")),
    "Exp": Rule(f.unary(np.exp), m.unary("exp")),
    "Log": Rule(f.unary(np.log), m.unary("log")),
    "Reciprocal": Rule(f.unary(np.reciprocal), m.unary("reciprocal")),
    "Relu": Rule(f.relu, m.unary("relu")),
    "LeakyRelu": Rule(None, m.leaky_relu),
    "Sigmoid": Rule(f.sigmoid, m.unary("sigmoid")),
    "Tanh": Rule(f.unary(np.tanh), m.unary("tanh")),
    "Cos": Rule(f.unary(np.cos), m.unary("cos")),
    "Sin": Rule(f.unary(np.sin), m.unary("sin")),
    "HardSigmoid": Rule(f.hard_sigmoid, m.hard_sigmoid),
    "HardSwish": Rule(f.hard_swish, m.unary("hard_swish")),
    "Gelu": Rule(None, m.gelu),
    "Erf": Rule(f.erf, m.unary("erf")),
    "Sign": Rule(f.unary(np.sign), m.sign),
    "Softmax": Rule(None, m.softmax("softmax")),
    "LogSoftmax": Rule(None, m.softmax("log_softmax")),
    "Clip": Rule(f.clip, m.clip),
    "Where": Rule(f.where, m.where),
    "Cast": Rule(f.cast, m.cast),
    "CastLike": Rule(f.cast_like, m.cast_like),
    "MatMul": Rule(f.matmul, m.matmul),
    "Gemm": Rule(None, m.gemm),
    # layers
    "Conv": Rule(None, nn.conv),
    "MaxPool": Rule(None, nn.max_pool),
    "AveragePool": Rule(None, nn.average_pool),
    "GlobalAveragePool": Rule(None, nn.global_average_pool),
    "BatchNormalization": Rule(None, nn.batch_norm),
    "LayerNormalization": Rule(None, nn.layer_norm),
    "InstanceNormalization": Rule(None, nn.instance_norm),
    "Dropout": Rule(None, nn.dropout),
    # spatial resampling: padding, interpolation, transposed convolution (map_resample)
    "Pad": Rule(rs.fold_pad, rs.pad),
    "Resize": Rule(None, rs.resize),
    "ConvTranspose": Rule(None, rs.conv_transpose),
    "LSTM": Rule(None, rc.lstm),
    "GRU": Rule(None, rc.gru),
    "RNN": Rule(None, rc.rnn),
    # random draws (stochastic depth, dropout by hand, noise): drawn in training, expected in eval
    "RandomUniformLike": Rule(None, r.random_uniform_like),
    "RandomNormalLike": Rule(None, r.random_normal_like),
    "Bernoulli": Rule(None, r.bernoulli),
    # shapes
    "Identity": Rule(f.identity, s.identity),
    "Reshape": Rule(f.reshape, s.reshape),
    "Flatten": Rule(f.flatten, s.flatten),
    "Squeeze": Rule(f.squeeze, s.squeeze),
    "Unsqueeze": Rule(f.unsqueeze, s.unsqueeze),
    "Transpose": Rule(f.transpose, s.transpose),
    "Concat": Rule(f.concat, s.concat),
    "Split": Rule(f.split, s.split),
    "SplitToSequence": Rule(None, s.split_to_sequence),
    "SequenceAt": Rule(None, s.sequence_at),
    "Slice": Rule(f.slice_, s.slice_),
    "Gather": Rule(f.gather, s.gather),
    "Expand": Rule(f.expand, s.expand),
    "Tile": Rule(f.tile, s.tile),
    "Shape": Rule(f.shape, s.shape),
    "Size": Rule(f.size, s.size),
    "ReduceMean": Rule(f.reducer(np.mean), s.reduce("mean")),
    "ReduceSum": Rule(f.reducer(np.sum), s.reduce("sum")),
    "ReduceSumSquare": Rule(f.reducer(lambda x, **kw: np.sum(x * x, **kw)), s.reduce("sum", square=True)),
    "ReduceL2": Rule(f.reducer(lambda x, **kw: np.sqrt(np.sum(x * x, **kw))), s.reduce("sum", square=True, root=True)),
    # running sums and index ops, on float data (differentiated) or int data (at run time);
    # NonZero only as pooling at one token per row (map_index), ArgMax's index as a per-row pick (map_rows)
    "CumSum": Rule(f.cumsum, ix.cumsum),
    "ArgMax": Rule(ix.fold_argmax, ix.argmax),
    "GatherElements": Rule(f.gather_elements, ix.gather_elements),
    "GatherND": Rule(f.gather_nd, ix.gather_nd),
    "ScatterElements": Rule(f.scatter_elements, ix.scatter_elements),
    "ScatterND": Rule(f.scatter_nd, ix.scatter_nd),
    "NonZero": Rule(f.nonzero, ix.nonzero),
    # masks: tests, comparisons and logic, at run time as int64 0/1 tensors without gradient (a
    # uniform draw compared with a constant is a random mask: map_random)
    "IsNaN": Rule(f.isnan, m.mask("isnan")),
    "IsInf": Rule(f.isinf, m.isinf),
    "Equal": Rule(f.compare(np.equal), m.mask("compare", kind="equal")),
    "Less": Rule(f.compare(np.less), r.compare("less")),
    "LessOrEqual": Rule(f.compare(np.less_equal), r.compare("less_equal")),
    "Greater": Rule(f.compare(np.greater), r.compare("greater")),
    "GreaterOrEqual": Rule(f.compare(np.greater_equal), r.compare("greater_equal")),
    "Not": Rule(f.logical_not, m.mask("logical", kind="not")),
    "And": Rule(f.compare(np.logical_and), m.mask("logical", kind="and")),
    "Or": Rule(f.compare(np.logical_or), m.mask("logical", kind="or")),
    "Xor": Rule(f.compare(np.logical_xor), m.mask("logical", kind="xor")),
    # constants and shape arithmetic: folded only
    "Constant": Rule(f.constant),
    "ConstantOfShape": Rule(f.constant_of_shape),
    "Range": Rule(f.range_),
    "Trilu": Rule(f.trilu),
    "Mod": Rule(f.mod),
    "Min": Rule(f.variadic(np.minimum)),
    "Max": Rule(f.variadic(np.maximum)),
    "Abs": Rule(f.unary(np.abs)),
    "Floor": Rule(f.unary(np.floor)),
    "Ceil": Rule(f.unary(np.ceil)),
    "ReduceProd": Rule(f.reducer(np.prod)),
    "ReduceMax": Rule(f.reducer(np.max)),
    "ReduceMin": Rule(f.reducer(np.min)),
}

_FLOAT_TYPES = {1, 10, 11, 16}
_INT_TYPES = {2, 3, 4, 5, 6, 7, 9, 12, 13}


@dataclass
class ImportedModel:
    graph: Graph
    initial: dict = field(default_factory=dict)   # IR parameter / buffer name -> float64 value
    warnings: list = field(default_factory=list)


def _attrs(node) -> dict:
    from onnx import helper, numpy_helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if hasattr(v, "dims") and hasattr(v, "data_type"):
            v = numpy_helper.to_array(v)
        elif isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [b.decode("utf-8", "replace") for b in v]
        out[a.name] = v
    out["_outputs"] = len(node.output)
    return out


def supported_ops() -> tuple[list[str], list[str]]:
    """(op types that train on data, op types read only on constants and shapes)."""
    trained = sorted(k for k, r in ONNX_OPS.items() if r.emit is not None)
    folded = sorted(k for k, r in ONNX_OPS.items() if r.emit is None)
    return trained, folded


def _data_inputs(em: Emitter, graph, initialized: set, warnings: list) -> list:
    """IR inputs x (and y) for the graph inputs that are not initializers."""
    inputs = [i for i in graph.input if i.name not in initialized]
    if len(inputs) not in (1, 2):
        raise GraphError(f"the ONNX graph has {len(inputs)} data inputs {[i.name for i in inputs]}: hpc_rlx feeds "
                         f"one (the model input), or two (input and labels) to a graph that computes its own loss")
    out = []
    for ir_name, vi in zip(("x", "y"), inputs):
        tt = vi.type.tensor_type
        if tt.elem_type not in _FLOAT_TYPES | _INT_TYPES:
            raise GraphError(f"ONNX input {vi.name!r} has element type {tt.elem_type}, not a number")
        dims = list(tt.shape.dim)
        if not dims:
            raise GraphError(f"ONNX input {vi.name!r} must have a batch dimension (it is a scalar)")
        shape = [None]
        for k, d in enumerate(dims[1:], 1):
            if not d.HasField("dim_value") or d.dim_value < 1:
                raise GraphError(f"ONNX input {vi.name!r} dim {k} is {d.dim_param or 'unknown'!r}: only the batch "
                                 f"dim (the first) may vary; export with a fixed size for the others")
            shape.append(d.dim_value)
        if dims[0].HasField("dim_value"):
            warnings.append(f"ONNX input {vi.name!r} has a fixed batch size {dims[0].dim_value}: it is read as the "
                            f"batch dim (export with a dynamic batch dim if the graph bakes that size in)")
        out.append((vi.name, em.input(ir_name, shape, FLOAT if tt.elem_type in _FLOAT_TYPES else INT)))
    return out


def _bind_initializers(em: Emitter, plan, env: dict, meta: dict, initial: dict) -> None:
    em.at("initializers", "initializer", "init")
    for name, value in plan.values.items():
        kind = plan.kind[name]
        if kind == "const":
            # a tensor of the module's state (Swin V2's relative_coords_table, computed in float32
            # at construction) holds exactly these values in module.double() too: float64, so it
            # is not read as the decimals a constant of the code rounds to (Emitter.constant)
            exact = value.dtype == np.float32 and value.size > 1
            env[name] = Folded(value.astype(np.float64) if exact else value)
        elif kind in ("param", "buffer"):
            ir = em.unique(name)
            init = None if kind == "param" else {"scheme": "ones" if "var" in name.lower() else "zeros"}
            env[name] = em.param(ir, value, trainable=kind == "param", init=init)
            initial[ir], meta["params"][ir] = value.astype(np.float64), name
            if name in plan.torch_name:
                meta["torch_names"][ir] = plan.torch_name[name]
    made: dict = {}  # PyTorch weights not in the file, made from a first transposed copy
    for name, source in plan.source.items():
        value = plan.values[name]
        held = env.get(source) if source in plan.values else made.get(source)
        if isinstance(held, Tensor) and np.array_equal(initial[held.name], value.T.astype(np.float64)):
            meta["tied"][name] = held.name
        else:
            ir = em.unique(source)
            held = made[source] = em.param(ir, np.ascontiguousarray(value.T))
            initial[ir], meta["params"][ir], meta["transposed"][ir] = value.T.astype(np.float64), name, source
            meta["torch_names"][ir] = plan.torch_name.get(source, source)
        em.at("initializers", "initializer", name)
        env[name] = em.transpose(held, [1, 0])


def _walk(em: Emitter, graph, env: dict) -> None:
    """Translate the nodes in order. Nodes the import cannot take are collected, not raised one
    at a time: their outputs are marked unknown, nodes reading those are passed over, and one
    error at the end lists them all (a node refused alone keeps its own message)."""
    producer = {}
    nodes = list(graph.node)
    rules = [ONNX_OPS.get(n.op_type) if n.domain in ("", "ai.onnx") else None for n in nodes]
    missing = [n for n, rule in zip(nodes, rules) if rule is None]
    data_bound: list = []
    refused: list = []         # (node, reason, its own error): an op hpc_rlx has, in a form it has not
    unknown: set = set()       # outputs of nodes passed over
    for node, rule in zip(nodes, rules):
        if rule is None or any(name in unknown for name in node.input if name):
            unknown.update(o for o in node.output if o)
            continue
        ins = []
        for name in node.input:
            if not name:
                ins.append(None)
            elif name not in env:
                raise GraphError(f"ONNX node '{node.name}' ({node.op_type}): input {name!r} comes from no node, "
                                 f"initializer or graph input before it")
            elif env[name] is None:
                raise GraphError(f"ONNX node '{node.name}' ({node.op_type}) reads {name!r}, an output of "
                                 f"{producer[name]} that hpc_rlx does not compute")
            else:
                ins.append(env[name])
        attrs = _attrs(node)
        em.at(node.name, node.op_type, node.output[0] if node.output else node.name)
        em.proto = node
        marked = any(isinstance(v, rows.MARKERS) for v in ins)  # on the way to a gather (map_rows)
        if rule.fold is not None and all(v is None or isinstance(v, Folded) for v in ins):
            try:
                outs = evaluate(rule.fold, ins, attrs)
            except (FoldError, ValueError, TypeError, IndexError, KeyError) as exc:
                raise em.fail(f"cannot evaluate it on its constant inputs: {exc}") from None
        else:
            try:
                met = None if marked else rows.meet(em, node.op_type, ins, attrs)
                if met is None and not marked and rule.emit is None:
                    data_bound.append(node)
                    unknown.update(o for o in node.output if o)
                    continue
                if met is not None or marked:
                    outs = met or rows.follow(em, node.op_type, ins, attrs)
                else:
                    outs = rule.emit(em, ins, attrs, len(node.output))
            except GraphError as exc:
                if not hasattr(exc, "reason"):
                    raise
                refused.append((node, exc.reason, exc))
                unknown.update(o for o in node.output if o)
                continue
        for name, value in zip(node.output, list(outs) + [None] * len(node.output)):
            if name:
                env[name], producer[name] = value, f"'{node.name}' ({node.op_type})"
    if len(refused) == 1 and not (missing or data_bound):
        raise refused[0][2]
    if missing or data_bound or refused:
        raise unsupported_error(missing, data_bound, [(node, reason) for node, reason, _ in refused],
                                *supported_ops())


def _check_declared(graph, out: Tensor) -> None:
    """The model output's static dims, as the file declares them, against the import's."""
    dims = list(graph.output[0].type.tensor_type.shape.dim)
    ours = dims_at(out.groups, TRACE_BATCHES[0])
    if dims and len(dims) != len(ours):
        raise GraphError(f"the import gives the model output rank {len(ours)}, the file declares {len(dims)}")
    for k, (d, g) in enumerate(zip(dims, out.groups)):
        if d.HasField("dim_value") and None not in g and d.dim_value != ours[k]:
            raise GraphError(f"the import gives the model output {ours[k]} in dim {k}, the file declares {d.dim_value}")


def _form_warnings(em: Emitter, plan, warnings: list) -> str:
    frozen_bn, off = em.forms["bn_frozen"], em.forms["dropout_off"]
    if off and em.forms["dropout"]:
        # a training export whose exporter left some dropouts without their training flag (the
        # dynamo exporter does for attention dropout): module.train() was used and cannot help
        warnings.append(f"dropout {off} is inactive: the exporter wrote it without its training flag, "
                        f"although the file's other {len(em.forms['dropout'])} dropout(s) have it, so the "
                        f"model trains without it; exporting again from module.train() does not change that")
        off = []
    if frozen_bn or off:
        parts = []
        if frozen_bn:
            parts.append(f"batch norm {frozen_bn} normalises with its running statistics, which stay as they are")
        if off:
            parts.append(f"dropout {off} is inactive")
        elif not em.forms["dropout"]:
            parts.append("dropout, if the model has any, is absent (inference exports leave it out)")
        warnings.append("an inference-form export trains as exported: " + "; ".join(parts) + ". Export from "
                        "module.train() (TorchScript: training=torch.onnx.TrainingMode.TRAINING) to train them")
    return "inference" if frozen_bn or off or plan.fused else "training"


def _prune(d: dict) -> dict:
    """Only the nodes and parameters the outputs depend on (the graph inputs stay)."""
    nodes = {n["name"]: n for n in d["nodes"]}
    needed, todo = set(), list(d["outputs"].values())
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        todo.extend(nodes[name]["inputs"] if name in nodes else [])
    d["nodes"] = [n for n in d["nodes"] if n["name"] in needed]
    d["params"] = [p for p in d["params"] if p["name"] in needed]
    return d


def import_onnx(source, loss: str = "auto", label_dtype: str | None = None, label_shape=None,
                class_axis=None, inputs: list | None = None) -> ImportedModel:
    """The trainable IR graph of an ONNX file (a path or its bytes).

    ``loss``: "auto", "cross_entropy" or "mse" (see ``onnx.loss``); ``label_dtype`` ("int64"
    or "float") and ``label_shape`` (one sample's label dims) describe the labels when known;
    ``class_axis`` (1, -1 or None: from the shapes) places a cross-entropy's classes.
    ``inputs``: data.x's K [(dataset, row shape, dtype)], fed packed (packed_inputs.py). A graph with
    one data input more (two without ``inputs``) and a float scalar output trains on that output.
    """
    loss_head.check_loss_args(loss, label_dtype, label_shape)
    model = pack_inputs(load_model(source), inputs) if inputs else load_model(source)
    warnings: list = []
    untied = untie_merged_initializers(model)
    if untied:
        warnings.append(f"the exporter's optimizer had merged initializers of equal value; {len(untied)} "
                        f"PyTorch parameters read from them train separately again, under their own names "
                        f"(the modules' records in the file name them): {untied}")
    meta = {"opset": opset_of(model), "exporter": exporter_of(model), "params": {}, "transposed": {},
            "tied": {}, "torch_names": {}}
    plan = plan_initializers(model, warnings)
    graph = model.graph
    em = Emitter(sanitise(graph.name or "onnx_model"))
    em.opset = meta["opset"]
    env: dict = {}
    initial: dict = {}
    inputs = _data_inputs(em, graph, set(plan.values), warnings)
    for onnx_name, tensor in inputs:
        env[onnx_name] = tensor
    em.data_input = inputs[0][1]
    _bind_initializers(em, plan, env, meta, initial)
    _walk(em, graph, env)

    ix.refuse_unpooled_outputs(graph, env)
    missing = [o.name for o in graph.output if env.get(o.name) is None]
    if missing:
        raise GraphError(f"ONNX graph outputs {missing} are computed by no node")
    if len(inputs) == 2:
        if loss != "auto":
            raise GraphError(f"the ONNX graph computes its own loss (two inputs), so it takes loss=auto, not {loss!r}")
        loss_t, out = loss_head.own_loss([env[o.name] for o in graph.output])
        outputs = {"loss": loss_t.name}
        out_name = next(o.name for o in graph.output if env[o.name] is out)
    else:
        out_name = graph.output[0].name
        out = env[out_name]
        if not isinstance(out, Tensor):
            raise GraphError(f"the model output {out_name!r} does not depend on the input")
        _check_declared(graph, out)
        if len(graph.output) > 1:
            warnings.append(f"the ONNX graph has {len(graph.output)} outputs: the first, {out_name!r}, is the model "
                            f"output; {[o.name for o in graph.output[1:]]} are not used")
        outputs = loss_head.attach(em, out, loss, label_dtype, label_shape, class_axis)
    for name, ref in outputs.items():
        em.b.output(name, ref)
    form = _form_warnings(em, plan, warnings)
    meta.update(form=form, input=inputs[0][0], output=out_name, output_node=out.name, **packed_layout(model))
    if plan.state_consts:
        meta["state_constants"] = sorted(plan.state_consts)
    if em.expectations:
        meta["expectations"] = dict(em.expectations)
    em.b.meta = {"onnx": meta}
    d = _prune(em.b.to_dict())
    kept = {p["name"] for p in d["params"]}
    for table in ("params", "transposed", "torch_names"):
        meta[table] = {k: v for k, v in meta[table].items() if k in kept}
    meta["tied"] = {k: v for k, v in meta["tied"].items() if v in kept}
    record_folded(plan, meta)
    d["meta"] = {"onnx": meta}
    return ImportedModel(Graph.from_dict(d), {k: v for k, v in initial.items() if k in kept}, warnings)
