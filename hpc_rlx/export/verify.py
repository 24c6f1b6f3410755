"""The exported ONNX file checked against hpc_rlx's own forward, when ONNX Runtime is installed:
a random batch through both, the largest difference relative to the largest value."""

from __future__ import annotations

import numpy as np

from hpc_rlx.export.trained import ExportError, TrainedModel
from hpc_rlx.graph import Executor
from hpc_rlx.graph.onnx.packed_inputs import unpacked

CHECK_BATCH = 3  # not 1 or 2, the batch sizes files are commonly traced with
CHECK_TOLERANCE = 1e-4  # float32 ONNX against the run's dtype (float64 runs too)


def _id_range(graph, name: str) -> int:
    """How many ids an int input may take: the smallest table it indexes (2 if none)."""
    bound = None
    for node in graph.nodes:
        for pos, ref in enumerate(node.inputs):
            if ref != name:
                continue
            if node.op == "embedding" and pos == 0:
                size = graph.types[node.inputs[1]].shape[0]
            elif node.op == "gather" and pos == 1:
                data = graph.types[node.inputs[0]]
                size = data.shape[graph.norm_attrs[node.name]["axis"] % data.ndim]
            else:
                continue
            if size is not None:
                bound = size if bound is None else min(bound, size)
    return bound or 2


def _compared_ids(graph, name: str, bound: int) -> list:
    """The ids that the int input ``name`` is compared with for equality, a tokenizer's special
    tokens: BART's and T5's sequence classifiers pool at the end-of-sequence token, and the
    file runs only on rows that hold it equally often (graph/onnx/map_index.py)."""
    constants = {n.name: np.asarray(n.attrs.get("value")) for n in graph.nodes if n.op == "constant"}
    found = set()
    for node in graph.nodes:
        if node.op != "compare" or node.attrs.get("kind") != "equal" or name not in node.inputs:
            continue
        for value in (constants[ref] for ref in node.inputs if ref in constants):
            if value.size == 1 and 0 <= int(value.flat[0]) < bound:
                found.add(int(value.flat[0]))
    return sorted(found)


def _token_ids(rng, graph, name: str, shape: tuple) -> np.ndarray:
    """Random ids below the smallest table the input indexes; where the model compares them
    with special tokens, each row holds each of those once, at its end, as a tokenizer writes
    them, and nowhere else."""
    bound = _id_range(graph, name)
    special = _compared_ids(graph, name, bound) if len(shape) == 2 else []
    if not special or len(special) >= min(shape[1], bound):
        return rng.integers(0, bound, shape).astype(np.int64)
    others = np.setdiff1d(np.arange(bound), special)
    ids = others[rng.integers(0, len(others), shape)].astype(np.int64)
    ids[:, shape[1] - len(special):] = special
    return ids


def random_feeds(graph, needed: set, dtype, seed: int = 0, non_negative: bool = False) -> dict:
    """A random batch for the graph inputs in ``needed`` (float inputs ``non_negative``: their
    absolute values)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in graph.inputs:
        if s.name not in needed:
            continue
        shape = tuple(CHECK_BATCH if d is None else d for d in s.shape)
        if s.dtype == "int64":
            feeds[s.name] = _token_ids(rng, graph, s.name, shape)
        else:
            x = rng.standard_normal(shape)
            feeds[s.name] = (np.abs(x) if non_negative else x).astype(dtype)
    return feeds


def check_with_runtime(model, trained: TrainedModel, output_node: str, input_names: dict, needed: set):
    """Run ``model`` (a ModelProto) in ONNX Runtime and the graph in the Executor on one random
    batch; returns the relative difference, or None when ONNX Runtime is not installed.
    ``input_names`` maps IR input -> ONNX input name."""
    try:
        import onnxruntime
    except ImportError:
        return None
    graph = trained.graph
    dtype = next(iter(trained.params.values())).dtype if trained.params else np.dtype(np.float32)
    dtype = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)
    executor = Executor(graph, np, dtype.name)
    feeds = random_feeds(graph, needed, dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = executor.run(trained.params, feeds, [output_node])[output_node]
    if not np.isfinite(want).all():
        # a model that takes logarithms or roots of its input (CosmoFlow's log(1 + counts))
        # is defined on non-negative inputs only
        feeds = random_feeds(graph, needed, dtype, non_negative=True)
        want = executor.run(trained.params, feeds, [output_node])[output_node]
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ort_feeds = {input_names.get(k, k): (v.astype(np.float32) if v.dtype.kind == "f" else v)
                     for k, v in feeds.items()}
        layout = graph.meta.get("onnx", {}).get("packed_inputs")
        if layout:       # data.x of several inputs: the file takes them apart (graph/onnx/packed_inputs.py)
            ort_feeds.update(unpacked(ort_feeds.pop(input_names.get("x", "x")), layout))
        got = session.run(None, ort_feeds)[0]
    except Exception as e:  # noqa: BLE001 - ONNX Runtime's errors have no common base class
        raise ExportError(f"ONNX Runtime cannot run the exported model: {str(e).splitlines()[0]}") from None
    if got.shape != want.shape:
        raise ExportError(f"ONNX Runtime gives the output shape {got.shape}, hpc_rlx {want.shape}")
    scale = max(float(np.abs(want).max()), 1e-30)
    diff = float(np.abs(got.astype(np.float64) - want).max()) / scale
    if not diff <= CHECK_TOLERANCE:
        raise ExportError(f"ONNX Runtime's output differs from hpc_rlx's forward by {diff:.2e} (relative "
                          f"to the largest output); the export is wrong, please report it")
    return diff
