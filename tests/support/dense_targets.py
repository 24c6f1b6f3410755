"""A tiny segmentation task for the dense-target tests: a graph JSON file (two 3x3 convolutions,
(B, 2, 8, 8) images to (B, 3, 8, 8) logits, cross-entropy over class axis 1) and an HDF5 file
of images and per-pixel labels, some pixels carrying an ignored label, unevenly over the rows."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from hpc_rlx.graph import GraphBuilder

CLASSES, SIDE = 3, 8


def write_graph(path: Path) -> Path:
    b = GraphBuilder("tiny_seg")
    x = b.input("x", [None, 2, SIDE, SIDE])
    y = b.input("y", [None, SIDE, SIDE], "int64")
    w1 = b.param("c1.weight", [4, 2, 3, 3], {"scheme": "he_normal", "fan_in": 18})
    b1 = b.param("c1.bias", [4], {"scheme": "zeros"})
    w2 = b.param("c2.weight", [CLASSES, 4, 3, 3], {"scheme": "he_normal", "fan_in": 36})
    b2 = b.param("c2.bias", [CLASSES], {"scheme": "zeros"})
    h = b.op("relu", b.op("conv2d", x, w1, b1, name="c1", padding=1), name="a1")
    logits = b.op("conv2d", h, w2, b2, name="logits", padding=1)
    b.output("loss", b.op("softmax_cross_entropy", logits, y, name="xent"))
    b.output("correct", b.op("correct_count", logits, y, name="correct"))
    b.build().to_file(path)
    return path


def write_data(path: Path, rows: int, seed: int = 0, ignore: int | None = 255) -> Path:
    """Images whose per-pixel class follows the first channel's level; the ignored label on a
    share of pixels that grows with the row (uneven over ranks), none in the first row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 2, SIDE, SIDE))
    y = np.digitize(x[:, 0], [-0.5, 0.5]).astype(np.int64)
    if ignore is not None:
        share = np.linspace(0.0, 0.6, rows)[:, None, None]
        y[rng.random(y.shape) < share] = ignore
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
        f.attrs["num_classes"] = CLASSES
    return path


def write_regression(graph_path: Path, data_path: Path, rows: int, seed: int = 1) -> tuple[Path, Path]:
    """A per-pixel regression: one 3x3 convolution, (B, 2, 8, 8) to (B, 1, 8, 8), MSE against
    float targets; and its data."""
    b = GraphBuilder("tiny_regression")
    x = b.input("x", [None, 2, SIDE, SIDE])
    y = b.input("y", [None, 1, SIDE, SIDE])
    w = b.param("c.weight", [1, 2, 3, 3], {"scheme": "he_normal", "fan_in": 18})
    bias = b.param("c.bias", [1], {"scheme": "zeros"})
    b.output("loss", b.op("mse", b.op("conv2d", x, w, bias, name="pred", padding=1), y, name="mse"))
    b.build().to_file(graph_path)
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((rows, 2, SIDE, SIDE))
    with h5py.File(data_path, "w") as f:
        f["x"], f["y"] = xs, 0.5 * xs[:, :1] - 0.25 * xs[:, 1:] + 0.1 * rng.standard_normal((rows, 1, SIDE, SIDE))
    return graph_path, data_path
