"""An hpc_rlx graph (a builder model or a hand-written graph) as an inference ONNX model.

Only the nodes the model output depends on are translated, so the loss and the metrics drop
out; every IR tensor keeps its name (inputs, parameters as initializers, node values), and
helper tensors are named ``<node>/t<k>``, which no IR name can be.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.export.onnx_ops import TABLE, Site
from hpc_rlx.export.onnx_writer import OPSET, OnnxWriter, make_checked_model, value_info
from hpc_rlx.export.trained import ExportError, TrainedModel
from hpc_rlx.graph import Graph


def needed_by(graph: Graph, output: str) -> set:
    """Every input, parameter and node the value of ``output`` depends on (itself included)."""
    by_name = {n.name: n for n in graph.nodes}
    seen, todo = set(), [output]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in by_name:
            todo.extend(by_name[name].inputs)
    return seen


def ir_to_onnx(onnx, trained: TrainedModel, output: str):
    """The ONNX ModelProto computing ``output`` from the graph's inputs, weights as float32."""
    graph = trained.graph
    needed = needed_by(graph, output)
    inputs = [s for s in graph.inputs if s.name in needed]
    w = OnnxWriter(onnx)
    unknown = sorted({graph.nodes[i].op for i in graph.order
                      if graph.nodes[i].name in needed and graph.nodes[i].op not in TABLE})
    if unknown:
        raise ExportError(f"op(s) {unknown} have no ONNX translation, so the model output {output!r} "
                          f"cannot be exported")
    for p in graph.params:
        if p.name in needed:
            w.initializer(p.name, np.asarray(trained.params[p.name], dtype=np.float32))
    for i in graph.order:
        node = graph.nodes[i]
        if node.name not in needed:
            continue
        site = Site(node.name, list(node.inputs), node.name, graph.norm_attrs[node.name],
                    [graph.types[r] for r in node.inputs], graph.types[node.name])
        TABLE[node.op](w, site)
    out_type = graph.types[output]
    proto = onnx.helper.make_graph(
        w.nodes, graph.name or "model",
        [value_info(onnx, s.name, s.dtype, s.shape) for s in inputs],
        [value_info(onnx, output, out_type.dtype, out_type.shape)],
        initializer=w.initializers)
    doc = f"hpc_rlx model '{graph.name}' (output {output!r}) from {trained.source}"
    return make_checked_model(onnx, proto, OPSET, doc)
