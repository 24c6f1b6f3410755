"""A model with several inputs (`data.x=[input_ids, attention_mask]`) as a model with one.

The feed hands the model one array per batch; a model of K inputs gets their rows side by
side, each flattened (`data/model_inputs.py` packs them in the same order). This module
rewrites the ONNX graph to match: its first K data inputs become one input, `packed_inputs`,
cut back into the K tensors by Slice and Reshape (and Cast where the packed dtype is not the
input's kind) before the first node. So every place that moves `x` today (both caches,
`read` and `scatter`, each lane's micro-batch, validation) moves all K inputs.

With K names in `data.x`, the graph's first K data inputs are the model's: each dataset goes
to the input of its name, the others in order. A graph with one data input more computes its
own loss (that input takes the labels; `loss.own_loss` wants a float scalar output).
"""

from __future__ import annotations

import json

import numpy as np

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.ir import ID_MOVING_OPS

PACKED = "packed_inputs"
_LAYOUT = "hpc_rlx.packed_inputs"     # the model's metadata entry that carries the layout to the import
_INT64, _DOUBLE = 7, 11
_FLOAT_TYPES = {1, 10, 11, 16}


def _row_shape(vi) -> tuple:
    dims = list(vi.type.tensor_type.shape.dim)
    if not dims:
        raise GraphError(f"ONNX input {vi.name!r} must have a batch dimension (it is a scalar)")
    out = []
    for k, d in enumerate(dims[1:], 1):
        if not d.HasField("dim_value") or d.dim_value < 1:
            raise GraphError(f"ONNX input {vi.name!r} dim {k} is {d.dim_param or 'unknown'!r}: only the batch "
                             f"dim (the first) may vary; export with a fixed size for the others")
        out.append(int(d.dim_value))
    return tuple(out)


def bind_inputs(graph_inputs: list, datasets: list) -> list:
    """[(graph input, (dataset name, row shape, dtype))] for the graph's first K data inputs:
    by name where a dataset is named as an input, the others in order. One GraphError naming
    both sides for a count, shape or dtype that does not fit."""
    k, names = len(datasets), [d[0] for d in datasets]
    if len(graph_inputs) not in (k, k + 1):
        raise GraphError(f"data.x names {k} datasets {names}, but the ONNX graph has {len(graph_inputs)} data inputs "
                         f"{[i.name for i in graph_inputs]}: it takes {k} (the model's inputs), or {k + 1} when it "
                         f"computes its own loss (the last takes the labels)")
    model_inputs = graph_inputs[:k]
    by_name = {i.name: i for i in model_inputs}
    named = {d[0]: by_name[d[0]] for d in datasets if d[0] in by_name}
    free = iter(i for i in model_inputs if i.name not in {v.name for v in named.values()})
    pairs = [(named[d[0]] if d[0] in named else next(free), d) for d in datasets]
    for vi, (name, shape, dtype) in pairs:
        want, is_float = _row_shape(vi), vi.type.tensor_type.elem_type in _FLOAT_TYPES
        if tuple(shape) != want:
            raise GraphError(f"data.x dataset {name!r} has rows of shape {tuple(shape)}, but the ONNX input "
                             f"{vi.name!r} it feeds takes {want}")
        if not is_float and np.dtype(dtype).kind not in "iub":
            raise GraphError(f"data.x dataset {name!r} holds {np.dtype(dtype)}, but the ONNX input {vi.name!r} it "
                             f"feeds takes integers (token ids, masks): store it as integers")
    return pairs


def pack_inputs(model, datasets: list):
    """`model` (an onnx ModelProto, changed in place and returned) with its first K data inputs
    replaced by one input of their flattened rows side by side, in `datasets` order."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    initialized = {t.name for t in g.initializer}
    data_inputs = [i for i in g.input if i.name not in initialized]
    pairs = bind_inputs(data_inputs, datasets)
    # as data/model_inputs.py packs them: int64 when every dataset holds integers, else float64
    all_int = all(np.dtype(d[2]).kind in "iub" for _, d in pairs)
    width = sum(int(np.prod(d[1], dtype=np.int64)) for _, d in pairs)
    nodes, consts, at, layout = [], [], 0, []
    for k, (vi, (_, shape, _)) in enumerate(pairs):
        size = int(np.prod(shape, dtype=np.int64))
        bounds = {"starts": [at], "ends": [at + size], "axes": [1], "shape": [-1, *shape]}
        names = {key: f"{PACKED}.{k}.{key}" for key in bounds}
        consts += [numpy_helper.from_array(np.asarray(v, np.int64), names[key]) for key, v in bounds.items()]
        flat, out = f"{PACKED}.{k}.flat", vi.name
        elem = vi.type.tensor_type.elem_type
        cast = all_int == (elem in _FLOAT_TYPES)
        nodes.append(helper.make_node("Slice", [PACKED, names["starts"], names["ends"], names["axes"]], [flat]))
        nodes.append(helper.make_node("Reshape", [flat, names["shape"]], [f"{out}.int" if cast else out]))
        if cast:
            nodes.append(helper.make_node("Cast", [f"{out}.int"], [out], to=elem))
        layout.append([vi.name, at, list(shape), elem not in _FLOAT_TYPES])
        at += size
    packed = helper.make_tensor_value_info(PACKED, TensorProto.INT64 if all_int else TensorProto.DOUBLE,
                                           ["batch", width])
    bound = {vi.name for vi, _ in pairs}
    rest = [vi for vi in g.input if vi.name not in bound]
    del g.input[:]
    g.input.extend([packed, *rest])
    g.initializer.extend(consts)
    old = list(g.node)
    del g.node[:]
    g.node.extend([*nodes, *old])
    model.metadata_props.add(key=_LAYOUT, value=json.dumps(layout))
    return model


def packed_layout(model) -> dict:
    """{"packed_inputs": [[ONNX input, first column, row shape, integer]]} of a packed model
    (graph.meta["onnx"]: the export feeds ONNX Runtime the inputs the file takes), else {}."""
    found = [p.value for p in model.metadata_props if p.key == _LAYOUT]
    return {"packed_inputs": json.loads(found[0])} if found else {}


def unpacked(x: np.ndarray, layout: list) -> dict:
    """{ONNX input: its rows} cut from packed rows `x` (integer inputs as int64)."""
    out = {}
    for name, at, shape, integer in layout:
        size = int(np.prod(shape, dtype=np.int64))
        rows = x[:, at:at + size].reshape(len(x), *shape)
        out[name] = rows.astype(np.int64) if integer else rows
    return out


def input_vocabs(graph) -> list:
    """[(first column, stop column, rows, table)] for each packed input whose ids index an
    embedding directly (as `Graph.token_vocab` finds them for one input `x`): its smallest
    table. A mask, read through arithmetic, bounds nothing."""
    found = []
    for cut in (graph.nodes[i] for i in graph.order):
        if cut.op != "slice" or cut.inputs[0] != "x" or list(cut.attrs.get("axes", ())) != [1]:
            continue
        reached, best = {cut.name}, None
        for node in (graph.nodes[i] for i in graph.order):
            if not node.inputs or node.inputs[0] not in reached:
                continue
            if node.op == "embedding":
                rows = graph.types[node.inputs[1]].shape[0]
                best = (rows, node.inputs[1]) if best is None or rows < best[0] else best
            elif node.op in ID_MOVING_OPS:
                reached.add(node.name)
        if best:
            found.append((int(cut.attrs["starts"][0]), int(cut.attrs["ends"][0]), *best))
    return found
