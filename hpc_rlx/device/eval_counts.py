"""Validation's additive counts on one lane: what a model with a weighted loss, a label per
pixel (IoU) or float targets (MAE) needs beyond ``loss`` and ``correct``, summed over
evaluation batches here and over ranks by the worker's one Allreduce."""

from __future__ import annotations

import numpy as np

from hpc_rlx.base import backend

# the scalar counts, in the order they travel (then `inter` and `union`, one per class)
SCALARS = ("loss_sum", "weight", "correct", "labelled", "abs_error", "targets")


def evaluate_counts(lane, head, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> dict:
    """The counts of rows ``x``, ``y`` in evaluation batches of ``batch`` rows: the loss summed
    with its mean's weights (the rows, or a weighted loss's summed label weights), their sum,
    and the `LossHead.counts` of each batch."""
    ex, g = lane.executor, lane.executor.graph
    loss_node = g.outputs["loss"]
    fetch = [loss_node] + ([head.output] if head.output in {n.name for n in g.nodes} else [])
    correct_node = g.outputs.get("correct")
    fetch += [correct_node] if correct_node else []
    out = {k: 0.0 for k in SCALARS}
    with backend.use_device(lane.device):
        for lo in range(0, int(x.shape[0]), batch):
            xb, yb = x[lo: lo + batch], y[lo: lo + batch]
            feeds = {"x": lane.xp.asarray(xb), "y": lane.xp.asarray(yb)}
            got = ex.run(lane.param_views, feeds, fetch)
            w = head.weight_of(yb)[0] if head.weighted else float(xb.shape[0])
            out["loss_sum"] += float(got[loss_node]) * w
            out["weight"] += w
            if correct_node:
                out["correct"] += float(got[correct_node])
            if head.output in got:
                for key, value in head.counts(lane.xp, got[head.output], feeds["y"]).items():
                    out[key] = out.get(key, 0) + value
    return out


def pack_counts(total: dict, classes: int) -> np.ndarray:
    """The counts as one float64 vector (the same length on every rank; integer counts stay
    exact below 2**53): `SCALARS`, then `classes` intersections and unions."""
    buf = np.zeros(len(SCALARS) + 2 * classes, dtype=np.float64)
    buf[:len(SCALARS)] = [total.get(k, 0.0) for k in SCALARS]
    if classes:
        buf[len(SCALARS):len(SCALARS) + classes] = total.get("inter", 0)
        buf[len(SCALARS) + classes:] = total.get("union", 0)
    return buf


def unpack_counts(buf: np.ndarray, classes: int) -> dict:
    out = {k: float(v) for k, v in zip(SCALARS, buf)}
    if classes:
        out["inter"] = buf[len(SCALARS):len(SCALARS) + classes].tolist()
        out["union"] = buf[len(SCALARS) + classes:].tolist()
    return out
