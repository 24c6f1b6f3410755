"""The resampling ops ``pad``, ``resize`` and ``conv_transpose2d`` (hpc_rlx/graph/ops/resample.py,
conv_transpose.py) and the import of ONNX's Pad, Resize and ConvTranspose (onnx/map_resample.py):
forward and gradients against PyTorch's F.pad, F.interpolate and F.conv_transpose2d (float64,
relative error <= 1e-10); forward against ONNX Runtime on hand-built single-node files for every
mode, coordinate transformation and rounding rule (float32, <= 1e-5 relative to the largest
value); PyTorch's exports of F.pad, F.interpolate / nn.Upsample and nn.ConvTranspose1d / 2d with
both exporters, forward and gradients; the refusals, each one GraphError naming the node. The
VJPs against finite differences are cases of tests/unit/graph/test_ops_vjp.py; the zoo's U-Nets
run in tests/unit/graph/test_onnx_import.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout
from hpc_rlx.graph.gradcheck import check_grads, op_graph

from tests.unit.graph.test_onnx_ops import on_numpy_and_cupy, oracle

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.onnx_checks import TOL, _match, ours_forward, param_views  # noqa: E402

F = torch.nn.functional
R = np.random.default_rng(23)


def n(*shape):
    return R.standard_normal(shape)


def largest_rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


# ---------------------------------------------------------------- against PyTorch, op by op

TORCH_PAD = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


@pytest.mark.parametrize("mode", list(TORCH_PAD))
@pytest.mark.parametrize("shape, pads", [
    ((2, 3, 5, 6), [0, 0, 1, 2, 0, 0, 3, 1]),
    ((2, 3, 5, 6), [0, 0, 4, 0, 0, 0, 0, 5]),
    ((2, 3, 5, 6), [0, 0, -1, 2, 0, 0, 1, -2]),  # negative pads crop
    ((2, 3, 7), [0, 0, 3, 0, 0, 2]),              # 1-D
    ((1, 2, 3, 4, 5), [0, 0, 1, 0, 2, 0, 0, 2, 1, 3]),  # 3-D
])
def test_pad_matches_torch(mode, shape, pads):
    rank = len(shape)
    if mode == "wrap" and min(pads) < 0:
        pytest.skip("PyTorch's circular padding takes no negative pads (ONNX's wrap case is in the ORT test)")
    torch_pads = [p for axis in reversed(range(2, rank)) for p in (pads[axis], pads[axis + rank])]
    attrs = {"pads": pads, "mode": mode}
    kwargs = {}
    if mode == "constant":
        attrs["value"] = kwargs["value"] = -0.75
    oracle("pad", [n(*shape)], attrs, lambda t: F.pad(t, torch_pads, mode=TORCH_PAD[mode], **kwargs))


def test_constant_pad_of_int64_keeps_the_dtype():
    b = GraphBuilder()
    b.input("x", [None, 3])
    b.input("ids", [None, 3], "int64")
    padded = b.op("pad", "ids", pads=[0, 2, 0, 1], value=7, name="padded")
    b.output("loss", b.op("mean", "x"))
    g = b.build()
    assert g.types["padded"].dtype == "int64" and g.types["padded"].shape == (None, 6)
    out = Executor(g, np, "float64").run({}, {"x": np.zeros((2, 3)), "ids": np.array([[1, 2, 3], [4, 5, 6]])},
                                         ["padded"])["padded"]
    assert out.dtype == np.int64 and out.tolist() == [[7, 7, 1, 2, 3, 7], [7, 7, 4, 5, 6, 7]]


# (F.interpolate keyword arguments, the IR attributes that compute them)
INTERPOLATE = [
    (dict(scale_factor=2, mode="nearest"), dict(size=[10, 12], coordinates="asymmetric", nearest_mode="floor",
                                                scales=[2.0, 2.0])),
    (dict(size=(9, 4), mode="nearest"), dict(size=[9, 4], coordinates="asymmetric", nearest_mode="floor")),
    (dict(size=(3, 8), mode="nearest"), dict(size=[3, 8], coordinates="asymmetric", nearest_mode="floor")),
    (dict(size=(9, 4), mode="nearest-exact"), dict(size=[9, 4], coordinates="half_pixel",
                                                   nearest_mode="round_prefer_ceil")),
    (dict(scale_factor=2, mode="bilinear", align_corners=False), dict(size=[10, 12], mode="linear")),
    (dict(scale_factor=(1.5, 0.5), mode="bilinear", align_corners=False),
     dict(size=[7, 3], mode="linear", coordinates="pytorch_half_pixel", scales=[1.5, 0.5])),
    (dict(size=(3, 4), mode="bilinear", align_corners=False), dict(size=[3, 4], mode="linear",
                                                                   coordinates="pytorch_half_pixel")),
    # to one output row PyTorch reads the middle (half_pixel), not row 0 (ONNX's pytorch_half_pixel)
    (dict(size=(1, 9), mode="bilinear", align_corners=False), dict(size=[1, 9], mode="linear",
                                                                   coordinates="half_pixel")),
    (dict(size=(9, 11), mode="bilinear", align_corners=True), dict(size=[9, 11], mode="linear",
                                                                   coordinates="align_corners")),
    (dict(size=(4, 3), mode="bilinear", align_corners=True), dict(size=[4, 3], mode="linear",
                                                                  coordinates="align_corners")),
]


@pytest.mark.parametrize("kwargs, attrs", INTERPOLATE, ids=[f"{k['mode']}-{i}" for i, (k, _) in enumerate(INTERPOLATE)])
def test_resize_matches_interpolate(kwargs, attrs):
    oracle("resize", [n(2, 3, 5, 6)], attrs, lambda t: F.interpolate(t, **kwargs))


def test_resize_in_one_and_three_dimensions_matches_interpolate():
    oracle("resize", [n(2, 3, 7)], {"size": [12], "mode": "linear"},
           lambda t: F.interpolate(t, size=12, mode="linear"))
    oracle("resize", [n(2, 3, 7)], {"size": [4], "mode": "linear", "coordinates": "align_corners"},
           lambda t: F.interpolate(t, size=4, mode="linear", align_corners=True))
    oracle("resize", [n(1, 2, 3, 4, 5)], {"size": [6, 3, 7], "mode": "linear"},
           lambda t: F.interpolate(t, size=(6, 3, 7), mode="trilinear"))
    oracle("resize", [n(1, 2, 3, 4, 5)], {"size": [6, 8, 10], "coordinates": "asymmetric", "nearest_mode": "floor"},
           lambda t: F.interpolate(t, scale_factor=2, mode="nearest"))


CONV_T = [  # (in channels, out channels, kernel, stride, padding, output_padding, dilation, groups, bias)
    (3, 4, 3, 2, 1, 1, 1, 1, True),
    (4, 6, (2, 3), (2, 1), (0, 1), (1, 0), 1, 2, False),
    (4, 4, 3, 3, 2, 2, 2, 4, True),   # depthwise, dilated
    (2, 5, (3, 1), 1, (1, 0), 0, (1, 1), 1, True),
    (6, 3, 4, (3, 2), 0, (2, 1), (1, 2), 3, False),
]


@pytest.mark.parametrize("cin, cout, k, s, p, op, d, g, bias", CONV_T)
def test_conv_transpose2d_matches_torch(cin, cout, k, s, p, op, d, g, bias):
    kernel = k if isinstance(k, tuple) else (k, k)
    args = [n(2, cin, 4, 5), n(cin, cout // g, *kernel)] + ([n(cout)] if bias else [])
    attrs = {"stride": list(s) if isinstance(s, tuple) else s, "padding": list(p) if isinstance(p, tuple) else p,
             "output_padding": list(op) if isinstance(op, tuple) else op,
             "dilation": list(d) if isinstance(d, tuple) else d, "groups": g}
    oracle("conv_transpose2d", args, attrs,
           lambda *t: F.conv_transpose2d(*t, stride=s, padding=p, output_padding=op, groups=g, dilation=d))
    module = torch.nn.ConvTranspose2d(cin, cout, k, s, p, op, g, bias, d).double()
    x = torch.from_numpy(args[0])
    ours = op_value("conv_transpose2d", [args[0], module.weight.detach().numpy()]
                    + ([module.bias.detach().numpy()] if bias else []), attrs)
    assert largest_rel(ours, module(x).detach().numpy()) <= TOL["float64"]


def op_value(op, args, attrs):
    g, params, feeds = op_graph(op, args, attrs)
    layout = ParamLayout(g)
    flat = np.zeros(layout.size)
    layout.pack(params, flat)
    return Executor(g, np, "float64").run(layout.views(flat), feeds, "out")["out"]


# ---------------------------------------------------------------- hand-built files against ONNX Runtime


def one_node(op_type, x_shape, inits, names, attrs, opset):
    """A file of one node reading x (batch dynamic) and constant initializers ``inits``."""
    node = helper.make_node(op_type, ["x"] + names, ["y"], name=f"the_{op_type.lower()}", **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *x_shape[1:]])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"d{i}" for i in range(len(x_shape))])]
    tensors = [numpy_helper.from_array(v, k) for k, v in inits.items()]
    model = helper.make_model(helper.make_graph([node], "one", inputs, outputs, tensors),
                              opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def against_ort(data, x):
    """The import's float64 forward on x, its reference from ONNX Runtime, and the import."""
    imported = import_onnx(data, loss="mse", label_dtype="float")
    g = imported.graph
    layout, flat = param_views(imported, g, "float64")
    node = g.meta["onnx"]["output_node"]
    ours = Executor(g, np, "float64").run(layout.views(flat), {"x": x.astype(np.float64)}, [node])[node]
    return ours, ort.InferenceSession(data).run(None, {"x": x})[0], imported


COORDINATES = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]
ROUNDING = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
GEOMETRIES = [  # (scales or None, sizes or None) for a (2, 3, 5, 7) input
    ([1.0, 1.0, 2.0, 3.0], None),
    ([1.0, 1.0, 1.7, 0.65], None),  # (0.6 puts a nearest source exactly on a tie, where float32 decides)
    ([1.0, 1.0, 0.5, 1.45], None),
    (None, [2, 3, 9, 4]),
    (None, [2, 3, 1, 7]),
]


@pytest.mark.parametrize("mode, rounding", [("nearest", r) for r in ROUNDING] + [("linear", None)])
@pytest.mark.parametrize("coordinates", COORDINATES)
def test_resize_matches_onnxruntime(mode, rounding, coordinates):
    x = R.standard_normal((2, 3, 5, 7)).astype(np.float32)
    for scales, sizes in GEOMETRIES:
        inits = {"roi": np.zeros(0, np.float32)}
        if scales is not None:
            inits["scales"] = np.array(scales, np.float32)
            names = ["roi", "scales"]
        else:
            inits["sizes"] = np.array(sizes, np.int64)
            names = ["roi", "", "sizes"]
        attrs = {"mode": mode, "coordinate_transformation_mode": coordinates}
        if rounding:
            attrs["nearest_mode"] = rounding
        ours, ref, imported = against_ort(one_node("Resize", x.shape, inits, names, attrs, 19), x)
        assert largest_rel(ours, ref) <= 1e-5, (scales, sizes)
        assert not imported.graph.params  # the scales are a setting, not a parameter


def test_resize_on_some_axes_and_in_one_and_three_dimensions_matches_onnxruntime():
    x = R.standard_normal((2, 3, 4, 6)).astype(np.float32)
    data = one_node("Resize", x.shape, {"scales": np.array([2.5, 0.5], np.float32)}, ["", "scales"],
                    {"mode": "linear", "axes": [2, 3]}, 18)
    ours, ref, _ = against_ort(data, x)
    assert largest_rel(ours, ref) <= 1e-5
    for shape, sizes in (((2, 3, 7), [2, 3, 11]), ((2, 2, 3, 4, 5), [2, 2, 5, 2, 8])):
        x = R.standard_normal(shape).astype(np.float32)
        data = one_node("Resize", shape, {"sizes": np.array(sizes, np.int64)}, ["", "", "sizes"],
                        {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, 13)
        ours, ref, _ = against_ort(data, x)
        assert largest_rel(ours, ref) <= 1e-5, shape


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_matches_onnxruntime(mode):
    x = R.standard_normal((2, 3, 5, 6)).astype(np.float32)
    cases = [[0, 0, 1, 2, 0, 0, 3, 1], [0, 1, -1, 2, 0, 2, 3, -2], [0, 0, -2, 0, 0, 0, 0, -3]]
    if mode != "reflect":
        cases.append([0, 0, 7, -2, 0, 0, -1, 9])  # wider than the axis
    for pads in cases:
        inits = {"pads": np.array(pads, np.int64)}
        names = ["pads"]
        if mode == "constant":
            inits["value"] = np.array(1.5, np.float32)
            names.append("value")
        ours, ref, _ = against_ort(one_node("Pad", x.shape, inits, names, {"mode": mode}, 13), x)
        assert largest_rel(ours, ref) <= 1e-5, pads
    # opset 18's axes input: pads over the listed axes only
    inits = {"pads": np.array([2, -1, 1, 3], np.int64), "axes": np.array([-1, 2], np.int64)}
    ours, ref, _ = against_ort(one_node("Pad", x.shape, inits, ["pads", "", "axes"], {"mode": mode}, 18), x)
    assert largest_rel(ours, ref) <= 1e-5


CONV_T_FILES = [  # (x shape, weight shape, attributes): pads the IR takes as even padding, output padding, a slice
    ((2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 2], "pads": [2, 1, 1, 0]}),  # begin > end: more output padding
    ((2, 4, 3, 4), (4, 3, 3, 3), {"strides": [1, 2], "pads": [0, 2, 1, 0]}),  # end > begin: a slice
    ((2, 4, 3, 4), (4, 3, 3, 2), {"strides": [2, 2], "pads": [3, 0, 0, 0]}),  # beyond the stride: a slice
    ((2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 2], "output_shape": [6, 8]}),
    ((2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 3], "auto_pad": "SAME_UPPER"}),
    ((2, 4, 3, 4), (4, 3, 3, 3), {"strides": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((2, 4, 3, 4), (4, 1, 2, 3), {"strides": [2, 2], "group": 4, "dilations": [2, 1], "output_padding": [1, 1],
                                  "pads": [1, 1, 0, 1]}),
    ((2, 4, 7), (4, 2, 3), {"strides": [3], "pads": [2, 1], "output_padding": [1], "group": 2}),  # 1-D
    ((2, 4, 7), (4, 3, 4), {"strides": [2], "auto_pad": "VALID", "dilations": [2]}),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_T_FILES)
def test_conv_transpose_matches_onnxruntime_and_finite_differences(x_shape, w_shape, attrs):
    x = R.standard_normal(x_shape).astype(np.float32)
    inits = {"w": R.standard_normal(w_shape).astype(np.float32),
             "b": R.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(np.float32)}
    ours, ref, imported = against_ort(one_node("ConvTranspose", x_shape, inits, ["w", "b"], attrs, 17), x)
    assert largest_rel(ours, ref) <= 1e-5
    g = imported.graph
    y = R.standard_normal((x_shape[0], *g.input("y").shape[1:]))
    report = check_grads(g, imported.initial, {"x": x.astype(np.float64), "y": y})
    assert set(report) == {"w", "b"}


# ---------------------------------------------------------------- PyTorch's exports


class Branches(torch.nn.Module):
    """``parts`` of a (B, 3, 6, 7) input (with the given layers), flattened side by side into a
    linear head."""

    def __init__(self, **layers):
        super().__init__()
        for name, layer in layers.items():
            setattr(self, name, layer)
        with torch.no_grad():
            width = sum(p[0].numel() for p in self.parts(torch.zeros(1, 3, 6, 7)))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, x):
        return self.head(torch.cat([p.flatten(1) for p in self.parts(x)], 1))


class Pads(Branches):
    """F.pad in each mode (and a crop) after a 1x1 convolution."""

    def __init__(self):
        super().__init__(pre=torch.nn.Conv2d(3, 3, 1))

    def parts(self, x):
        h = self.pre(x)
        return [F.pad(h, [1, 2, 0, 3], value=0.5), F.pad(h, [2, 1, 3, 0], mode="reflect"),
                F.pad(h, [2, 1, 3, 0], mode="replicate"), F.pad(h, [1, 1, 1, 1], mode="circular"),
                F.pad(h, [-1, 2, 1, -2])]


class Interpolations(Branches):
    """F.interpolate and nn.Upsample, up and down, by scale and by size. (1-D linear is left out:
    the dynamo exporter writes it as gathers and float32 weights, not as a Resize.)"""

    def __init__(self):
        super().__init__(pre=torch.nn.Conv2d(3, 3, 1), up=torch.nn.Upsample(scale_factor=2, mode="nearest"))

    def parts(self, x):
        h = self.pre(x)
        return [self.up(h), F.interpolate(h, size=(9, 5), mode="nearest"),
                F.interpolate(h, size=(9, 11), mode="bilinear", align_corners=True),
                F.interpolate(h, scale_factor=1.5, mode="bilinear", align_corners=False),
                F.interpolate(h, scale_factor=0.5, mode="bilinear")]


class TransposedConvs(Branches):
    """nn.ConvTranspose2d with output padding, with groups and dilation, and nn.ConvTranspose1d."""

    def __init__(self):
        nn = torch.nn
        super().__init__(a=nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
                         b=nn.ConvTranspose2d(3, 6, (2, 3), stride=(2, 1), padding=(0, 1), groups=3,
                                              dilation=(1, 2), bias=False),
                         c=nn.ConvTranspose1d(3, 2, 4, stride=3, padding=1, output_padding=2))

    def parts(self, x):
        return [self.a(x), self.b(x), self.c(x.flatten(2))]


EXPORTS = {"pads": Pads, "interpolations": Interpolations, "transposed": TransposedConvs}
EXPECTED_OP = {"pads": "pad", "interpolations": "resize", "transposed": "conv_transpose2d"}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(EXPORTS))
def test_exports_import_and_train_like_pytorch(tmp_path, name, exporter):
    torch.manual_seed(3)
    module = EXPORTS[name]().eval()
    x = torch.randn(3, 3, 6, 7, generator=torch.Generator().manual_seed(4))
    path = zoo.export(module, x, tmp_path / f"{name}.onnx", exporter, "eval")
    imported = import_onnx(path)
    ref = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    assert largest_rel(ours_forward(imported, x, train=False), ref) <= 1e-5
    g = imported.graph
    assert EXPECTED_OP[name] in {nd.op for nd in g.nodes}
    y = torch.arange(x.shape[0]) % 5
    for dtype in ("float32", "float64"):
        tm = copy.deepcopy(module).to(torch.float64 if dtype == "float64" else torch.float32)
        logits = tm(x.to(next(tm.parameters()).dtype))
        assert largest_rel(ours_forward(imported, x, train=False, dtype=dtype), logits.detach().numpy()) <= TOL[dtype]
        F.cross_entropy(logits, y).backward()
        layout, flat = param_views(imported, g, dtype)
        grad = np.zeros_like(flat)
        out = Executor(g, np, dtype).forward_backward(layout.views(flat), layout.views(grad),
                                                      {"x": x.numpy().astype(dtype), "y": y.numpy()}, train=True)
        assert out["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=TOL[dtype])
        named, grads, matched = dict(tm.named_parameters()), layout.views(grad), _match(imported, module)
        assert {t for t, _ in matched.values()} == set(named) and len(matched) == len(g.params)
        for ir, (tname, transposed) in matched.items():
            ours = grads[ir].T if transposed else grads[ir]
            assert largest_rel(ours, named[tname].grad.numpy()) <= TOL[dtype], (dtype, tname)


# ---------------------------------------------------------------- refusals


def test_unsupported_resize_pad_and_conv_transpose_name_the_node(tmp_path):
    class Bicubic(torch.nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=2, mode="bicubic").flatten(1)

    path = zoo.export(Bicubic(), torch.randn(2, 3, 4, 4), tmp_path / "cubic.onnx", "torchscript", "eval")
    with pytest.raises(GraphError, match=r"ONNX node '[^']+' \(Resize\).*mode 'cubic' is not supported"):
        import_onnx(path)
    x = (2, 3, 4, 4)
    scales = {"scales": np.array([1, 1, 2, 2], np.float32)}
    refused = [
        (one_node("Resize", x, scales, ["", "scales"], {"mode": "linear", "antialias": 1}, 18), "antialias"),
        (one_node("Resize", x, {**scales, "roi": np.zeros(8, np.float32)}, ["roi", "scales"],
                  {"coordinate_transformation_mode": "tf_crop_and_resize"}, 13), "tf_crop_and_resize"),
        (one_node("Resize", x, {"scales": np.array([2, 1, 2, 2], np.float32)}, ["", "scales"], {}, 13),
         "only change the spatial dims"),
        (one_node("Pad", x, {"pads": np.array([1, 0, 0, 0, 0, 0, 0, 0], np.int64)}, ["pads"], {}, 13),
         "Pad of ONNX axis 0"),
        (one_node("Pad", x, {"pads": np.array([0, 0, 4, 0, 0, 0, 0, 0], np.int64)}, ["pads"], {"mode": "reflect"},
                  13), "reflect padding of axis 2 must be below its size"),
        (one_node("ConvTranspose", x, {"w": np.ones((3, 2, 3, 3), np.float32)}, ["w"],
                  {"strides": [2, 2], "output_padding": [2, 0]}, 17), "output_padding"),
        (one_node("ConvTranspose", (2, 3, 4, 4, 4), {"w": np.ones((3, 2, 3, 3, 3), np.float32)}, ["w"], {}, 17),
         "must be \\(batch, C, L\\) or \\(batch, C, H, W\\)"),
    ]
    for data, message in refused:
        with pytest.raises(GraphError, match=r"ONNX node 'the_\w+' \((Resize|Pad|ConvTranspose)\).*" + message):
            import_onnx(data, loss="mse", label_dtype="float")


def test_bad_ir_attributes_name_the_node():
    b = GraphBuilder()
    b.input("x", [None, 3, 4, 4])
    w = b.param("w", [3, 2, 3, 3], {"scheme": "zeros"})
    bad = [
        (lambda: b.op("resize", "x", size=[8, 8], mode="cubic", name="up"), "node 'up'.*'mode'.*'cubic'"),
        (lambda: b.op("resize", "x", size=[8], name="up"), "node 'up'.*'size' needs 2"),
        (lambda: b.op("resize", "x", size=[8, 8], coordinates="tf_crop_and_resize", name="up"),
         "node 'up'.*'coordinates'"),
        (lambda: b.op("resize", "x", size=[8, 8], scales=[2.0, -2.0], name="up"), "node 'up'.*positive"),
        (lambda: b.op("pad", "x", pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="circular", name="p"), "node 'p'.*'mode'"),
        (lambda: b.op("pad", "x", pads=[1, 0, 0, 0, 0, 0, 0, 0], name="p"), "node 'p'.*batch dim"),
        (lambda: b.op("pad", "x", pads=[0, 0, -4, 0, 0, 0, 0, 0], name="p"), "node 'p'.*leave nothing"),
        (lambda: b.op("pad", "x", pads=[0, 0, -4, 0, 0, 0, 1, 0], mode="edge", name="p"), "node 'p'.*crop all"),
        (lambda: b.op("pad", "x", pads=[0, 0, 1], name="p"), "node 'p'.*even-length"),
        (lambda: b.op("conv_transpose2d", "x", w, stride=2, output_padding=2, name="ct"),
         "node 'ct'.*output_padding.*below the stride"),
        (lambda: b.op("conv_transpose2d", "x", w, groups=2, name="ct"), "node 'ct'.*groups"),
    ]
    for make, message in bad:
        with pytest.raises(GraphError, match=message):
            make()


# ---------------------------------------------------------------- the same ops on CuPy

GPU_CASES = [
    ("pad", [n(2, 3, 5, 6)], {"pads": [0, 0, 2, -1, 0, 0, 3, 4], "mode": "reflect"}),
    ("pad", [n(2, 3, 5, 6)], {"pads": [0, 0, 7, 1, 0, 0, 2, 9], "mode": "wrap"}),
    ("pad", [n(2, 3, 5, 6)], {"pads": [0, 1, 2, 0, 0, 2, 1, 3], "value": 0.5}),
    ("resize", [n(2, 3, 5, 6)], {"size": [10, 12]}),
    ("resize", [n(2, 3, 5, 6)], {"size": [8, 3], "mode": "linear", "coordinates": "align_corners"}),
    ("conv_transpose2d", [n(2, 4, 5, 6), n(4, 3, 3, 3), n(6)], {"stride": 2, "padding": 1, "output_padding": 1,
                                                               "groups": 2}),
]


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("op, args, attrs", GPU_CASES)
def test_cupy_matches_numpy(op, args, attrs):
    (hv, hg), (dv, dg) = on_numpy_and_cupy(op, args, attrs)
    assert largest_rel(dv, hv) <= 1e-12 and largest_rel(dg, hg) <= 1e-12
