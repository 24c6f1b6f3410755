"""3-D convolution and pooling: ``conv2d``, ``max_pool2d`` and ``avg_pool2d`` on volumes
(B, C, D, H, W) (hpc_rlx/graph/ops/conv.py, pool.py: the image code over any spatial rank) and
the import of ONNX's rank-5 Conv, MaxPool, AveragePool and GlobalAveragePool: VJPs against
finite differences; forward and gradients against F.conv3d, F.max_pool3d and F.avg_pool3d
(float64 <= 1e-10, float32 <= 1e-5 relative to the largest value); PyTorch's exports of
nn.Conv3d (stride, padding, dilation, groups, with and without bias), nn.MaxPool3d, nn.AvgPool3d
(count_include_pad either way) and nn.AdaptiveAvgPool3d(1) with both exporters, forward against
ONNX Runtime and training against PyTorch; the export of a hand-written 3-D graph; refusals; the
same ops on CuPy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout
from hpc_rlx.graph.gradcheck import check_op
from hpc_rlx.graph.params import default_fans

from tests.unit.graph.test_onnx_ops import on_numpy_and_cupy, run_op

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.onnx_checks import TOL, _match, ours_forward, param_views  # noqa: E402

F = torch.nn.functional
R = np.random.default_rng(31)
FLOAT32_TOL = 1e-5


def n(*shape):
    return R.standard_normal(shape)


def largest_rel(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def listed(v):
    return list(v) if isinstance(v, tuple) else v


# ---------------------------------------------------------------- the cases

CONV3D = [  # (x shape, weight shape, bias, stride, padding, dilation, groups)
    ((2, 3, 5, 4, 6), (4, 3, 3, 2, 3), True, 1, 1, 1, 1),
    ((2, 4, 6, 5, 7), (6, 2, 3, 3, 2), True, (2, 1, 2), (1, 0, 1), (1, 2, 1), 2),
    ((1, 3, 5, 6, 5), (3, 1, 3, 3, 3), False, 1, (2, 1, 1), (2, 1, 1), 3),   # depthwise, dilated
    ((2, 2, 4, 5, 4), (3, 2, 1, 1, 1), False, (1, 2, 1), 0, 1, 1),          # 1x1x1, strided
    ((2, 2, 4, 4, 5), (2, 2, 2, 3, 2), True, 3, (0, 2, 1), 1, 1),           # padding wider than needed
]

MAX_POOL3D = [  # (x shape, kernel, stride, padding, dilation)
    ((2, 3, 4, 6, 6), 2, None, 0, 1),              # tiles the input
    ((2, 2, 5, 6, 7), 3, (2, 1, 2), 1, 1),         # overlapping, padded
    ((1, 2, 7, 6, 5), (3, 2, 2), 1, (1, 1, 0), (2, 1, 2)),  # dilated
]

AVG_POOL3D = [  # (x shape, kernel, stride, padding, count_include_pad)
    ((2, 3, 4, 6, 6), 2, None, 0, True),
    ((2, 2, 5, 6, 7), 3, (2, 1, 2), 1, True),
    ((2, 2, 5, 6, 7), 3, (2, 1, 2), 1, False),
    ((1, 3, 6, 5, 4), (2, 3, 2), 1, (1, 1, 0), False),
]


def conv_case(x, w, bias, s, p, d, g):
    args = [n(*x), n(*w)] + ([n(w[0])] if bias else [])
    attrs = {"stride": listed(s), "padding": listed(p), "dilation": listed(d), "groups": g}
    return args, attrs, lambda *t: F.conv3d(*t, stride=s, padding=p, dilation=d, groups=g)


def max_pool_case(x, k, s, p, d):
    attrs = {"kernel": listed(k), "stride": listed(s), "padding": listed(p), "dilation": listed(d)}
    return [n(*x)], attrs, lambda t: F.max_pool3d(t, k, s, p, d)


def avg_pool_case(x, k, s, p, cip):
    attrs = {"kernel": listed(k), "stride": listed(s), "padding": listed(p), "count_include_pad": cip}
    return [n(*x)], attrs, lambda t: F.avg_pool3d(t, k, s, p, count_include_pad=cip)


CASES = ([("conv2d", *conv_case(*c)) for c in CONV3D] + [("max_pool2d", *max_pool_case(*c)) for c in MAX_POOL3D]
         + [("avg_pool2d", *avg_pool_case(*c)) for c in AVG_POOL3D])
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


# ---------------------------------------------------------------- finite differences


@pytest.mark.parametrize("op, args, attrs, fn", CASES, ids=IDS)
def test_vjp_matches_finite_differences(op, args, attrs, fn):
    report = check_op(op, args, attrs)
    assert len(report) == len(args)


# ---------------------------------------------------------------- against PyTorch


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op, args, attrs, fn", CASES, ids=IDS)
def test_forward_and_gradients_match_torch(op, args, attrs, fn, dtype):
    tol = TOL["float64"] if dtype == "float64" else FLOAT32_TOL
    value, _, grads, w = run_op(op, args, attrs, dtype=dtype)
    assert value.dtype == np.dtype(dtype) and value.ndim == 5
    tdtype = torch.float64 if dtype == "float64" else torch.float32
    ts = [torch.tensor(a, dtype=tdtype, requires_grad=True) for a in args]
    ref = fn(*ts)
    assert largest_rel(value, ref.detach().numpy()) <= tol
    (ref * torch.from_numpy(w.astype(dtype))).sum().backward()
    for i, t in enumerate(ts):
        assert largest_rel(grads[i], t.grad.numpy()) <= tol, (i, largest_rel(grads[i], t.grad.numpy()))


def test_max_pool_ties_go_to_the_first_maximum_as_in_torch():
    x = R.integers(0, 3, (2, 3, 6, 5, 6)).astype(np.float64)  # many equal values per window
    for k, s, p, d in [(2, 2, 0, 1), (3, 2, 1, 1), (3, 1, 1, 2)]:
        value, _, grads, w = run_op("max_pool2d", [x], {"kernel": k, "stride": s, "padding": p, "dilation": d})
        t = torch.tensor(x, requires_grad=True)
        ref = F.max_pool3d(t, k, s, p, d)
        (ref * torch.from_numpy(w)).sum().backward()
        assert np.array_equal(value, ref.detach().numpy())
        assert np.allclose(grads[0], t.grad.numpy(), rtol=0, atol=1e-12), (k, s, p, d)


def test_int_attributes_apply_to_every_axis_of_a_volume_and_images_are_unchanged():
    x, w = n(2, 3, 5, 6, 4), n(4, 3, 3, 3, 3)
    value = run_op("conv2d", [x, w], {"stride": 2, "padding": 1})[0]
    ref = F.conv3d(torch.from_numpy(x), torch.from_numpy(w), stride=2, padding=1)
    assert largest_rel(value, ref.numpy()) <= TOL["float64"]
    value = run_op("avg_pool2d", [x], {"kernel": 2, "padding": 1, "count_include_pad": False})[0]
    ref = F.avg_pool3d(torch.from_numpy(x), 2, padding=1, count_include_pad=False)
    assert largest_rel(value, ref.numpy()) <= TOL["float64"]
    # the same attributes on an image are the 2-D ops, as before
    x, w = n(2, 3, 6, 5), n(4, 3, 3, 3)
    value = run_op("conv2d", [x, w], {"stride": 2, "padding": 1})[0]
    assert largest_rel(value, F.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=2, padding=1).numpy()) \
        <= TOL["float64"]


def test_default_fans_of_a_volume_kernel_count_its_receptive_field():
    assert default_fans((4, 2, 3, 3, 3)) == (54, 108)
    assert default_fans((4, 2, 3, 3)) == (18, 36)


# ---------------------------------------------------------------- PyTorch's exports


def import_matches_onnxruntime_and_trains_like_torch(module, x, path, classes, expected_ops):
    """``module``'s file at ``path`` imports; its float32 forward matches ONNX Runtime's
    (<= 1e-5 relative to the largest value), its forward, cross-entropy loss and every
    parameter's gradient match PyTorch autograd in float32 and float64 (``TOL``, as the zoo's
    checks: a bias gradient sums thousands of float32 terms), and its graph holds
    ``expected_ops``. Returns the import."""
    imported = import_onnx(path)
    g = imported.graph
    ref = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    assert largest_rel(ours_forward(imported, x, train=False), ref) <= FLOAT32_TOL
    assert set(expected_ops) <= {nd.op for nd in g.nodes}
    y = torch.arange(x.shape[0]) % classes
    for dtype in ("float32", "float64"):
        tol = TOL[dtype]
        tm = copy.deepcopy(module).to(torch.float64 if dtype == "float64" else torch.float32)
        logits = tm(x.to(next(tm.parameters()).dtype))
        assert largest_rel(ours_forward(imported, x, train=False, dtype=dtype), logits.detach().numpy()) <= tol
        loss = F.cross_entropy(logits, y)
        loss.backward()
        layout, flat = param_views(imported, g, dtype)
        grad = np.zeros_like(flat)
        out = Executor(g, np, dtype).forward_backward(layout.views(flat), layout.views(grad),
                                                      {"x": x.numpy().astype(dtype), "y": y.numpy()}, train=True)
        assert out["loss"] == pytest.approx(loss.item(), rel=tol)
        named, grads, matched = dict(tm.named_parameters()), layout.views(grad), _match(imported, module)
        assert {t for t, _ in matched.values()} == set(named) and len(matched) == len(g.params)
        for ir, (tname, transposed) in matched.items():
            ours = grads[ir].T if transposed else grads[ir]
            assert largest_rel(ours, named[tname].grad.numpy()) <= tol, (dtype, tname)
    return imported


class Volumes(torch.nn.Module):
    """3-D layers on a (B, 2, 8, 16, 10) volume, into a linear head: a grouped, dilated, strided
    convolution with bias, max and average pooling (padding counted and not), a second
    convolution (without bias unless ``plain_bias``) and a global average pool."""

    def __init__(self, plain_bias=False):
        super().__init__()
        nn = torch.nn
        self.conv = nn.Conv3d(2, 4, 3, stride=(1, 2, 1), padding=(1, 0, 2), dilation=(1, 1, 2), groups=2)
        self.max = nn.MaxPool3d(2)
        self.max3 = nn.MaxPool3d(3, stride=(1, 2, 1), padding=1)
        self.avg = nn.AvgPool3d(3, stride=1, padding=1, count_include_pad=False)
        self.avg_in = nn.AvgPool3d((2, 3, 3), stride=(2, 1, 2), padding=(1, 1, 0), count_include_pad=True)
        self.plain = nn.Conv3d(4, 3, (1, 3, 3), padding=(0, 1, 1), bias=plain_bias)
        self.pool = nn.AdaptiveAvgPool3d(1)
        with torch.no_grad():
            width = sum(p[0].numel() for p in self.parts(torch.zeros(1, 2, 8, 16, 10)))
        self.head = nn.Linear(width, 5)

    def parts(self, x):
        h = torch.relu(self.conv(x))  # (B, 4, 8, 7, 10)
        return [self.avg(self.max(h)), self.avg_in(self.max3(h)), self.pool(self.plain(h))]

    def forward(self, x):
        return self.head(torch.cat([p.flatten(1) for p in self.parts(x)], 1))


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_exports_import_and_train_like_pytorch(tmp_path, exporter):
    torch.manual_seed(5)
    # torch 2.14's dynamo exporter writes a Conv3d without bias with a (O, 2) zero bias, which
    # ONNX Runtime refuses: there the second convolution has one
    module = Volumes(plain_bias=exporter == "dynamo").eval()
    x = torch.randn(3, 2, 8, 16, 10, generator=torch.Generator().manual_seed(6))
    path = zoo.export(module, x, tmp_path / "volumes.onnx", exporter, "eval", optimize=False)
    imported = import_matches_onnxruntime_and_trains_like_torch(module, x, path, 5,
                                                                {"conv2d", "max_pool2d", "avg_pool2d", "mean"})
    g = imported.graph
    assert all(len(g.types[nd.name].shape) == 5 for nd in g.nodes if nd.op in ("conv2d", "max_pool2d",
                                                                              "avg_pool2d"))
    pads_counted = {nd.attrs.get("count_include_pad") for nd in g.nodes if nd.op == "avg_pool2d"}
    assert pads_counted == {True, False}


# ---------------------------------------------------------------- a hand-written graph, exported


def test_a_hand_written_3d_graph_exports_to_onnx_that_onnxruntime_runs_alike():
    from hpc_rlx.export.ir_to_onnx import ir_to_onnx
    from hpc_rlx.export.trained import TrainedModel

    b = GraphBuilder("volumes")
    x = b.input("x", [None, 2, 6, 7, 8])
    w = b.param("w", [4, 1, 3, 2, 3], {"scheme": "he_normal", "fan_in": 18})
    bias = b.param("bias", [4], {"scheme": "zeros"})
    h = b.op("conv2d", x, w, bias, name="conv", stride=[1, 2, 1], padding=1, dilation=[2, 1, 1], groups=2)
    h = b.op("max_pool2d", b.op("relu", h, name="act"), name="max", kernel=2, stride=1, dilation=[1, 2, 1])
    h = b.op("avg_pool2d", h, name="avg", kernel=[2, 2, 3], padding=1, count_include_pad=False)
    b.output("loss", b.op("mean", h, name="loss"))
    g = b.build()
    params = {"w": n(4, 1, 3, 2, 3), "bias": n(4)}
    feed = R.standard_normal((2, 2, 6, 7, 8)).astype(np.float32)
    layout = ParamLayout(g)
    flat = np.zeros(layout.size, np.float32)
    layout.pack({k: v.astype(np.float32) for k, v in params.items()}, flat)
    ours = Executor(g, np, "float32").run(layout.views(flat), {"x": feed}, "avg")["avg"]
    model = ir_to_onnx(onnx, TrainedModel(g, params, Path("model.h5"), Path(".")), "avg")
    ref = ort.InferenceSession(model.SerializeToString()).run(None, {"x": feed})[0]
    assert largest_rel(ours, ref) <= FLOAT32_TOL


# ---------------------------------------------------------------- refusals


def one_node(op_type, x_shape, inits, names, attrs, opset=17):
    node = helper.make_node(op_type, ["x"] + names, ["y"], name=f"the_{op_type.lower()}", **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape[1:]])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"d{i}" for i in range(len(x_shape))])]
    tensors = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    model = helper.make_model(helper.make_graph([node], "one", inputs, outputs, tensors),
                              opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_hand_built_3d_files_match_onnxruntime_and_unsupported_ones_name_the_node():
    x = R.standard_normal((2, 2, 5, 6, 7)).astype(np.float32)
    w = {"w": R.standard_normal((4, 2, 3, 3, 3)).astype(np.float32)}
    good = [
        one_node("Conv", x.shape, w, ["w"], {"auto_pad": "SAME_UPPER"}),
        one_node("Conv", x.shape, w, ["w"], {"pads": [1, 1, 1, 1, 1, 0]}),     # uneven: an explicit pad
        one_node("MaxPool", x.shape, {}, [], {"kernel_shape": [3, 3, 3], "pads": [1, 1, 1, 1, 1, 1],
                                              "strides": [2, 2, 2]}),
        one_node("AveragePool", x.shape, {}, [], {"kernel_shape": [2, 3, 2], "auto_pad": "VALID"}),
        one_node("GlobalAveragePool", x.shape, {}, [], {}),
    ]
    for data in good:
        imported = import_onnx(data, loss="mse", label_dtype="float")
        g = imported.graph
        layout, flat = param_views(imported, g, "float32")
        node = g.meta["onnx"]["output_node"]
        ours = Executor(g, np, "float32").run(layout.views(flat), {"x": x}, [node])[node]
        assert largest_rel(ours, ort.InferenceSession(data).run(None, {"x": x})[0]) <= FLOAT32_TOL
    refused = [
        (one_node("MaxPool", x.shape, {}, [], {"kernel_shape": [2, 2, 2], "pads": [1, 1, 1, 1, 1, 0]}), "MaxPool",
         "uneven padding"),
        (one_node("MaxPool", x.shape, {}, [], {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2],
                                                  "ceil_mode": 1}), "MaxPool",
         "ceil_mode=1"),
        (one_node("AveragePool", x.shape, {}, [], {"kernel_shape": [2, 2, 2], "dilations": [2, 1, 1]}, 19),
         "AveragePool", "dilated average pooling"),
        (one_node("MaxPool", (2, 1, 3, 4, 4, 4), {}, [], {"kernel_shape": [2, 2, 2, 2]}), "MaxPool",
         r"\(batch, C, D, H, W\), got ONNX rank 6"),
    ]
    for data, op_type, message in refused:
        with pytest.raises(GraphError, match=rf"ONNX node 'the_\w+' \({op_type}\).*{message}"):
            import_onnx(data, loss="mse", label_dtype="float")


def test_bad_3d_attributes_and_shapes_name_the_node():
    b = GraphBuilder()
    b.input("x", [None, 2, 4, 5, 6])
    w = b.param("w", [3, 2, 3, 3, 3], {"scheme": "zeros"})
    w2 = b.param("w2", [3, 2, 3, 3], {"scheme": "zeros"})
    bad = [
        (lambda: b.op("conv2d", "x", w, stride=[1, 2], name="c"), "node 'c'.*'stride' has 2 values for a 3-D"),
        (lambda: b.op("conv2d", "x", w2, name="c"), "node 'c'.*weight.*must have 5 dims"),
        (lambda: b.op("conv2d", "x", w, padding=[1, 1, 1, 1], name="c"), "node 'c'.*list of 2 or 3 ints"),
        (lambda: b.op("max_pool2d", "x", kernel=[2, 2, 2], stride=[1, 1], name="p"),
         "node 'p'.*one value per spatial axis"),
        (lambda: b.op("avg_pool2d", "x", kernel=[2, 2], name="p"), "node 'p'.*'kernel' has 2 values for a 3-D"),
        (lambda: b.op("max_pool2d", "x", kernel=[2, 2, 7], name="p"), "node 'p'.*does not fit"),
        (lambda: b.op("avg_pool2d", "x", kernel=[2, 2, 2], padding=[1, 2, 0], name="p"),
         "node 'p'.*padding <= kernel/2"),
    ]
    for make, message in bad:
        with pytest.raises(GraphError, match=message):
            make()


# ---------------------------------------------------------------- the same ops on CuPy

GPU_CASES = [(op, args, attrs) for op, args, attrs, _ in CASES]


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("op, args, attrs", GPU_CASES, ids=IDS)
def test_cupy_matches_numpy(op, args, attrs):
    (hv, hg), (dv, dg) = on_numpy_and_cupy(op, args, attrs)
    assert largest_rel(dv, hv) <= 1e-12 and largest_rel(dg, hg) <= 1e-12
