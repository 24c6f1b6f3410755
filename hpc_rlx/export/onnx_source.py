"""Models that came in as ONNX: the original file with the trained weights, in inference form,
and the state dict under the original (PyTorch) names and layouts.

The run keeps the file it imported as RUN_DIR/model.source.onnx; graph.meta["onnx"] maps each
IR parameter to the initializer it came from ("params"), names those stored transposed
relative to it ("transposed"), and may name their PyTorch state-dict key ("torch_names");
"tied" names initializers that are a transposed copy of a parameter held elsewhere too,
"aliases" (optional) the other PyTorch names of a tied parameter, "slices" and "removed"
(optional) the parts of parameters dynamo's optimizer folded and the parameters it dropped
(export/base_weights: written back from the module's original weights), and "state_constants"
(optional) the float buffers of the module's state dict that the import read as constants
(Swin V2's relative_coords_table): the state dict takes them from the source file.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.export.base_weights import place_parts
from hpc_rlx.export.onnx_writer import BATCH, check_model
from hpc_rlx.export.trained import ExportError, TrainedModel
from hpc_rlx.graph import Graph
from hpc_rlx.graph.param_names import pytorch_name
from hpc_rlx.graph.onnx.untie import untie_merged_initializers

SOURCE_FILE = "model.source.onnx"


def is_imported(graph: Graph) -> bool:
    return isinstance(graph.meta.get("onnx"), dict)


def _meta(graph: Graph) -> dict:
    meta = graph.meta["onnx"]
    params = meta.get("params")
    if not isinstance(params, dict):
        raise ExportError("the model came in as ONNX but its graph records no parameter map (meta.onnx.params)")
    return meta


def _in_shape(ir_name: str, source: str, value: np.ndarray, shape) -> np.ndarray:
    """``value`` in the initializer's ``shape`` (the same elements, e.g. a (C,1,1) bias as (C,))."""
    if tuple(value.shape) != tuple(shape):
        if value.size != int(np.prod(shape, dtype=np.int64)):
            raise ExportError(f"parameter {ir_name!r} has shape {value.shape}, its initializer {source!r} "
                              f"{tuple(shape)}")
        value = value.reshape(shape)
    return value


def load_source(onnx, trained: TrainedModel):
    """The source file's ModelProto. Tensors kept in an external data file are left unread:
    the trained ones are replaced anyway, the others are read by ``read_external`` (the
    exporters of torch put large weights next to the file, and the run copies the file only)."""
    path = trained.run_dir / SOURCE_FILE
    if not path.is_file():
        raise ExportError(f"{trained.run_dir} has no {SOURCE_FILE}, the ONNX file the model was imported "
                          f"from; copy that file there to export the model")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf and onnx raise several types for a bad file
        raise ExportError(f"{path} cannot be read as ONNX: {e}") from None


def _all_tensors(graph):
    """The initializers and constant tensors of ``graph`` and of its subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_tensors(sub)


def read_external(onnx, model, run_dir) -> None:
    """Read the tensors still kept in external data files, from the run directory."""
    helper = onnx.external_data_helper
    for tensor in _all_tensors(model.graph):
        if not helper.uses_external_data(tensor):
            continue
        where = {e.key: e.value for e in tensor.external_data}.get("location", "?")
        try:
            helper.load_external_data_for_tensor(tensor, str(run_dir))
        except Exception:  # noqa: BLE001 - a missing or short file; one message for both
            raise ExportError(f"{SOURCE_FILE} keeps tensor {tensor.name!r} in the external file {where!r}, "
                              f"which is not readable in {run_dir}: copy it there from beside the "
                              f"original ONNX file") from None
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def original_state_dict(trained: TrainedModel, onnx=None, base: dict | None = None,
                        notes: list | None = None) -> dict:
    """PyTorch name -> float32 value for every IR parameter and buffer. With ``onnx`` the
    source file's initializer shapes are used for the untransposed ones. ``base``: the PyTorch
    module's original weights (name -> float32), for what the file lacks (export/base_weights);
    ``notes`` collects what of it could not be used."""
    meta = _meta(trained.graph)
    shapes, constants, parts = {}, {}, {}
    if base is not None and meta.get("slices") and (onnx is None or not (trained.run_dir / SOURCE_FILE).is_file()):
        raise ExportError(f"--base needs the onnx package and {SOURCE_FILE} in the run directory (the initial "
                          f"values of the parameters it places)")
    if onnx is not None and (trained.run_dir / SOURCE_FILE).is_file():
        source_model = load_source(onnx, trained)
        shapes = {t.name: tuple(t.dims) for t in source_model.graph.initializer}
        wanted = set(meta.get("state_constants") or ())
        if base is not None and meta.get("slices"):
            read_external(onnx, source_model, trained.run_dir)
            held = {t.name: t for t in source_model.graph.initializer}
            parts = {ir: onnx.numpy_helper.to_array(held[meta["params"][ir]]).astype(np.float32)
                     for ir in meta["slices"] if meta["params"].get(ir) in held}
        if wanted:
            read_external(onnx, source_model, trained.run_dir)
            constants = {t.name: onnx.numpy_helper.to_array(t).astype(np.float32)
                         for t in source_model.graph.initializer if t.name in wanted}
    out = {}
    for p in trained.graph.params:
        value = np.asarray(trained.params[p.name], dtype=np.float32)
        source = meta["params"].get(p.name)
        if source is None:
            raise ExportError(f"parameter {p.name!r} has no source initializer in meta.onnx.params")
        if p.name not in meta.get("transposed", {}) and source in shapes:
            value = _in_shape(p.name, source, value, shapes[source])
        name = pytorch_name(meta, p.name)
        if name in out:
            raise ExportError(f"parameters map to the same state-dict name {name!r}")
        out[name] = value
    for name, value in constants.items():
        out.setdefault(name, value)
    # PyTorch lists a tied parameter under each of its names; the file holds it once
    for alias, ir in (meta.get("aliases") or {}).items():
        if ir in trained.params and alias not in out:
            out[alias] = np.asarray(trained.params[ir], dtype=np.float32)
    if base is not None:
        (notes if notes is not None else []).extend(place_parts(out, meta, parts, base))
    return out


def _prune(graph, keep: str) -> None:
    """Keep only the nodes ``keep`` depends on; graph outputs = [keep]."""
    producer = {o: n for n in graph.node for o in n.output}
    needed, todo, seen = set(), [keep], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in producer:
            continue
        seen.add(name)
        node = producer[name]
        needed.add(id(node))
        todo.extend(i for i in node.input if i)
        for attr in node.attribute:  # names a subgraph reads from the outer scope
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                todo.extend(i for n in sub.node for i in n.input if i)
    kept = [n for n in graph.node if id(n) in needed]
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in kept for i in n.input} | {keep}
    for attr_node in kept:
        for attr in attr_node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                used.update(i for n in sub.node for i in n.input)
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)


def _inference_forms(onnx, graph, expectations: dict) -> None:
    """Batch norm on its running statistics with one output; Dropout and Bernoulli as Identity;
    a random draw (and a mask compared from one) as its expectation, shaped like it."""
    _expected_draws(onnx, graph, expectations)
    for node in graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            kept = [a for a in node.attribute if a.name not in ("training_mode", "is_test")]
            del node.attribute[:]
            node.attribute.extend(kept)
            del node.output[1:]
        elif node.op_type in ("Dropout", "Bernoulli") and node.domain in ("", "ai.onnx"):
            node.op_type = "Identity"
            del node.input[1:]
            del node.output[1:]
            del node.attribute[:]


def _expected_draws(onnx, graph, expectations: dict) -> None:
    """Each tensor the import drew at random (graph.meta["onnx"]["expectations"]) becomes its
    expectation, one number over the shape of the node's first input: the draw's shape source,
    or for a mask compared from a draw, the draw. The draw nodes then feed only that Shape."""
    nodes = []
    for node in graph.node:
        value = expectations.get(node.output[0]) if node.output else None
        if value is None:
            nodes.append(node)
            continue
        out = node.output[0]
        shape = onnx.helper.make_node("Shape", [node.input[0]], [f"{out}.shape"], name=f"{node.name}.shape")
        const = onnx.helper.make_tensor(f"{out}.expected", onnx.TensorProto.FLOAT, [], [float(value)])
        graph.initializer.append(const)
        nodes += [shape, onnx.helper.make_node("Expand", [const.name, shape.output[0]], [out],
                                               name=f"{node.name}.expected")]
    del graph.node[:]
    graph.node.extend(nodes)


def _symbolic_batch(value_info) -> None:
    dims = value_info.type.tensor_type.shape.dim
    if len(dims):
        dims[0].Clear()
        dims[0].dim_param = BATCH


def _output_info(onnx, model, output: str):
    """The value info of tensor ``output``: a graph output's, or inferred for an inner tensor."""
    for vi in model.graph.output:
        if vi.name == output:
            return type(vi).FromString(vi.SerializeToString())
    if not any(output in n.output for n in model.graph.node):
        raise ExportError(f"{SOURCE_FILE} has no tensor {output!r} (the model output its graph records)")
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is best effort here; the type below suffices
        inferred = model
    for vi in inferred.graph.value_info:
        if vi.name == output:
            return vi
    return onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)


def _batched_output(trained: TrainedModel, meta: dict, output: str) -> bool:
    """Whether the model output's first dim is the batch (the IR's types say so)."""
    node = meta.get("output_node") or output
    t = trained.graph.types.get(node)
    return t is None or (len(t.shape) > 0 and t.shape[0] is None)


def original_onnx(onnx, trained: TrainedModel):
    """(the inference ModelProto, its output name): the source file with the trained weights."""
    meta = _meta(trained.graph)
    model = load_source(onnx, trained)
    graph = model.graph
    if set(meta["params"].values()) - {t.name for t in graph.initializer}:
        # the import untied initializers that dynamo's optimizer had merged (graph/onnx/untie.py):
        # the same untying, on the same file, gives each parameter its initializer back
        read_external(onnx, model, trained.run_dir)
        untie_merged_initializers(model)
    output = meta.get("output")
    if not output:
        raise ExportError("the model came in as ONNX but its graph records no output (meta.onnx.output)")
    out_info = _output_info(onnx, model, output)
    by_name = {t.name: t for t in graph.initializer}
    # a tied initializer is a transposed copy of a parameter held elsewhere: file value = ir.T
    writes = [(ir, source, ir in meta.get("transposed", {})) for ir, source in meta["params"].items()]
    writes += [(ir, source, True) for source, ir in (meta.get("tied") or {}).items()]
    for ir_name, source, transpose in writes:
        init = by_name.get(source)
        if init is None or ir_name not in trained.params:
            raise ExportError(f"{SOURCE_FILE} has no initializer {source!r} (parameter {ir_name!r}); "
                              f"is it the file this run imported?")
        value = np.asarray(trained.params[ir_name])
        value = _in_shape(ir_name, source, value.T if transpose else value, tuple(init.dims))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        init.CopyFrom(onnx.numpy_helper.from_array(np.require(value, dtype, "C"), source))
    read_external(onnx, model, trained.run_dir)
    _inference_forms(onnx, graph, meta.get("expectations") or {})
    _prune(graph, output)
    del graph.output[:]
    graph.output.append(out_info)
    del graph.value_info[:]  # shapes there may carry the batch size the file was traced with
    initialized = {t.name for t in graph.initializer}
    for vi in graph.input:
        if vi.name not in initialized:
            _symbolic_batch(vi)
    if _batched_output(trained, meta, output):
        _symbolic_batch(graph.output[0])
    model.doc_string = f"hpc_rlx: {SOURCE_FILE} with the trained weights from {trained.source} (inference form)"
    return check_model(onnx, model), output
