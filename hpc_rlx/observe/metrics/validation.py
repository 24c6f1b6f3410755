"""The validation metrics: each computed once from validation's additive counts (summed over
the ranks by its one Allreduce, `runtime/worker.py`) and rendered by every output under its
`key` (metrics.jsonl, summary.json, the report, the sweep table), its TensorBoard `tag` and
its progress label.

The counts (`device/eval_counts.py`): ``loss_sum`` and ``weight`` (the rows, or a weighted
loss's summed label weights), ``correct`` and ``labelled`` (positions with a label that is not
`model.ignore_index`), per class ``inter`` and ``union`` (a label per pixel or voxel), and
``abs_error`` and ``targets`` (float targets). A metric the model does not report is absent.
Pure: no MPI.
"""

from __future__ import annotations

from typing import Mapping


class ValMetric:
    key: str = ""
    tag: str = ""

    def value(self, counts: Mapping) -> float | None:
        raise NotImplementedError


class ValLoss(ValMetric):
    """The mean validation loss (a weighted loss: over its summed label weight)."""
    key, tag = "val_loss", "val/loss"

    def value(self, counts):
        return counts["loss_sum"] / counts["weight"] if counts.get("weight") else None


class ValAccuracy(ValMetric):
    """Correct predictions over the labelled positions (pixel accuracy for a label per pixel)."""
    key, tag = "val_accuracy", "val/accuracy"

    def value(self, counts):
        return counts["correct"] / counts["labelled"] if counts.get("labelled") else None


class ValIoU(ValMetric):
    """The mean over classes of intersection over union, of the classes that occur in the
    labels or the predictions (a class in neither has no IoU)."""
    key, tag = "val_iou", "val/iou"

    def value(self, counts):
        per_class = [v for v in iou_per_class(counts) or () if v is not None]
        return sum(per_class) / len(per_class) if per_class else None


class ValMAE(ValMetric):
    """The mean absolute error over every target value."""
    key, tag = "val_mae", "val/mae"

    def value(self, counts):
        return counts["abs_error"] / counts["targets"] if counts.get("targets") else None


VALIDATION: tuple[ValMetric, ...] = (ValLoss(), ValAccuracy(), ValIoU(), ValMAE())
VAL_KEYS: tuple[str, ...] = tuple(m.key for m in VALIDATION)
VAL_TAGS: dict[str, str] = {m.key: m.tag for m in VALIDATION}
PER_CLASS = "val_iou_per_class"     # summary.json and metrics.jsonl: each class's IoU (None: absent)


def iou_per_class(counts: Mapping) -> list | None:
    inter, union = counts.get("inter"), counts.get("union")
    if inter is None:
        return None
    return [float(i) / float(u) if u > 0 else None for i, u in zip(inter, union)]


def val_values(counts: Mapping, reports: tuple[str, ...]) -> dict:
    """The metrics of `reports` (keys of `VALIDATION`) from reduced counts, and each class's IoU
    where val_iou is reported."""
    out = {m.key: m.value(counts) for m in VALIDATION if m.key in reports}
    if "val_iou" in reports:
        out[PER_CLASS] = iou_per_class(counts)
    return out
