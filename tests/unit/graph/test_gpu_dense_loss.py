"""The dense cross-entropy (class axis 1, class weights, an ignored label) and its IoU counts on
CuPy match NumPy (needs a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout
from hpc_rlx.graph.ops.loss import iou_counts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device"),
]


@pytest.mark.parametrize("zs,ys", [((3, 4, 5, 6), (3, 5, 6)), ((2, 3, 4, 3, 5), (2, 4, 3, 5))])
def test_weighted_ignored_cross_entropy_on_cupy_matches_numpy(zs, ys):
    cp = backend.get_xp("cuda")
    b = GraphBuilder()
    z = b.param("z", list(zs), {"scheme": "zeros"})
    b.input("y", list(ys), "int64")
    attrs = {"weights": [0.5, 2.0, 1.0, 3.0][:zs[1]], "ignore_index": 255}
    b.output("loss", b.op("softmax_cross_entropy", z, "y", **attrs))
    b.output("correct", b.op("correct_count", z, "y", ignore_index=255))
    g = b.build()
    rng = np.random.default_rng(0)
    zv, y = rng.standard_normal(zs), rng.integers(0, zs[1], ys)
    y[rng.random(ys) < 0.3] = 255
    layout = ParamLayout(g)
    outs, grads = [], []
    for xp in (np, cp):
        flat, grad = xp.asarray(zv.reshape(-1).copy()), xp.zeros(zv.size)
        out = Executor(g, xp, "float64").forward_backward(layout.views(flat), layout.views(grad), {"y": xp.asarray(y)})
        outs.append(out)
        grads.append(grad.get() if xp is cp else grad)
    assert abs(outs[0]["loss"] - outs[1]["loss"]) <= 1e-12 and outs[0]["correct"] == outs[1]["correct"]
    np.testing.assert_allclose(grads[1], grads[0], rtol=0, atol=1e-12)
    a = {"axis": None, "ignore_index": 255}
    for host, dev in zip(iou_counts(np, zv, y, a, zs[1]), iou_counts(cp, cp.asarray(zv), cp.asarray(y), a, zs[1])):
        np.testing.assert_array_equal(host, dev.get())
