"""Cross-entropy over class axis 1 (images, volumes) and the last axis (sequences), with class
weights and an ignored label, against PyTorch's `cross_entropy` in float64; the dense metrics'
counts against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout
from hpc_rlx.graph.gradcheck import check_grads
from hpc_rlx.graph.ops.loss import iou_counts, label_weight

torch = pytest.importorskip("torch")
F = torch.nn.functional

CASES = [  # (logits shape, labels shape, class axis of the logits)
    ((3, 4, 5, 6), (3, 5, 6), 1),          # (B, C, H, W)
    ((2, 3, 4, 5, 3), (2, 4, 5, 3), 1),    # (B, C, D, H, W)
    ((3, 7, 5), (3, 7), -1),               # (B, T, V): a language model, classes last
    ((6, 4), (6,), 1),                     # (B, C)
]


def ce_graph(logits_shape, labels_shape, **attrs):
    b = GraphBuilder()
    z = b.param("z", list(logits_shape), {"scheme": "zeros"})
    b.input("y", list(labels_shape), "int64")
    b.output("loss", b.op("softmax_cross_entropy", z, "y", name="xent", **attrs))
    b.output("correct", b.op("correct_count", z, "y", name="correct", **attrs))
    return b.build()


def run(g, z, y):
    layout = ParamLayout(g)
    flat, grad = z.reshape(-1).copy(), np.zeros(z.size)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grad), {"y": y})
    return out, grad.reshape(z.shape)


def labels_for(rng, shape, classes, ignore):
    y = rng.integers(0, classes, shape)
    if ignore is not None:
        y[rng.random(shape) < 0.3] = ignore
    return y


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("ignore", [None, 255, -100, 1])
@pytest.mark.parametrize("zs,ys,axis", CASES)
def test_matches_torch(zs, ys, axis, weights, ignore):
    rng = np.random.default_rng(sum(zs) + abs(ignore or 0))
    c = zs[axis]
    w = list(rng.uniform(0.2, 3.0, c)) if weights else None
    z = 3 * rng.standard_normal(zs)
    y = labels_for(rng, ys, c, ignore)
    g = ce_graph(zs, ys, weights=w, ignore_index=ignore)
    assert g.num_classes == c
    out, grad = run(g, z, y)
    tz = torch.tensor(z, requires_grad=True)
    torch_in = tz if axis == 1 else tz.movedim(-1, 1)
    ref = F.cross_entropy(torch_in, torch.from_numpy(y),
                          weight=None if w is None else torch.tensor(w, dtype=torch.float64),
                          ignore_index=-100 if ignore is None else ignore)
    ref.backward()
    assert abs(out["loss"] - ref.item()) <= 1e-12 * max(1.0, abs(ref.item()))
    np.testing.assert_allclose(grad, tz.grad.numpy(), rtol=0, atol=1e-12)
    pred = torch_in.argmax(1).numpy()
    keep = np.ones(y.shape, bool) if ignore is None else y != ignore
    assert out["correct"] == int(((pred == y) & keep).sum())


def test_gradcheck_weighted_and_ignored():
    rng = np.random.default_rng(0)
    g = ce_graph((2, 3, 4, 2), (2, 4, 2), weights=[0.5, 2.0, 1.0], ignore_index=255)
    y = labels_for(rng, (2, 4, 2), 3, 255)
    check_grads(g, {"z": rng.standard_normal((2, 3, 4, 2))}, {"y": y}, rtol=1e-6, atol=1e-9)


def test_unweighted_class_last_keeps_its_bits():
    """No weights, no ignored label: the language model's loss is the same expression as before."""
    rng = np.random.default_rng(1)
    z, y = rng.standard_normal((3, 5, 7)), rng.integers(0, 7, (3, 5))
    out, _ = run(ce_graph((3, 5, 7), (3, 5)), z, y)
    zz = z.reshape(-1, 7) - z.reshape(-1, 7).max(axis=1, keepdims=True)
    picked = zz[np.arange(15), y.reshape(-1)]
    assert out["loss"] == float((np.log(np.exp(zz).sum(axis=1)) - picked).sum() * (1.0 / 15))


def test_all_positions_ignored_give_zero_not_nan():
    out, grad = run(ce_graph((2, 3, 2), (2, 2), axis=1, ignore_index=-100), np.ones((2, 3, 2)), np.full((2, 2), -100))
    assert out["loss"] == 0.0 and not grad.any() and out["correct"] == 0


def test_ambiguous_shapes_say_how_to_resolve():
    with pytest.raises(GraphError, match="axis=1 or axis=-1"):
        ce_graph((2, 4, 4), (2, 4))
    assert ce_graph((2, 4, 4), (2, 4), axis=1).num_classes == 4
    with pytest.raises(GraphError, match="must match logits"):
        ce_graph((2, 4, 5), (2, 3))
    with pytest.raises(GraphError, match="2 class weights for 4 classes"):
        ce_graph((2, 4, 5), (2, 5), weights=[1.0, 2.0])


def test_label_weight_and_iou_counts_match_numpy():
    rng = np.random.default_rng(2)
    z, y = rng.standard_normal((4, 3, 5, 5)), labels_for(rng, (4, 5, 5), 3, 255)
    w, total = label_weight(np, y, [1.0, 2.0, 0.5], 255)
    keep = y != 255
    assert total == pytest.approx(np.array([1.0, 2.0, 0.5])[y[keep]].sum(), rel=1e-15)
    inter, union = iou_counts(np, z, y, {"axis": None, "ignore_index": 255}, 3)
    pred = z.argmax(1)
    for c in range(3):
        assert inter[c] == ((pred == c) & (y == c) & keep).sum()
        assert union[c] == (((pred == c) | (y == c)) & keep).sum()


def test_onnx_loss_head_takes_the_class_axis_from_the_labels():
    onnx = pytest.importorskip("onnx")
    from hpc_rlx.graph.onnx.importer import import_onnx
    h = onnx.helper

    def scaled(shape):      # logits = x * w, w broadcast over the batch
        w = onnx.numpy_helper.from_array(np.full([1] + shape[1:], 0.5, np.float32), "w")
        graph = h.make_graph([h.make_node("Mul", ["x", "w"], ["logits"])], "m",
                             [h.make_tensor_value_info("x", 1, ["batch"] + shape[1:])],
                             [h.make_tensor_value_info("logits", 1, ["batch"] + shape[1:])], [w])
        return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()

    g = import_onnx(scaled([0, 3, 4, 5]), label_shape=[4, 5]).graph       # (B, C, H, W) images
    assert g.input("y").shape == (None, 4, 5) and g.num_classes == 3 and g.predictions_per_sample == 20
    g = import_onnx(scaled([0, 4, 5, 3]), label_shape=[4, 5]).graph       # classes last
    assert g.num_classes == 3
    with pytest.raises(GraphError, match="model.class_axis"):
        import_onnx(scaled([0, 4, 4]), label_shape=[4])
    g = import_onnx(scaled([0, 4, 4]), label_shape=[4], class_axis=1).graph
    assert g.num_classes == 4 and g.node(g.outputs["loss"]).attrs == {"axis": 1}
