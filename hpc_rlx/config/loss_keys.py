"""`model.class_weights`, `model.ignore_index` and `checkpoint.metric` against the model graph:
the cross-entropy the keys weigh (or one error naming the key), and a checkpoint metric the
model reports (`spec.build_spec`, rank 0)."""

from __future__ import annotations

import math

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph.loss_options import loss_head, with_class_weighting

# checkpoint.metric -> what the model must report it for, and what it needs instead
_REPORTS = {
    "val_accuracy": (lambda h: h.kind == "cross_entropy", "reports no accuracy (its loss is not a cross-entropy)"),
    "val_iou": (lambda h: h.reports_iou, "reports no IoU (only a cross-entropy with a label per pixel or voxel does)"),
    "val_mae": (lambda h: h.reports_mae, "reports no MAE (only an MSE loss against float targets does)"),
}


def apply_loss_keys(graph, model_cfg: dict, pipeline_stages: int = 1):
    """The graph whose cross-entropy `model.class_weights` and `model.ignore_index` weigh."""
    weights, ignore = model_cfg.get("class_weights"), model_cfg.get("ignore_index")
    given = [k for k, v in (("model.class_weights", weights), ("model.ignore_index", ignore)) if v is not None]
    if not given:
        return graph
    keys = " and ".join(given)
    head = loss_head(graph)
    if head.kind == "own":
        where = "the ONNX file computes its own loss (x, y -> loss)" if model_cfg.get("name") == "onnx" else \
            "the graph's loss is its own, not a softmax_cross_entropy"
        raise ConfigError(f"{keys}: {where}, which these keys cannot weigh; export the model without its "
                          f"loss (hpc_rlx adds a cross-entropy), or drop {keys}")
    if head.kind != "cross_entropy":
        raise ConfigError(f"{keys} need a cross-entropy loss, but this model's loss is {head.kind} "
                          f"(float targets)")
    if pipeline_stages > 1:
        raise ConfigError(f"{keys} are not supported with parallel.pipeline_stages > 1")
    if weights is not None:
        ok = isinstance(weights, (list, tuple)) and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
            for w in weights)
        if not ok or not any(w > 0 for w in weights):
            raise ConfigError(f"model.class_weights must list non-negative numbers, not all 0, got {weights!r}")
        if len(weights) != head.classes:
            raise ConfigError(f"model.class_weights has {len(weights)} weights, but the model has "
                              f"{head.classes} classes: give one weight per class")
    return with_class_weighting(graph, weights, ignore)


def check_checkpoint_metric(metric: str, graph) -> None:
    """A `checkpoint.metric` the model does not report is one error."""
    if metric in _REPORTS:
        reports, why = _REPORTS[metric]
        if not reports(loss_head(graph)):
            raise ConfigError(f"checkpoint.metric={metric}, but this model {why}; use checkpoint.metric=val_loss")
