"""model.class_weights / model.ignore_index against the model graph, checkpoint.metric against
what it reports, and the label checks that exempt the ignored label (no MPI)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpc_rlx.checkpoint.retention import metric_mode
from hpc_rlx.config.loss_keys import apply_loss_keys, check_checkpoint_metric
from hpc_rlx.data.hdf5 import Classes, check_values
from hpc_rlx.data.resolve import label_classes
from hpc_rlx.base.errors import ConfigError, DataError
from hpc_rlx.graph import Graph, build_model
from hpc_rlx.graph.loss_options import loss_head
from hpc_rlx.observe.metrics.validation import val_values
from hpc_rlx.observe.progress import end_line
from hpc_rlx.observe.sweep_table import collect, render
from tests.support.dense_targets import write_graph, write_regression


def own_loss_graph() -> Graph:
    """An ONNX file computing its own loss, (x, target) -> a scalar mean, imported."""
    onnx = pytest.importorskip("onnx")
    from hpc_rlx.graph.onnx.importer import import_onnx
    h = onnx.helper
    nodes = [h.make_node("MatMul", ["x", "w"], ["pred"]), h.make_node("Sub", ["pred", "target"], ["d"]),
             h.make_node("Mul", ["d", "d"], ["sq"]), h.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph = h.make_graph(nodes, "own", [h.make_tensor_value_info("x", 1, ["batch", 3]),
                                        h.make_tensor_value_info("target", 1, ["batch", 2])],
                         [h.make_tensor_value_info("loss", 1, [])],
                         [onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    return import_onnx(model.SerializeToString()).graph


def test_the_keys_weigh_the_cross_entropy_and_its_accuracy(tmp_path):
    g = Graph.from_file(write_graph(tmp_path / "g.json"))
    w = apply_loss_keys(g, {"class_weights": [1, 2, 0.5], "ignore_index": 255})
    head = loss_head(w)
    assert head.weights == (1.0, 2.0, 0.5) and head.ignore_index == 255 and head.weighted and head.reports_iou
    assert w.node(w.outputs["correct"]).attrs == {"ignore_index": 255}
    assert apply_loss_keys(g, {"class_weights": None, "ignore_index": None}) is g


@pytest.mark.parametrize("cfg,graph,words", [
    ({"class_weights": [1.0, 2.0]}, "seg", "model.class_weights has 2 weights, but the model has 3 classes"),
    ({"class_weights": [0, 0, 0]}, "seg", "not all 0"),
    ({"ignore_index": 255}, "own", "model.ignore_index: the ONNX file computes its own loss"),
    ({"class_weights": [1, 1, 1], "ignore_index": 0}, "own",
     "model.class_weights and model.ignore_index: the ONNX file computes its own loss"),
    ({"ignore_index": 255}, "mse", "need a cross-entropy loss"),
])
def test_each_misuse_is_one_error_naming_the_key(tmp_path, cfg, graph, words):
    g = {"seg": lambda: Graph.from_file(write_graph(tmp_path / "g.json")), "own": own_loss_graph,
         "mse": lambda: Graph.from_file(write_regression(tmp_path / "r.json", tmp_path / "r.h5", 4)[0])}[graph]()
    with pytest.raises(ConfigError, match=words):
        apply_loss_keys(g, dict(cfg, name="onnx" if graph == "own" else "graph"))


def test_checkpoint_metric_must_be_reported(tmp_path):
    seg = Graph.from_file(write_graph(tmp_path / "g.json"))
    reg = Graph.from_file(write_regression(tmp_path / "r.json", tmp_path / "r.h5", 4)[0])
    mlp = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[4])
    check_checkpoint_metric("val_iou", seg)
    check_checkpoint_metric("val_mae", reg)
    for metric, graph in (("val_iou", mlp), ("val_mae", seg), ("val_accuracy", reg), ("val_iou", reg)):
        with pytest.raises(ConfigError, match=f"checkpoint.metric={metric}, but this model reports no"):
            check_checkpoint_metric(metric, graph)
    assert metric_mode("val_iou") == "max" and metric_mode("val_mae") == "min"


def test_labels_outside_the_classes_are_caught_in_a_pixel_map_but_not_the_ignored_one(tmp_path):
    y = np.zeros((3, 4, 4), np.int64)
    y[1, 2, 3] = 255
    check_values(np.zeros((3, 1)), y, Classes(3, 255), False)
    with pytest.raises(DataError, match=r"label 255 at row 11 \(position \(2, 3\)\) is outside \[0, 3\)"):
        check_values(np.zeros((3, 1)), y, 3, False, first_row=10)
    y[2, 0, 1] = 7
    with pytest.raises(DataError, match=r"label 7 at row 2 \(position \(0, 1\)\).*model.ignore_index=255 is exempt"):
        check_values(np.zeros((3, 1)), y, Classes(3, 255), False)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = np.zeros((3, 1)), np.where(y == 7, -100, y)
    with pytest.raises(DataError, match="negative"):
        label_classes(tmp_path / "d.h5", "y", 3)
    assert label_classes(tmp_path / "d.h5", "y", 3, ignore=-100)[0] == 256      # 255 is a class here


def test_validation_metrics_and_where_they_are_rendered(tmp_path):
    counts = {"loss_sum": 6.0, "weight": 3.0, "correct": 5, "labelled": 8, "inter": [2, 0, 3],
              "union": [4, 0, 6], "abs_error": 1.5, "targets": 6}
    v = val_values(counts, ("val_loss", "val_accuracy", "val_iou"))
    assert v == {"val_loss": 2.0, "val_accuracy": 0.625, "val_iou": 0.5, "val_iou_per_class": [0.5, None, 0.5]}
    assert val_values(counts, ("val_loss", "val_mae"))["val_mae"] == 0.25
    for name, final in (("seg", {"val_loss": 1.0, "val_accuracy": 0.5, "val_iou": 0.25}),
                        ("reg", {"val_loss": 2.0, "val_mae": 0.75})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"final": final, "status": "completed"}))
    table = render(collect(tmp_path))
    assert "| val_loss | val_accuracy | val_iou | val_mae | train_loss |" in table
    assert "| 0.2500 | - |" in table and "| - | - | 0.7500 |" in table
    assert "val_iou 0.25" in end_line("completed", 1.0, {"val_iou": 0.25, "val_mae": None}, "d")
