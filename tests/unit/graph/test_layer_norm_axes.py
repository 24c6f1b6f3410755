"""Layer norm over several trailing axes: ``layer_norm`` with ``trailing_axes``
(hpc_rlx/graph/ops/norm.py; gamma and beta have those axes' shape) and the import of ONNX's
LayerNormalization with ``axis`` before the last one: VJPs against finite differences; forward
and gradients against F.layer_norm (float64 <= 1e-10, float32 <= 1e-5 relative to the largest
value); PyTorch's exports of nn.LayerNorm((H, W)) and over three axes, with and without bias,
with both exporters (and TorchScript at opset 16, which writes the normalisation out as
ReduceMean, Sub, Pow, Sqrt, Div), forward against ONNX Runtime and training against PyTorch;
the export of a hand-written graph; refusals; the op on CuPy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout
from hpc_rlx.graph.gradcheck import check_op

from tests.unit.graph.test_onnx_ops import on_numpy_and_cupy, run_op

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.onnx_checks import TOL  # noqa: E402
from tests.unit.graph.test_volume_ops import (  # noqa: E402
    FLOAT32_TOL,
    import_matches_onnxruntime_and_trains_like_torch,
    largest_rel,
)

F = torch.nn.functional
R = np.random.default_rng(41)


def n(*shape):
    return R.standard_normal(shape)


# (x shape, trailing axes, eps)
SHAPES = [
    ((3, 4, 5), 2, 1e-5),
    ((2, 3, 4, 2), 3, 1e-5),
    ((2, 3, 2, 5), 2, 1e-3),
    ((4, 6), 2, 1e-5),   # every axis
    ((3, 2, 7), 1, 1e-5),  # the last axis, as before
]


def case(shape, k, eps):
    dims = shape[len(shape) - k:]
    args = [n(*shape), 1 + 0.3 * n(*dims), n(*dims)]
    attrs = {"eps": eps} if k == 1 else {"eps": eps, "trailing_axes": k}
    return args, attrs, lambda x, g, b: F.layer_norm(x, dims, g, b, eps)


CASES = [case(*s) for s in SHAPES]
IDS = [f"{len(s[0])}d-last{s[1]}" for s in SHAPES]


@pytest.mark.parametrize("args, attrs, fn", CASES, ids=IDS)
def test_vjp_matches_finite_differences(args, attrs, fn):
    assert len(check_op("layer_norm", args, attrs)) == 3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("args, attrs, fn", CASES, ids=IDS)
def test_forward_and_gradients_match_torch(args, attrs, fn, dtype):
    tol = TOL["float64"] if dtype == "float64" else FLOAT32_TOL
    value, _, grads, w = run_op("layer_norm", args, attrs, dtype=dtype)
    assert value.dtype == np.dtype(dtype)
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    ts = [torch.tensor(a, dtype=tdtype, requires_grad=True) for a in args]
    ref = fn(*ts)
    assert largest_rel(value, ref.detach().numpy()) <= tol
    (ref * torch.from_numpy(w.astype(dtype))).sum().backward()
    for i, t in enumerate(ts):
        assert largest_rel(grads[i], t.grad.numpy()) <= tol, (i, largest_rel(grads[i], t.grad.numpy()))


def test_over_two_axes_of_a_batch_last_input():
    """A conv's output is a transposed view (batch innermost): the reductions and the gamma and
    beta sums read it as it is."""
    x = np.ascontiguousarray(n(3, 4, 5, 6).transpose(1, 2, 3, 0)).transpose(3, 0, 1, 2)
    gamma, beta = n(5, 6), n(5, 6)
    b = GraphBuilder()
    b.input("x", [None, 4, 5, 6])
    b.input("w", [None, 4, 5, 6])
    gp, bp = b.param("g", [5, 6], {"scheme": "ones"}), b.param("b", [5, 6], {"scheme": "zeros"})
    out = b.op("layer_norm", "x", gp, bp, name="ln", trailing_axes=2)
    b.output("loss", b.op("sum", b.op("mul", out, "w")))
    g = b.build()
    layout = ParamLayout(g)
    flat, grad = np.zeros(layout.size), np.zeros(layout.size)
    layout.pack({"g": gamma, "b": beta}, flat)
    w = n(3, 4, 5, 6)
    ex = Executor(g, np, "float64")
    value = ex.run(layout.views(flat), {"x": x, "w": w}, "ln")["ln"]
    ex.forward_backward(layout.views(flat), layout.views(grad), {"x": x, "w": w})
    tx, tg, tb = (torch.tensor(np.ascontiguousarray(a), requires_grad=True) for a in (x, gamma, beta))
    ref = F.layer_norm(tx, (5, 6), tg, tb)
    (ref * torch.from_numpy(w)).sum().backward()
    assert largest_rel(value, ref.detach().numpy()) <= TOL["float64"]
    grads = layout.views(grad)
    assert largest_rel(grads["g"], tg.grad.numpy()) <= TOL["float64"]
    assert largest_rel(grads["b"], tb.grad.numpy()) <= TOL["float64"]


# ---------------------------------------------------------------- PyTorch's exports


class Norms(torch.nn.Module):
    """nn.LayerNorm over (H, W) and over (C, H, W) without bias, each after a 1x1 convolution,
    on a (B, 3, 5, 6) input, into a linear head. Weights and biases are random (distinct values:
    the test matches parameters by value)."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.pre = nn.Conv2d(3, 3, 1)
        self.hw = nn.LayerNorm((5, 6))
        self.chw = nn.LayerNorm((3, 5, 6), eps=1e-3, bias=False)
        self.head = nn.Linear(2 * 90, 4)
        with torch.no_grad():
            self.hw.weight.copy_(1 + 0.3 * torch.randn(5, 6))
            self.hw.bias.copy_(0.3 * torch.randn(5, 6))
            self.chw.weight.copy_(1 + 0.3 * torch.randn(3, 5, 6))

    def forward(self, x):
        h = self.pre(x)
        return self.head(torch.cat([self.hw(h).flatten(1), self.chw(torch.tanh(h)).flatten(1)], 1))


@pytest.mark.parametrize("exporter, opset", [("dynamo", None), ("torchscript", None), ("torchscript", 16)])
def test_exports_import_and_train_like_pytorch(tmp_path, exporter, opset):
    torch.manual_seed(7)
    module = Norms().eval()
    x = torch.randn(3, 3, 5, 6, generator=torch.Generator().manual_seed(8))
    path = zoo.export(module, x, tmp_path / "norms.onnx", exporter, "eval", optimize=False, opset=opset)
    file_ops = {nd.op_type for nd in onnx.load(str(path)).graph.node}
    # opset 17 added LayerNormalization; before it TorchScript writes the normalisation out
    decomposed = opset is not None and opset < 17
    assert ("LayerNormalization" in file_ops) != decomposed
    expected = {"mean", "sqrt"} if decomposed else {"layer_norm"}
    imported = import_matches_onnxruntime_and_trains_like_torch(module, x, path, 4, expected)
    if not decomposed:
        g = imported.graph
        assert sorted(g.norm_attrs[nd.name]["trailing_axes"] for nd in g.nodes if nd.op == "layer_norm") == [2, 3]


# ---------------------------------------------------------------- hand-written: exported, refused


def test_a_hand_written_graph_exports_to_onnx_that_onnxruntime_runs_alike():
    from hpc_rlx.export.ir_to_onnx import ir_to_onnx
    from hpc_rlx.export.trained import TrainedModel

    b = GraphBuilder("norms")
    x = b.input("x", [None, 3, 4, 5])
    g, beta = b.param("g", [4, 5], {"scheme": "ones"}), b.param("beta", [4, 5], {"scheme": "zeros"})
    out = b.op("layer_norm", x, g, beta, name="ln", eps=1e-4, trailing_axes=2)
    b.output("loss", b.op("mean", out, name="loss"))
    graph = b.build()
    params = {"g": n(4, 5), "beta": n(4, 5)}
    feed = R.standard_normal((2, 3, 4, 5)).astype(np.float32)
    layout = ParamLayout(graph)
    flat = np.zeros(layout.size, np.float32)
    layout.pack({k: v.astype(np.float32) for k, v in params.items()}, flat)
    ours = Executor(graph, np, "float32").run(layout.views(flat), {"x": feed}, "ln")["ln"]
    model = ir_to_onnx(onnx, TrainedModel(graph, params, Path("model.h5"), Path(".")), "ln")
    ref = ort.InferenceSession(model.SerializeToString()).run(None, {"x": feed})[0]
    assert largest_rel(ours, ref) <= FLOAT32_TOL


def layer_norm_file(x_shape, scale_shape, axis):
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y"], name="the_ln", axis=axis)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape[1:]])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *x_shape[1:]])]
    scale = numpy_helper.from_array(R.standard_normal(scale_shape).astype(np.float32), "scale")
    model = helper.make_model(helper.make_graph([node], "one", inputs, outputs, [scale]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_layer_normalization_files_match_onnxruntime_and_the_batch_axis_is_refused():
    x = R.standard_normal((2, 3, 4, 5)).astype(np.float32)
    for axis, scale in ((-3, (3, 4, 5)), (2, (4, 5)), (-1, (5,))):
        data = layer_norm_file(x.shape, scale, axis)
        imported = import_onnx(data, loss="mse", label_dtype="float")
        g = imported.graph
        layout = ParamLayout(g)
        flat = np.zeros(layout.size, np.float32)
        layout.pack({k: v.astype(np.float32) for k, v in imported.initial.items()}, flat)
        node = g.meta["onnx"]["output_node"]
        ours = Executor(g, np, "float32").run(layout.views(flat), {"x": x}, [node])[node]
        assert largest_rel(ours, ort.InferenceSession(data).run(None, {"x": x})[0]) <= FLOAT32_TOL, axis
    refused = [
        (layer_norm_file(x.shape, (2, 3, 4, 5), 0), r"axes \[0, 1, 2, 3\].*not the batch"),
        (layer_norm_file(x.shape, (1, 5), -2), r"scale and bias must be \(4, 5\)"),
    ]
    for data, message in refused:
        with pytest.raises(GraphError, match=r"ONNX node 'the_ln' \(LayerNormalization\).*" + message):
            import_onnx(data, loss="mse", label_dtype="float")


def test_bad_ir_attributes_and_shapes_name_the_node():
    b = GraphBuilder()
    b.input("x", [None, 3, 4])
    g2, g1 = b.param("g2", [3, 4], {"scheme": "ones"}), b.param("g1", [4], {"scheme": "ones"})
    bad = [
        (lambda: b.op("layer_norm", "x", g2, g2, trailing_axes=3, name="ln"), "node 'ln'.*last 3 dim.*not the batch"),
        (lambda: b.op("layer_norm", "x", g1, g1, trailing_axes=2, name="ln"), r"node 'ln'.*gamma.*\(3, 4\)"),
        (lambda: b.op("layer_norm", "x", g2, g2, trailing_axes=0, name="ln"), "node 'ln'.*positive int"),
        (lambda: b.op("layer_norm", "x", g1, g1, trailing_axes=True, name="ln"), "node 'ln'.*positive int"),
    ]
    for make, message in bad:
        with pytest.raises(GraphError, match=message):
            make()


# ---------------------------------------------------------------- on CuPy


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("args, attrs, fn", CASES, ids=IDS)
def test_cupy_matches_numpy(args, attrs, fn):
    (hv, hg), (dv, dg) = on_numpy_and_cupy("layer_norm", args, attrs)
    assert largest_rel(dv, hv) <= 1e-12 and largest_rel(dg, hg) <= 1e-12
