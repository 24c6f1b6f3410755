"""Undo dynamo's merge of equal initializers. `torch.onnx.export(dynamo=True)` optimizes by
default, and its optimizer keeps one initializer for each set of equal values: the freshly
initialised weights and biases of every layer norm of a model, all ones and zeros, become one
parameter that would train tied. Each node still records the module it came from
(`pkg.torch.onnx.name_scopes`), so the parameter a node read is `<its module>.<the leaf>`:
where the graph signature lists that name and no initializer holds it, the node gets its own
copy under that name, and the PyTorch parameters come back to train separately.

Only initializers holding one repeated value are untied (a fill of ones or zeros, as a fresh
layer is initialised): equal random values come from a module that ties two parameters (GPT-2's
head reads the token embedding), which must stay one."""

from __future__ import annotations

from hpc_rlx.graph.onnx.params import exporter_of, signature_targets
from hpc_rlx.graph.onnx.scopes import module_of


def untie_merged_initializers(model) -> list[str]:
    """Give each node that reads a merged initializer its own copy under its module's parameter
    name (in place); returns the names restored."""
    if exporter_of(model) != "dynamo":
        return []
    targets = signature_targets(model)
    graph = model.graph
    held = {t.name: t for t in graph.initializer}
    fills = {name for name, t in held.items() if _one_value(t)}
    value_info = {vi.name: vi for vi in graph.value_info}
    restored: dict = {}
    for node in graph.node:
        module = module_of(node)
        if not module:
            continue
        for pos, name in enumerate(node.input):
            if name not in fills or "." not in name:
                continue
            own = f"{module}.{name.rsplit('.', 1)[1]}"
            if own == name or own not in targets or (own in held and own not in restored):
                continue
            if own not in restored:
                restored[own] = name
                copy = graph.initializer.add()
                copy.CopyFrom(held[name])
                copy.name = own
                held[own] = copy
                if name in value_info:     # the record of its kind (a parameter) goes with it
                    info = graph.value_info.add()
                    info.CopyFrom(value_info[name])
                    info.name = own
            node.input[pos] = own
    return sorted(restored)


def _one_value(tensor) -> bool:
    """A float initializer whose elements are all equal (more than one of them)."""
    from onnx import numpy_helper

    value = numpy_helper.to_array(tensor)
    return value.dtype.kind == "f" and value.size > 1 and bool((value == value.flat[0]).all())
