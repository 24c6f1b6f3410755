"""A run directory's trained model: its graph and parameter values, from the final model.h5
or from one of its checkpoints (latest, best or a path)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.checkpoint import BEST_POINTER, CheckpointManager, checkpoints_dir, read_checkpoint
from hpc_rlx.base.errors import CheckpointError, GraphError, HpcRlxError
from hpc_rlx.graph import Graph, ParamLayout

CHECKPOINT_CHOICES = ("latest", "best")


class ExportError(HpcRlxError):
    """The model cannot be exported (missing run files, unknown checkpoint, unsupported op...)."""


@dataclass
class TrainedModel:
    graph: Graph
    params: dict  # parameter (and buffer) name -> NumPy array in the run's dtype
    source: Path  # the file the values came from
    run_dir: Path


def load_trained(run_dir, checkpoint: str | None = None, warn=print) -> TrainedModel:
    """The model of ``run_dir``: the final model.h5, or the checkpoint ``checkpoint`` names
    ("latest", "best" or a file path)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    if checkpoint is None:
        return _from_model_file(run_dir)
    return _from_checkpoint(run_dir, _checkpoint_path(run_dir, checkpoint, warn))


def _from_model_file(run_dir: Path) -> TrainedModel:
    path = run_dir / names.MODEL
    if not path.is_file():
        raise ExportError(f"{run_dir} has no {names.MODEL} (the run has not finished, or it stopped with "
                          f"non-finite parameters); export a checkpoint with --checkpoint latest")
    try:
        with h5py.File(path, "r", locking=False) as f:
            text = f.attrs.get("graph")
            arrays = {name: np.asarray(ds[()]) for name, ds in f.items() if isinstance(ds, h5py.Dataset)}
    except OSError as e:
        raise ExportError(f"{path} cannot be read: {e}") from None
    if text is None:
        graph = _graph_file(run_dir)
    else:
        graph = _graph_from_text(text, path)
    missing = [p.name for p in graph.params if p.name not in arrays]
    if missing:
        raise ExportError(f"{path} lacks parameter(s) {missing[:5]} of its model graph")
    for p in graph.params:
        if tuple(arrays[p.name].shape) != tuple(p.shape):
            raise ExportError(f"{path}: parameter {p.name!r} has shape {arrays[p.name].shape}, "
                              f"the graph says {tuple(p.shape)}")
    return TrainedModel(graph, {p.name: arrays[p.name] for p in graph.params}, path, run_dir)


def _checkpoint_path(run_dir: Path, choice: str, warn) -> Path:
    directory = checkpoints_dir(run_dir)
    if choice == "latest":
        path = CheckpointManager(directory).latest_valid(warn=lambda m: warn(f"warning: {m}"))
        if path is None:
            raise ExportError(f"{run_dir} has no valid checkpoint in {directory}")
        return path
    if choice == "best":
        pointer = directory / BEST_POINTER
        if not pointer.is_file():
            raise ExportError(f"{run_dir} records no best checkpoint ({pointer} does not exist)")
        path = directory / pointer.read_text(encoding="utf-8").strip()
        if not path.is_file():
            raise ExportError(f"{pointer} names {path.name}, which does not exist")
        return path
    path = Path(choice)
    if not path.is_file() and (directory / choice).is_file():
        path = directory / choice  # a bare checkpoint file name
    if not path.is_file():
        raise ExportError(f"unknown checkpoint {choice!r}: use latest, best or the path of a checkpoint file")
    return path


def _from_checkpoint(run_dir: Path, path: Path) -> TrainedModel:
    try:
        state = read_checkpoint(path)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    graph = _graph_file(run_dir)
    have = state.meta.get("graph_fingerprint") if isinstance(state.meta, dict) else None
    if have != graph.fingerprint():
        raise ExportError(f"checkpoint {path} was written for another model graph than "
                          f"{run_dir / names.GRAPH}; export it from the run directory it belongs to")
    layout = ParamLayout(graph)
    flat = state.arrays.get("params")
    if flat is None or flat.ndim != 1 or flat.shape[0] != layout.size:
        size = None if flat is None else flat.size
        raise ExportError(f"checkpoint {path} holds {size} parameter values, the model has {layout.size}")
    views = layout.views(np.ascontiguousarray(flat))
    return TrainedModel(graph, {p.name: views[p.name] for p in graph.params}, path, run_dir)


def _graph_file(run_dir: Path) -> Graph:
    path = run_dir / names.GRAPH
    if not path.is_file():
        raise ExportError(f"{run_dir} has no {names.GRAPH}: not a run directory")
    return _graph_from_text(path.read_text(encoding="utf-8"), path)


def _graph_from_text(text, where: Path) -> Graph:
    try:
        return Graph.from_dict(json.loads(text))
    except (ValueError, GraphError) as e:
        raise ExportError(f"{where}: the model graph cannot be read: {e}") from None


def model_output(graph: Graph, name: str | None = None) -> str:
    """The node whose value is the model's prediction: ``name`` when given, the imported file's
    output for a model that came in as ONNX, else the loss node's first input (logits)."""
    nodes = {n.name for n in graph.nodes}
    if name is not None:
        if name not in nodes:
            raise ExportError(f"--output {name!r} is not a node of the model graph")
        return name
    recorded = graph.meta.get("onnx", {}).get("output") if isinstance(graph.meta.get("onnx"), dict) else None
    if recorded in nodes:
        return recorded
    loss = graph.node(graph.outputs[graph.loss_name])
    first = loss.inputs[0] if loss.inputs else None
    if first not in nodes:
        raise ExportError(f"cannot tell the model output: the loss node {loss.name!r} does not read a "
                          f"node first; name it with --output NODE")
    return first
