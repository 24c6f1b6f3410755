"""The kernels the other GPU cases leave out, on a device lane against the NumPy lane, forward
and gradients: the index ops, ``conv2d``'s dense kernels and Winograd chosen by shape (as in a
real model, no switch forced), ``pow`` by each constant exponent that takes the host's product
path, the recurrent ops, GELU and ``erf`` in float32, cross-entropy over class axis 1 with
class weights and an ignored label, the dense counts (correct, IoU, label weights), and the
elementwise ops, masks and random draws no other case runs; float64 to 1e-12 of the largest
value (1e-10 where a kernel sums many products), float32 to 1e-5.

Each case runs on two lanes: ``cupy`` (marked gpu, skipped without CuPy and a CUDA device; what
bench/gpu_check.sh runs) and ``numpy``, a second NumPy lane that takes the same code path on
every machine, so that the comparisons themselves run in CI. The last test keeps the GPU cases
whole: every op of the registry has one here or next to its other tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.graph import OPS, Executor, GraphBuilder, ParamLayout, build_model
from hpc_rlx.graph.ops import conv_dense, conv_winograd, elementwise, fast_erf
from hpc_rlx.graph.ops import loss as loss_ops
from hpc_rlx.graph.registry import VJPS

from tests.unit.graph import test_index_ops, test_onnx_ops

R = np.random.default_rng(61)
F64_EXACT, F64_SUMS, F32 = 1e-12, 1e-10, 1e-5
DTYPES = [pytest.param("float64", id="f64"), pytest.param("float32", id="f32")]


@pytest.fixture(params=[pytest.param("numpy", id="numpy-lane"),
                        pytest.param("cupy", id="cupy", marks=[
                            pytest.mark.gpu,
                            pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device")])])
def xp(request):
    """The lane compared with NumPy's: CuPy on a GPU, or NumPy again (the same code path)."""
    return np if request.param == "numpy" else backend.get_xp("cuda")


def n(*shape):
    return R.standard_normal(shape)


def largest_rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    scale = np.abs(ref).max() if ref.size else 0.0
    return float(np.abs(ours - ref).max() / (scale or 1.0)) if ref.size else 0.0


def op_graph(op, args, attrs, const=()):
    """loss = sum(op(*args) * w): float args are parameters (buffers where the op's VJP has no
    rule), int args inputs, those at positions in ``const`` constant nodes (an imported
    model's initializers). Returns (graph, params, feeds)."""
    b = GraphBuilder(f"lanes_{op}")
    refs, params, feeds = [], {}, {}
    rule = VJPS.get(op)
    for i, a in enumerate(args):
        a = np.asarray(a)
        if i in const:
            refs.append(b.op("constant", value=a.tolist(), shape=list(a.shape), dtype="float"))
        elif a.dtype.kind in "iu":
            refs.append(b.input(f"in{i}", list(a.shape), "int64"))
            feeds[f"in{i}"] = a.astype(np.int64)
        else:
            trainable = rule is None or i >= len(rule.fns) or rule.fns[i] is not None
            refs.append(b.param(f"a{i}", list(a.shape), {"scheme": "zeros"}, trainable=trainable))
            params[f"a{i}"] = a
    out = b.op(op, *refs, name="out", **attrs)
    w = np.random.default_rng(5).standard_normal(b.type_of(out).shape)
    b.input("w", list(w.shape))
    feeds["w"] = w
    b.output("loss", b.op("sum", b.op("mul", out, "w")))
    return b.build(), params, feeds


def on_lanes(xp, op, args, attrs, dtype, const=(), train=False):
    """[(value, {param: gradient}) on NumPy, the same on ``xp``], both as NumPy arrays: one
    training step of ``op_graph`` in ``dtype`` with seed 1."""
    g, params, feeds = op_graph(op, args, attrs, const)
    layout = ParamLayout(g)
    host = np.zeros(layout.size, dtype)
    layout.pack(params, host)
    results = []
    for lane in (np, xp):
        flat, grad = lane.asarray(host), lane.zeros(layout.size, dtype)
        f = {k: lane.asarray(v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
        ex = Executor(g, lane, dtype)
        value = ex.run(layout.views(flat), f, "out", train=train, seed=1)["out"]
        ex.forward_backward(layout.views(flat), layout.views(grad), f, train=train, seed=1)
        assert value.dtype == np.dtype(dtype), (op, value.dtype)
        results.append((backend.to_numpy(value), {k: backend.to_numpy(v) for k, v in layout.views(grad).items()}))
    return results


def assert_lanes_agree(xp, op, args, attrs, dtype, tol64=F64_EXACT, **kw):
    (hv, hg), (dv, dg) = on_lanes(xp, op, args, attrs, dtype, **kw)
    tol = tol64 if dtype == "float64" else F32
    assert largest_rel(dv, hv) <= tol, (op, "value", largest_rel(dv, hv))
    for k in hg:
        assert largest_rel(dg[k], hg[k]) <= tol, (op, k, largest_rel(dg[k], hg[k]))
    return hv, hg


def spy(monkeypatch, module, name):
    """Record, for each call of ``module.name(xp, array, ...)``, the array's module."""
    calls = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append(type(args[1]).__module__.split(".")[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapped)
    return calls


# ---------------------------------------------------------------- index ops and running sums

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,args,attrs", test_index_ops.CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(test_index_ops.CASES)])
def test_index_op(xp, op, args, attrs, dtype):
    _, grads = assert_lanes_agree(xp, op, args, attrs, dtype)
    assert any(np.any(v) for v in grads.values()), op  # a gradient reached the data


# ---------------------------------------------------------------- conv2d: dense kernels, Winograd

# (x shape, w shape, attrs): shapes that take conv_dense by its own rule (worth_it)
DENSE = [
    ((3, 16, 1, 1), (16, 16, 3, 3), {"padding": 1}),                   # a ResNet's last stage: the centre tap
    ((2, 32, 8, 8), (32, 1, 3, 3), {"padding": 1, "groups": 32}),      # depthwise: T's GEMM path for dW
    ((2, 8, 4, 4), (8, 1, 7, 7), {"padding": 3, "groups": 8}),         # ConvNeXt's 7x7 on 4x4
    ((2, 12, 1, 1, 1), (6, 12, 3, 3, 3), {"padding": 1}),              # a volume
]
# Winograd F(2x2, 3x3): at least 64 channels on maps of at most 16 positions
WINOGRAD = [((2, 64, 4, 4), (64, 64, 3, 3)), ((2, 64, 2, 2), (128, 64, 3, 3)), ((2, 96, 3, 3), (64, 96, 3, 3))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs,ws,attrs", DENSE, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
def test_conv_dense(xp, monkeypatch, xs, ws, attrs, dtype):
    calls = spy(monkeypatch, conv_dense, "forward")
    assert_lanes_agree(xp, "conv2d", [n(*xs), n(*ws) / 4, n(ws[0])], attrs, dtype, tol64=F64_SUMS)
    assert len(calls) == 4, calls  # run and forward_backward, on both lanes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs,ws", WINOGRAD, ids=lambda v: "x".join(map(str, v)))
def test_winograd(xp, monkeypatch, xs, ws, dtype):
    calls = spy(monkeypatch, conv_winograd, "forward")
    assert_lanes_agree(xp, "conv2d", [n(*xs), n(*ws) / 24, n(ws[0])], {"padding": 1}, dtype, tol64=F64_SUMS)
    assert len(calls) == 4 and calls[-1] == xp.__name__.split(".")[0], calls


# ---------------------------------------------------------------- pow by a constant exponent

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("exponent", sorted(elementwise._FAST_EXPONENTS))
def test_pow_by_each_constant_exponent(xp, monkeypatch, exponent, dtype):
    """The host lane computes these by products, a device lane by its power kernel."""
    calls = spy(monkeypatch, elementwise, "_power_by_products")
    whole = exponent == int(exponent)
    base = R.uniform(0.3, 2.0, (5, 7)) * (R.choice([-1.0, 1.0], (5, 7)) if whole else 1.0)
    assert_lanes_agree(xp, "pow", [base, np.asarray(exponent)], {}, dtype, const=(1,))
    assert "numpy" in calls, calls  # the constant reached the host lane's product path


# ---------------------------------------------------------------- float32: recurrent, GELU, erf

RECURRENT = [c for c in test_onnx_ops.CASES if c[0] in ("lstm", "gru", "rnn")] + [
    ("lstm", [n(5, 2, 3), n(2, 16, 3), n(2, 16, 4), n(2, 32)], {"direction": "bidirectional"}),
    ("gru", [n(4, 3, 2), n(1, 9, 2), n(1, 9, 3), n(1, 18)], {}),
]


@pytest.mark.parametrize("op,args,attrs", RECURRENT, ids=[f"{c[0]}-{i}" for i, c in enumerate(RECURRENT)])
def test_recurrent_in_float32(xp, op, args, attrs):
    assert_lanes_agree(xp, op, args, attrs, "float32")


@pytest.mark.parametrize("op,args,attrs", [
    ("erf", [2 * n(40, 70)], {}),
    ("gelu", [3 * n(40, 70)], {"approximate": "none"}),
    ("gelu", [3 * n(40, 70)], {"approximate": "tanh"}),
], ids=["erf", "gelu-exact", "gelu-tanh"])
def test_gelu_and_erf_in_float32(xp, op, args, attrs):
    assert_lanes_agree(xp, op, args, attrs, "float32")


def test_float32_erf_is_the_fast_one_on_the_host_and_the_exact_one_on_a_device(xp):
    x = (2 * n(300)).astype(np.float32)
    got = backend.to_numpy(fast_erf.erf(xp, xp.asarray(x)))
    want = fast_erf.erf_float32(x) if xp is np else backend.to_numpy(backend.erf(xp, xp.asarray(x)))
    np.testing.assert_array_equal(got, want)
    assert largest_rel(got, backend.erf(np, x.astype(np.float64))) <= 1e-6


# ---------------------------------------------------------------- dense targets: class axis 1, weights, ignored label

CROSS_ENTROPY = [  # (logits shape, labels shape, attributes)
    ((3, 4, 5, 6), (3, 5, 6), {"weights": [0.5, 2.0, 1.0, 1.5], "ignore_index": 255}),
    ((2, 3, 2, 4, 3), (2, 2, 4, 3), {"ignore_index": -100}),
    ((3, 4, 5, 6), (3, 5, 6), {"weights": [0.5, 2.0, 1.0, 1.5], "ignore_index": 1}),
    ((3, 7, 5), (3, 7), {"weights": [1.0, 0.2, 3.0, 1.0, 0.5], "axis": -1}),
]


def _labels(shape, classes, ignore):
    y = R.integers(0, classes, shape)
    if ignore is not None:
        y[R.random(shape) < 0.3] = ignore
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zs,ys,attrs", CROSS_ENTROPY, ids=["image-w-ignore", "volume-ignore", "ignore-a-class",
                                                            "classes-last-w"])
def test_cross_entropy_with_class_weights_and_an_ignored_label(xp, zs, ys, attrs, dtype):
    classes = zs[attrs.get("axis", 1)]
    y = _labels(ys, classes, attrs.get("ignore_index"))
    assert_lanes_agree(xp, "softmax_cross_entropy", [3 * n(*zs), y], attrs, dtype, tol64=F64_SUMS)


def test_dense_counts_on_the_lane(xp):
    """correct_count, iou_counts and label_weight over class axis 1 with an ignored label."""
    z, y = n(4, 3, 5, 5), _labels((4, 5, 5), 3, 255)
    attrs = {"axis": None, "ignore_index": 255}
    b = GraphBuilder()
    b.input("z", list(z.shape))
    b.input("y", list(y.shape), "int64")
    b.op("correct_count", "z", "y", name="correct", **attrs)
    b.output("loss", b.op("softmax_cross_entropy", "z", "y", **attrs))
    g = b.build()
    counts = [backend.to_numpy(Executor(g, lane, "float64").run({}, {"z": lane.asarray(z), "y": lane.asarray(y)},
                                                                  "correct")["correct"]) for lane in (np, xp)]
    assert counts[1] == counts[0] == ((z.argmax(1) == y) & (y != 255)).sum()
    host = loss_ops.iou_counts(np, z, y, attrs, 3)
    dev = loss_ops.iou_counts(xp, xp.asarray(z), xp.asarray(y), attrs, 3)
    for h, d in zip(host, dev):
        np.testing.assert_array_equal(backend.to_numpy(d), h)
        assert backend.to_numpy(d).dtype == np.int64
    hw, htotal = loss_ops.label_weight(np, y, [1.0, 2.0, 0.5], 255)
    dw, dtotal = loss_ops.label_weight(xp, xp.asarray(y), [1.0, 2.0, 0.5], 255)
    np.testing.assert_array_equal(backend.to_numpy(dw), hw)
    assert float(dtotal) == pytest.approx(float(htotal), rel=1e-15)


# ---------------------------------------------------------------- the rest: elementwise, masks, draws

ELEMENTWISE = [
    ("sigmoid", [4 * n(6, 9)], {}),
    ("tanh", [2 * n(6, 9)], {}),
    ("sub", [n(6, 9), n(9)], {}),
    ("div", [n(6, 9), R.uniform(0.5, 2.0, (6, 1))], {}),
    ("mean", [n(4, 5, 6)], {"axes": [1, 2], "keepdims": True}),
    ("mse", [n(7, 3), n(7, 3)], {}),
    ("bias_add", [n(3, 4, 5), n(4)], {"axis": 1}),
    ("relu", [n(6, 9)], {}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,args,attrs", ELEMENTWISE, ids=[c[0] for c in ELEMENTWISE])
def test_elementwise(xp, op, args, attrs, dtype):
    assert_lanes_agree(xp, op, args, attrs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 4, 50), (2, 8, 5, 6)], ids=["signal", "image"])
def test_instance_norm(xp, shape, dtype):
    assert_lanes_agree(xp, "instance_norm", [3 * n(*shape) + 1, n(shape[1]), n(shape[1])], {}, dtype,
                       tol64=F64_SUMS)


def test_argmax_and_sign_are_the_same_on_both_lanes(xp):
    """Integer results without gradient: a last non-padding token's position, relative
    positions' signs; ties (the values are small integers) pick the first or last alike."""
    ids = R.integers(-2, 3, (6, 9))
    b = GraphBuilder()
    xi = b.input("x", list(ids.shape), "int64")
    outs = [b.op("argmax", xi, axis=1), b.op("argmax", xi, axis=0, keepdims=True, select_last_index=True),
            b.op("sign", xi), b.op("sign", b.op("cast", xi, to="float"))]
    b.output("loss", b.op("sum", b.op("cast", outs[0], to="float")))
    g = b.build()
    ref = Executor(g, np, "float64").run({}, {"x": ids}, outs)
    got = Executor(g, xp, "float64").run({}, {"x": xp.asarray(ids)}, outs)
    for v in outs:
        np.testing.assert_array_equal(backend.to_numpy(got[v]), ref[v], err_msg=v)
        assert backend.to_numpy(got[v]).dtype == ref[v].dtype


def test_masks_are_the_same_on_both_lanes(xp):
    x = np.array([[1.0, np.nan, -np.inf, np.inf, 0.0, -2.0, 0.25]])
    b = GraphBuilder()
    xi = b.input("x", list(x.shape))
    half = b.op("constant", value=0.5, shape=[], dtype="float")
    outs = [b.op("isnan", xi), b.op("isinf", xi), b.op("isinf", xi, detect_positive=False),
            b.op("compare", xi, half, kind="less"), b.op("logical", b.op("isnan", xi), kind="not"),
            b.op("logical", b.op("isnan", xi), b.op("isinf", xi), kind="or"),
            b.op("where", b.op("isnan", xi), half, xi), b.op("cast", b.op("isinf", xi), to="float")]
    b.output("loss", b.op("sum", b.op("cast", outs[0], to="float")))
    g = b.build()
    with np.errstate(invalid="ignore"):
        ref = Executor(g, np, "float64").run({}, {"x": x}, outs)
        got = Executor(g, xp, "float64").run({}, {"x": xp.asarray(x)}, outs)
    for v in outs:
        np.testing.assert_array_equal(backend.to_numpy(got[v]), ref[v], err_msg=v)


def _draws(xp, op, x, seed, train=True, **attrs):
    b = GraphBuilder()
    b.input("x", list(x.shape))
    b.output("loss", b.op("sum", b.op(op, "x", name="draw", **attrs)))
    ex = Executor(b.build(), xp, "float32")
    return backend.to_numpy(ex.run({}, {"x": xp.asarray(x.astype(np.float32))}, "draw", train=train, seed=seed)["draw"])


def test_random_draws_on_the_lane(xp):
    """A device draws its own numbers: their law, their repeatability by seed, and evaluation at
    their expectation, as on the host."""
    ones = np.ones((400, 500))
    kept = _draws(xp, "dropout", ones, 3, p=0.25)
    assert set(np.unique(kept)) == {0.0, np.float32(1 / 0.75)} and abs((kept > 0).mean() - 0.75) < 0.01
    np.testing.assert_array_equal(kept, _draws(xp, "dropout", ones, 3, p=0.25))
    assert not np.array_equal(kept, _draws(xp, "dropout", ones, 4, p=0.25))
    u = _draws(xp, "random_like", ones, 3, dist="uniform", a=-1.0, b=3.0)
    assert u.min() >= -1.0 and u.max() < 3.0 and abs(u.mean() - 1.0) < 0.02
    z = _draws(xp, "random_like", ones, 3, dist="normal", a=0.5, b=2.0)
    assert abs(z.mean() - 0.5) < 0.02 and abs(z.std() - 2.0) < 0.02
    coin = _draws(xp, "bernoulli", 0.3 * ones, 3)
    assert set(np.unique(coin)) == {0.0, 1.0} and abs(coin.mean() - 0.3) < 0.01
    for op, attrs in [("dropout", {"p": 0.25}), ("random_like", {"dist": "uniform"}), ("bernoulli", {})]:
        x = 0.3 * ones[:3, :4]
        np.testing.assert_array_equal(_draws(xp, op, x, 3, train=False, **attrs),
                                      _draws(np, op, x, 3, train=False, **attrs))


def test_dropout_gradient_is_its_mask_on_the_lane(xp):
    (hv, hg), (dv, dg) = on_lanes(xp, "dropout", [np.ones((50, 40))], {"p": 0.5}, "float64", train=True)
    w = np.random.default_rng(5).standard_normal(dv.shape)
    np.testing.assert_allclose(dg["a0"], w * dv, rtol=1e-15)


# ---------------------------------------------------------------- every op has a GPU case

def test_every_op_has_a_case_on_the_gpu_lane():
    """Each op of the registry runs on CuPy in some gpu-marked test: here, in test_onnx_ops,
    test_volume_ops, test_resampling_ops, test_layer_norm_axes or a model of test_gpu (every
    op graph also runs constant, mul and sum). A new op needs a case before a GPU run."""
    from tests.unit.graph import test_gpu, test_resampling_ops, test_volume_ops
    covered = {"constant", "mul", "sum", "layer_norm", "conv2d", "pow", "erf", "gelu", "dropout", "random_like",
               "bernoulli", "isnan", "isinf", "compare", "logical", "where", "cast", "argmax", "sign",
               "instance_norm"}
    for cases in (test_onnx_ops.CASES, test_volume_ops.GPU_CASES, test_resampling_ops.GPU_CASES,
                  test_index_ops.CASES, RECURRENT, ELEMENTWISE, [("softmax_cross_entropy",), ("correct_count",)]):
        covered |= {c[0] for c in cases}
    for kind, kwargs in test_gpu.MODELS:
        covered |= {node.op for node in build_model(kind, **kwargs).nodes}
    assert set(OPS) - covered == set(), "ops with no CuPy case: add one (see this module's docstring)"
