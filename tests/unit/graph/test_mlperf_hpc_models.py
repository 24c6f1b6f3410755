"""The import of mini CosmoFlow and mini DeepCAM (tests/support/mlperf_hpc.py) and of the
convolution they need: a Conv with uneven padding (k=2 'same': 0 before, 1 after), as ONNX's
``pads`` or ``auto_pad=SAME_UPPER|SAME_LOWER``, comes in as an explicit zero ``pad`` and a
convolution with the even rest; forward against ONNX Runtime (float32) and against PyTorch's
F.pad + conv (float64, <= 1e-10), gradients against PyTorch autograd; then the two mini models
(the TorchScript exporter writes CosmoFlow's convolutions as SAME_UPPER, the dynamo exporter
as Pad + Conv) against PyTorch in float64: CosmoFlow's MSE loss and every gradient, DeepCAM's
training forward (batch statistics, bilinear resize, atrous convolutions, the normalisation
and the NHWC transpose inside the model).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import mlperf_hpc  # noqa: E402
from tests.support.onnx_checks import param_views, rel  # noqa: E402

F = torch.nn.functional


def conv_file(x_shape, w, attrs, opset=17) -> bytes:
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="the_conv", **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape[1:]])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"d{i}" for i in range(len(x_shape))])]
    model = helper.make_model(helper.make_graph([node], "one", inputs, outputs, [numpy_helper.from_array(w, "w")]),
                              opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def torch_pads(begin, end) -> list:
    """F.pad's order: the last axis first, (before, after) each."""
    return [p for b, e in reversed(list(zip(begin, end))) for p in (b, e)]


# (x shape, kernel, attrs, (begin, end) pads as ONNX Runtime applies them)
UNEVEN = [
    ((2, 3, 6, 5, 7), (2, 2, 2), {"auto_pad": "SAME_UPPER"}, ([0, 0, 0], [1, 1, 1])),      # CosmoFlow's
    ((2, 3, 6, 5, 7), (2, 3, 2), {"auto_pad": "SAME_LOWER"}, ([1, 1, 1], [0, 1, 0])),
    ((2, 3, 7, 6), (2, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, ([0, 0], [1, 0])),
    ((2, 3, 6, 7), (3, 2), {"pads": [2, 0, 1, 1]}, ([2, 0], [1, 1])),
    ((2, 3, 5, 4, 6), (3, 2, 2), {"pads": [1, 0, 2, 2, 1, 0], "dilations": [1, 2, 1]}, ([1, 0, 2], [2, 1, 0])),
]


@pytest.mark.parametrize("x_shape, kernel, attrs, pads", UNEVEN)
def test_a_conv_with_uneven_padding_is_a_pad_and_a_conv_exactly(x_shape, kernel, attrs, pads):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((4, x_shape[1], *kernel)).astype(np.float32)
    data = conv_file(x_shape, w, attrs)
    imported = import_onnx(data, loss="mse", label_dtype="float")
    g = imported.graph
    assert "pad" in {n.op for n in g.nodes}
    node = g.meta["onnx"]["output_node"]
    layout, flat = param_views(imported, g, "float32")
    ours32 = Executor(g, np, "float32").run(layout.views(flat), {"x": x.astype(np.float32)}, [node])[node]
    assert rel(ours32, ort.InferenceSession(data).run(None, {"x": x.astype(np.float32)})[0]) <= 1e-5

    # float64: the value and the gradients of an MSE against PyTorch's explicit pad + conv
    conv = {4: F.conv2d, 5: F.conv3d}[len(x_shape)]
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w.astype(np.float64), requires_grad=True)
    ref = conv(F.pad(xt, torch_pads(*pads)), wt, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1))
    target = torch.tensor(rng.standard_normal(tuple(ref.shape)))
    loss = F.mse_loss(ref, target)
    loss.backward()
    layout, flat = param_views(imported, g, "float64")
    grads = np.zeros_like(flat)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grads),
                                                      {"x": x, "y": target.numpy()}, train=True)
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-12)
    (wname,) = [p.name for p in g.params if p.trainable]
    assert rel(layout.views(grads)[wname], wt.grad.numpy()) <= 1e-10


def test_pooling_with_uneven_padding_is_refused_at_the_node():
    x_shape = (2, 3, 6, 5, 7)
    node = helper.make_node("MaxPool", ["x"], ["y"], name="the_pool", kernel_shape=[2, 2, 2], auto_pad="SAME_UPPER")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape[1:]])]
    model = helper.make_model(helper.make_graph([node], "one", inputs,
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3, 6, 5, 7])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(GraphError, match=r"ONNX node 'the_pool' \(MaxPool\).*uneven padding \(auto_pad=SAME_UPPER"):
        import_onnx(model.SerializeToString(), loss="mse", label_dtype="float")


def _float64_grads(imported, feeds):
    g = imported.graph
    layout, flat = param_views(imported, g, "float64")
    grads = np.zeros_like(flat)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grads), feeds, train=True)
    return out["loss"], layout.views(grads)


def test_mini_cosmoflow_imports_from_torchscript_same_padding_and_trains_like_pytorch(tmp_path):
    torch.manual_seed(0)
    module = mlperf_hpc.MiniCosmoFlow(dropout=0.0)
    rng = np.random.default_rng(1)
    samples = [mlperf_hpc.cosmoflow_sample(rng) for _ in range(3)]
    x = np.stack([s[0] for s in samples])                  # int16 counts, as the files hold them
    y = np.stack([s[1] for s in samples]).astype(np.float64)
    path = mlperf_hpc.export(module, torch.from_numpy(x[:2].astype(np.float32)), tmp_path / "cf.onnx", "torchscript")
    assert {a.s for n in onnx.load(str(path)).graph.node if n.op_type == "Conv" for a in n.attribute
            if a.name == "auto_pad"} == {b"SAME_UPPER"}
    imported = import_onnx(str(path), loss="mse", label_dtype="float")
    loss, grads = _float64_grads(imported, {"x": x.astype(np.float64), "y": y})

    tm = module.double().train()
    ref = F.mse_loss(tm(torch.from_numpy(x.astype(np.float64))), torch.from_numpy(y))
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-10)
    named = dict(tm.named_parameters())
    assert set(grads) == set(named)
    for name, p in named.items():
        assert rel(grads[name], p.grad.numpy()) <= 1e-10, name


def test_mini_deepcam_imports_and_its_training_forward_equals_pytorch(tmp_path):
    rng = np.random.default_rng(2)
    minval = (10.0 ** rng.uniform(-3, 4, 16)).astype(np.float32)
    maxval = minval * 10
    torch.manual_seed(0)
    module = mlperf_hpc.MiniDeepCAM(minval, maxval)
    x = np.stack([mlperf_hpc.deepcam_sample(rng, minval, maxval)[0] for _ in range(2)]).astype(np.float64)
    path = mlperf_hpc.export(module, torch.from_numpy(x.astype(np.float32)), tmp_path / "dc.onnx", "torchscript")
    imported = import_onnx(str(path), loss="cross_entropy", label_dtype="int64")
    g = imported.graph
    # the statistics are constants: the trainable parameters are the module's
    assert {p.name for p in g.params if p.trainable} == {k for k, _ in module.named_parameters()}
    assert {"resize", "conv2d", "batch_norm", "transpose"} <= {n.op for n in g.nodes}
    assert any(n.attrs.get("dilation") for n in g.nodes if n.op == "conv2d")
    node = g.meta["onnx"]["output_node"]
    layout, flat = param_views(imported, g, "float64")
    ours = Executor(g, np, "float64").run(layout.views(flat), {"x": x}, [node], train=True)[node]
    with torch.no_grad():
        ref = mlperf_hpc.as_imported(module).train()(torch.from_numpy(x)).numpy()
    assert ours.shape == (2, mlperf_hpc.DEEPCAM_CLASSES, *mlperf_hpc.DEEPCAM_SHAPE[:2])
    assert rel(ours, ref) <= 1e-10


def test_the_export_check_feeds_a_model_of_logarithms_non_negative_inputs(tmp_path):
    """`python -m hpc_rlx.export`'s ONNX Runtime check draws a random batch; a model that takes
    log(1 + x) of its input (CosmoFlow) is NaN on negative draws, so the check draws again from
    non-negative values instead of failing the export (it failed with 'differs by nan')."""
    from hpc_rlx.export.ir_to_onnx import needed_by
    from hpc_rlx.export.trained import TrainedModel
    from hpc_rlx.export.verify import check_with_runtime

    class LogLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(torch.log1p(x))

    path = mlperf_hpc.export(LogLinear(), torch.rand(2, 6), tmp_path / "log.onnx", "torchscript")
    imported = import_onnx(str(path), loss="mse", label_dtype="float")
    g = imported.graph
    node = g.meta["onnx"]["output_node"]
    trained = TrainedModel(g, {k: v.astype(np.float32) for k, v in imported.initial.items()}, path, tmp_path)
    diff = check_with_runtime(onnx.load(str(path)), trained, node, {"x": "x"}, needed_by(g, node))
    assert diff is not None and diff <= 1e-5
