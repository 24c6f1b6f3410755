"""A model's loss head as the runtime sees it: the class weights and the ignored label of its
cross-entropy (`with_class_weighting`, set from `model.class_weights` / `model.ignore_index`),
and which dense metrics it reports (`LossHead`). Pure graph work: no config, no MPI."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpc_rlx.base import backend
from hpc_rlx.graph.ir import LOSS, Graph
from hpc_rlx.graph.ops.loss import class_axis, iou_counts, label_weight, labelled_count

LABEL_OPS = ("softmax_cross_entropy", "correct_count")


@dataclass(frozen=True)
class LossHead:
    """What the runtime needs of a graph's loss: its kind, the logits (or prediction) and label
    nodes, and a cross-entropy's class axis, classes, weights and ignored label."""
    kind: str                       # "cross_entropy", "mse" or "own" (a graph's own loss)
    output: str | None = None       # the logits / prediction node the loss reads
    labels: str | None = None       # the label / target input
    axis: int | None = None
    classes: int | None = None
    weights: tuple | None = None
    ignore_index: int | None = None
    spatial: bool = False           # labels with dims beyond the batch: images, volumes

    @property
    def weighted(self) -> bool:
        """The mean's denominator is not the sample count: the runtime forms it globally."""
        return self.weights is not None or self.ignore_index is not None

    @property
    def reports_iou(self) -> bool:
        """A dense classification (a label per pixel or voxel, classes on axis 1 or last of at
        least 4 dims): its validation reports the mean IoU over classes."""
        return self.kind == "cross_entropy" and self.spatial and (self.axis == 1 or self.classes_last_image)

    @property
    def classes_last_image(self) -> bool:
        return self.axis is not None and self.axis >= 3

    @property
    def reports_mae(self) -> bool:
        return self.kind == "mse"

    @property
    def reports(self) -> tuple[str, ...]:
        """The validation metrics it reports (`observe/metrics/validation.py`)."""
        if self.kind == "cross_entropy":
            return ("val_loss", "val_accuracy") + (("val_iou",) if self.reports_iou else ())
        return ("val_loss", "val_mae") if self.kind == "mse" else ("val_loss",)

    @property
    def counts_validation(self) -> bool:
        """Validation needs counts beyond the loss and the correct predictions."""
        return self.weighted or self.reports_iou or self.reports_mae

    def weight_of(self, labels) -> tuple[float, int]:
        """(the summed weight of ``labels``' labelled positions, how many are labelled): a
        batch's share of the mean's denominator, and of the accuracy's."""
        _, total = label_weight(np, np.asarray(labels), self.weights, self.ignore_index)
        return float(total), labelled_count(np, labels, self.ignore_index)

    def counts(self, xp, output, labels) -> dict:
        """The additive validation counts beyond loss and correct: per-class IoU's intersection
        and union, the labelled positions, or the absolute error's sum and count."""
        if self.kind == "mse":
            return {"abs_error": float(xp.abs(output - labels).sum()), "targets": int(labels.size)}
        if self.kind != "cross_entropy":
            return {}
        out = {"labelled": labelled_count(xp, labels, self.ignore_index)}
        if self.reports_iou:
            attrs = {"axis": self.axis, "ignore_index": self.ignore_index}
            inter, union = iou_counts(xp, output, labels, attrs, self.classes)
            out["inter"], out["union"] = backend.to_numpy(inter), backend.to_numpy(union)
        return out


def loss_head(graph: Graph) -> LossHead:
    """The `LossHead` of a whole graph (a pipeline stage without the loss: kind "own")."""
    if LOSS not in getattr(graph, "outputs", {}):
        return LossHead("own")
    node = graph.node(graph.outputs[LOSS])
    if node.op == "mse":
        return LossHead("mse", node.inputs[0], node.inputs[1])
    if node.op != "softmax_cross_entropy":
        return LossHead("own")
    a = graph.norm_attrs[node.name]
    logits, labels = (graph.types[r].shape for r in node.inputs)
    axis = class_axis(logits, labels, a["axis"])
    weights = None if a["weights"] is None else tuple(float(w) for w in a["weights"])
    return LossHead("cross_entropy", node.inputs[0], node.inputs[1], axis, logits[axis], weights,
                    a["ignore_index"], len(labels) > 1)


def with_class_weighting(graph: Graph, weights=None, ignore_index=None) -> Graph:
    """`graph` with its cross-entropy (and the accuracy count over the same logits) weighted by
    class and leaving out label `ignore_index`; the graph itself where both are None."""
    if weights is None and ignore_index is None:
        return graph
    head = loss_head(graph)
    if head.kind != "cross_entropy":
        raise ValueError(f"the loss is not a cross-entropy ({head.kind})")
    loss_inputs = list(graph.node(graph.outputs[LOSS]).inputs)
    d = graph.to_dict()
    for node in d["nodes"]:
        if node["op"] in LABEL_OPS and node["inputs"] == loss_inputs:
            if weights is not None and node["op"] == "softmax_cross_entropy":
                node["attrs"]["weights"] = [float(w) for w in weights]
            if ignore_index is not None:
                node["attrs"]["ignore_index"] = int(ignore_index)
    return Graph.from_dict(d)


def weighted_loss(graph_dict: dict) -> bool:
    """Whether a graph's JSON form (a spec's) has a cross-entropy with class weights or an
    ignored label, without building the graph."""
    name = graph_dict.get("outputs", {}).get(LOSS)
    node = next((n for n in graph_dict.get("nodes", ()) if n["name"] == name), None)
    attrs = (node or {}).get("attrs") or {}
    return (node or {}).get("op") == "softmax_cross_entropy" and (
        attrs.get("weights") is not None or attrs.get("ignore_index") is not None)
