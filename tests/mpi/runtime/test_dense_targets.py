"""Dense targets under real mpirun: a weighted cross-entropy with an ignored label over class
axis 1 divides by the global batch's summed label weight, so 1 rank (equal to PyTorch), 2 ranks
and 1 rank x 2 lanes x train.accumulate=2 train the same parameters (float64, to 1e-10) although the ranks hold
different numbers of labelled pixels; validation's IoU and MAE equal NumPy's over the files;
checkpoint.metric=val_iou keeps the best checkpoint by it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.graph import Executor, Graph, ParamLayout, init_params
from tests.support.dense_targets import CLASSES, write_data, write_graph, write_regression
from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi

# data.val_fraction=0.2: rows 8, 9 validate; each of the 3 steps (epochs) is rows 0..7 in some order
ROWS, TRAIN, STEPS, LR = 10, 8, 3, 0.2
COMMON = ["model=graph", "data=file", "train.dtype=float64", f"train.epochs={STEPS}", "train.batch_size=8",
          "data.shuffle=false", f"optim.lr={LR}", "optim.momentum=0.0", "optim.schedule=constant",
          "checkpoint=off", "report.tensorboard=false"]
WEIGHTS = [1.0, 2.5, 0.5]
WEIGHTED = [f"model.class_weights={WEIGHTS}".replace(" ", ""), "model.ignore_index=255"]


def params(run: Path) -> dict:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def rel(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in a)


def forward(run: Path, graph: Path, x: np.ndarray) -> np.ndarray:
    """The trained model's output on `x`, by the NumPy executor (the node the loss reads)."""
    g = Graph.from_file(graph)
    layout = ParamLayout(g)
    flat = np.zeros(layout.size)
    layout.pack(params(run), flat)
    out = g.node(g.outputs["loss"]).inputs[0]
    return Executor(g, np, "float64").run(layout.views(flat), {"x": x}, out)[out]


def torch_reference(graph: Path, data: Path) -> dict:
    """STEPS full-batch SGD steps of the same convolutions in PyTorch, from the same initial
    parameters (train.seed=0), with cross_entropy(weight=, ignore_index=255)."""
    torch = pytest.importorskip("torch")
    g = Graph.from_file(graph)
    layout = ParamLayout(g)
    flat = np.zeros(layout.size)
    init_params(g, flat, 0)
    p = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in layout.views(flat).items()}
    with h5py.File(data, "r") as f:
        x, y = torch.from_numpy(f["x"][:TRAIN]), torch.from_numpy(f["y"][:TRAIN])
    conv = torch.nn.functional.conv2d
    for _ in range(STEPS):
        h = torch.relu(conv(x, p["c1.weight"], p["c1.bias"], padding=1))
        logits = conv(h, p["c2.weight"], p["c2.bias"], padding=1)
        loss = torch.nn.functional.cross_entropy(logits, y, weight=torch.tensor(WEIGHTS, dtype=torch.float64),
                                                 ignore_index=255)
        loss.backward()
        with torch.no_grad():
            for t in p.values():
                t -= LR * t.grad
                t.grad = None
    return {k: t.detach().numpy() for k, t in p.items()}


def test_weighted_ignored_loss_is_the_global_mean_on_ranks_lanes_and_micro_batches(tmp_path):
    graph, data = write_graph(tmp_path / "g.json"), write_data(tmp_path / "d.h5", ROWS)
    base = COMMON + WEIGHTED + [f"model.path={graph}", f"data.path={data}"]
    runs = {}
    # 2 lanes of 2 micro-batches each in one run: a wrong denominator in either shows
    for name, n, extra in [("one", 1, []), ("two", 2, ["checkpoint=default", "checkpoint.metric=val_iou",
                                                      "checkpoint.every_epochs=1"]),
                           ("lanes", 1, ["device.cpu_lanes=2", "train.accumulate=2"]),
                           # cadence's local steps each divide by their own batch's weight: on
                           # one rank they are the sync steps
                           ("cadence", 1, ["policy=cadence"])]:
        runs[name] = tmp_path / name
        proc = train_job(n, runs[name], base + extra, timeout=120)
        assert proc.returncode == 0, explain(proc)
    one = params(runs["one"])
    assert rel(torch_reference(graph, data), one) <= 1e-10       # PyTorch's mean over the batch
    for name in ("two", "lanes", "cadence"):
        assert rel(one, params(runs[name])) <= 1e-10, name
    m1, m2 = read_metrics(runs["one"])[-1], read_metrics(runs["two"])[-1]
    assert abs(m1["train_loss"] - m2["train_loss"]) <= 1e-10 * abs(m1["train_loss"])

    # validation's pixel accuracy and IoU over the validation rows, from the files, by NumPy
    with h5py.File(data, "r") as f:
        x, y = f["x"][TRAIN:], f["y"][TRAIN:]
    pred = forward(runs["two"], graph, x).argmax(axis=1)
    keep = y != 255
    ious = [((pred == c) & (y == c) & keep).sum() / (((pred == c) | (y == c)) & keep).sum() for c in range(CLASSES)]
    assert m2["val_iou"] == pytest.approx(np.mean(ious), rel=1e-12)
    assert m2["val_iou_per_class"] == pytest.approx(ious, rel=1e-12)
    assert m2["val_accuracy"] == pytest.approx(((pred == y) & keep).sum() / keep.sum(), rel=1e-12)
    summary = json.loads((runs["two"] / "summary.json").read_text())
    assert summary["final"]["val_iou_per_class"] == pytest.approx(ious, rel=1e-12)
    # checkpoint.metric=val_iou: the best pointer names the epoch of the highest IoU
    best = (runs["two"] / "checkpoints" / "best").read_text().strip()
    by_step = {r["step"]: r["val_iou"] for r in read_metrics(runs["two"])}
    assert by_step[int(re.search(r"(\d+)", best).group(1))] == max(by_step.values()), (best, by_step)


def test_val_mae_is_numpys_over_the_files(tmp_path):
    graph, data = write_regression(tmp_path / "g.json", tmp_path / "d.h5", ROWS)
    run = tmp_path / "run"
    proc = train_job(2, run, COMMON + [f"model.path={graph}", f"data.path={data}",
                                       "checkpoint=default", "checkpoint.metric=val_mae"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    m = read_metrics(run)[-1]
    with h5py.File(data, "r") as f:
        x, y = f["x"][TRAIN:], f["y"][TRAIN:]
    assert m["val_mae"] == pytest.approx(np.abs(forward(run, graph, x) - y).mean(), rel=1e-12)
    assert "val_accuracy" not in m and "val_iou" not in m


def test_weighted_loss_sharded_overlapped_and_resumed_on_another_world_size_stays_the_global_mean(tmp_path):
    """The denominator travels with every reduction path: the optimizer's state sharded over 2
    ranks, the gradients' Allreduce overlapped with backward, and a run stopped on 2 ranks and
    resumed on 1 all train PyTorch's parameters (float64, to 1e-10)."""
    graph, data = write_graph(tmp_path / "g.json"), write_data(tmp_path / "d.h5", ROWS)
    base = COMMON + WEIGHTED + [f"model.path={graph}", f"data.path={data}"]
    runs = {}
    for name, n, extra in [("one", 1, []), ("sharded", 2, ["comm.shard=optimizer"]),
                           ("overlap", 2, ["comm.overlap=true", "comm.overlap_chunk_mb=0.0001"]),
                           ("resumed", 2, ["checkpoint=default", "checkpoint.every_steps=1", "train.max_steps=2"]),
                           ("resumed", 1, ["checkpoint=default", "checkpoint.every_steps=1"])]:
        runs[name] = tmp_path / name
        proc = train_job(n, runs[name], base + extra, timeout=120)
        assert proc.returncode == 0, explain(proc)
    assert json.loads((runs["resumed"] / "summary.json").read_text())["resumed_from"]
    one = params(runs["one"])
    assert rel(torch_reference(graph, data), one) <= 1e-10       # PyTorch's mean over the batch
    for name in ("sharded", "overlap", "resumed"):
        assert rel(one, params(runs[name])) <= 1e-10, name
