"""The kernels that make the engine's step as fast as PyTorch's on real models, checked for the
value they must keep: ``pow`` by products for small whole and half exponents (GPT-2's x**3),
the in-place ``sigmoid``, the float32 ``erf`` of ``device/fast_erf.py`` (exact GELU), layer
norm's row means as GEMVs, and ``conv2d`` on small maps as one dense matrix per group
(``ops/conv_dense.py``), each against PyTorch autograd in float64 (<= 1e-10) and float32
(<= 1e-5 relative to the largest value), plus finite differences and which path a shape takes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hpc_rlx.graph.ops import fast_erf
from hpc_rlx.graph.ops.fast_erf import erf_float32
from hpc_rlx.graph.gradcheck import check_op
from hpc_rlx.graph.ops import conv_dense

from tests.unit.graph.test_onnx_ops import run_op

torch = pytest.importorskip("torch")
scipy_special = pytest.importorskip("scipy.special")

F = torch.nn.functional
R = np.random.default_rng(47)


def largest_rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def against_torch(op, arrays, attrs, torch_fn, dtype, tol, feeds_only=()):
    """Forward value and each parameter's gradient of ``sum(op(...) * w)`` against PyTorch
    (arguments in ``feeds_only`` are inputs, as an imported model's constants are)."""
    value, _, grads, w = run_op(op, arrays, attrs, feeds_only, dtype=dtype)
    ts = [torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in arrays]
    ref = torch_fn(*ts)
    (ref * torch.tensor(w)).sum().backward()
    assert largest_rel(value, ref.detach().numpy()) <= tol, op
    for i, t in enumerate(ts):
        if i in grads:
            assert largest_rel(grads[i], t.grad.numpy()) <= tol, (op, i)


# ---------------------------------------------------------------- pow by products

EXPONENTS = [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("exponent", EXPONENTS)
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_pow_by_products_matches_torch(exponent, dtype, tol):
    base = R.uniform(0.2, 2.0, (4, 6)) * (1 if exponent % 1 else R.choice([-1, 1], (4, 6)))
    against_torch("pow", [base, np.asarray(exponent)], {}, lambda a, e: torch.pow(a, exponent), dtype, tol,
                  feeds_only=(1,))


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_pow_by_products_finite_differences(exponent):
    base = R.uniform(0.5, 2.0, (3, 4))
    check_op("pow", [base, np.asarray(exponent)], {})  # the exponent's gradient too (log of a positive base)


def test_pow_keeps_the_general_path_for_other_exponents_and_broadcasts():
    base = R.uniform(0.5, 2.0, (3, 4))
    against_torch("pow", [base, np.asarray(2.5)], {}, lambda a, e: torch.pow(a, 2.5), "float64", 1e-10,
                  feeds_only=(1,))
    # an exponent with more dims than the base broadcasts the result, as the general path does
    value, _, _, _ = run_op("pow", [base[0], np.full((1, 1), 3.0)], {}, feeds_only=(1,))
    assert value.shape == (1, 4) and np.allclose(value, base[0] ** 3)


# ---------------------------------------------------------------- sigmoid


def test_sigmoid_in_place_form_is_exact_at_the_extremes_without_warnings():
    x = np.array([-1000.0, -100.0, -88.0, -20.0, -1.0, 0.0, 1.0, 20.0, 100.0, 1000.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value, _, _, _ = run_op("sigmoid", [x], {}, dtype="float32")
    ref = torch.sigmoid(torch.tensor(x)).numpy()
    np.testing.assert_allclose(value, ref, rtol=1e-6, atol=0)
    assert value[0] == 0.0 and value[-1] == 1.0


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_sigmoid_matches_torch(dtype, tol):
    against_torch("sigmoid", [R.standard_normal((5, 7)) * 4], {}, torch.sigmoid, dtype, tol)


# ---------------------------------------------------------------- float32 erf


def test_erf_float32_within_5e7_of_the_exact_erf_everywhere():
    x = np.concatenate([R.standard_normal(200_000) * 3, np.linspace(-12, 12, 100_001),
                        [0.0, -0.0, 1e-30, np.inf, -np.inf]]).astype(np.float32)
    ours = erf_float32(x)
    exact = scipy_special.erf(x.astype(np.float64))
    assert ours.dtype == np.float32
    assert np.abs(ours - exact).max() <= 5e-7
    assert ours[-2] == 1.0 and ours[-1] == -1.0 and not np.isnan(ours).any()


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_erf_float32_keeps_shape_and_memory_order(layout):
    base = (R.standard_normal((70, 3000)) * 2).astype(np.float32)  # > one chunk of values
    x = {"contiguous": base, "transposed": base.T, "strided": base[:, ::3]}[layout]
    ours = erf_float32(x)
    assert ours.shape == x.shape
    if layout == "transposed":
        assert ours.flags.f_contiguous  # the batch-last layout the conv kernels hand on
    assert np.abs(ours - scipy_special.erf(x.astype(np.float64))).max() <= 5e-7


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_chunked_gelu_and_its_gradient_match_torch(layout):
    base = (R.standard_normal((90, 1500)) * 3).astype(np.float32)  # two chunks and a part
    x = base if layout == "contiguous" else base.T
    g = np.ascontiguousarray((R.standard_normal(base.shape)).astype(np.float32))
    g = g if layout == "contiguous" else g.T
    value, bracket = fast_erf.gelu_float32(x)
    grad = fast_erf.gelu_grad_float32(x, bracket, g)
    t = torch.tensor(x.astype(np.float64), requires_grad=True)
    F.gelu(t).backward(torch.tensor(g.astype(np.float64)))
    assert largest_rel(value, F.gelu(torch.tensor(x.astype(np.float64))).numpy()) <= 1e-6
    assert largest_rel(grad, t.grad.numpy()) <= 1e-6
    assert value.strides == x.strides
    # arrays in different memory orders are left to the unfused path
    assert fast_erf.gelu_grad_float32(x, bracket, np.ascontiguousarray(g.T).T if layout == "contiguous"
                                      else np.ascontiguousarray(g)) is None


def test_exact_gelu_in_float32_matches_torch():
    x = R.standard_normal((6, 40)) * 3
    against_torch("gelu", [x], {"approximate": "none"}, F.gelu, "float32", 1e-5)
    against_torch("erf", [x], {}, torch.erf, "float32", 1e-5)


# ---------------------------------------------------------------- layer norm's row means


@pytest.mark.parametrize("shape,axes", [((6, 16), 1), ((2, 3, 4, 32), 1), ((3, 5, 4, 6), 2), ((4, 8), 1)])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_layer_norm_matches_torch(shape, axes, dtype, tol):
    dims = shape[len(shape) - axes:]
    x, gamma, beta = R.standard_normal(shape) * 3 + 1, R.standard_normal(dims), R.standard_normal(dims)
    against_torch("layer_norm", [x, gamma, beta], {"eps": 1e-5, "trailing_axes": axes},
                  lambda a, g, b: F.layer_norm(a, dims, g, b, 1e-5), dtype, tol)


# ---------------------------------------------------------------- conv2d on small maps

# (batch, channels, spatial size, out channels, kernel, stride, padding, dilation, groups)
DENSE_CASES = [
    (3, 4, (1, 1), 5, (3, 3), 1, 1, 1, 1),            # a ResNet's last stage: only the centre tap
    (2, 4, (2, 2), 6, (3, 3), 2, 1, 1, 2),            # stride 2, groups
    (2, 6, (3, 3), 6, (3, 3), 1, 1, 1, 6),            # depthwise
    (2, 4, (4, 4), 4, (7, 7), 1, 3, 1, 4),            # ConvNeXt's depthwise 7x7 on 4x4
    (2, 4, (2, 3), 6, (3, 3), (1, 2), (1, 0), 1, 2),  # per-axis stride and padding
    (2, 4, (3, 3), 4, (3, 3), 1, 2, 2, 1),            # dilation
    (2, 2, (2, 2, 2), 3, (3, 3, 3), 1, 1, 1, 1),      # a volume
]


def _conv_case(case):
    b, c, size, o, kernel, stride, padding, dilation, groups = case
    rng = np.random.default_rng([b, c, o, groups, *size])  # independent of the tests run before
    x, w, bias = rng.standard_normal((b, c, *size)), rng.standard_normal((o, c // groups, *kernel)), rng.standard_normal(o)
    listed = [list(v) if isinstance(v, tuple) else v for v in (stride, padding)]
    attrs = {"stride": listed[0], "padding": listed[1], "dilation": dilation, "groups": groups}
    conv = F.conv2d if len(size) == 2 else F.conv3d
    return [x, w, bias], attrs, (lambda t, k, bb: conv(t, k, bb, stride, padding, dilation, groups))


@pytest.fixture
def dense_everywhere(monkeypatch):
    """Every conv2d takes the dense kernels, whatever ``worth_it`` decides."""
    monkeypatch.setattr(conv_dense, "worth_it", lambda *shape: True)


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "x".join(map(str, c[2])) + f"-k{c[4][0]}-g{c[8]}")
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_dense_conv_matches_torch(case, dtype, tol, dense_everywhere):
    arrays, attrs, fn = _conv_case(case)
    against_torch("conv2d", arrays, attrs, fn, dtype, tol)


@pytest.mark.parametrize("case", DENSE_CASES[:4], ids=lambda c: "x".join(map(str, c[2])) + f"-g{c[8]}")
def test_dense_conv_finite_differences(case, dense_everywhere):
    arrays, attrs, _ = _conv_case(case)
    check_op("conv2d", arrays, attrs)


def assert_same_as_im2col(monkeypatch, module, switch, arrays, attrs):
    """conv2d's value and gradients with ``module.switch`` saying no (im2col) and yes: equal
    in float64 to rounding."""
    monkeypatch.setattr(module, switch, lambda *shape: False)
    im2col = run_op("conv2d", arrays, attrs)
    monkeypatch.setattr(module, switch, lambda *shape: True)
    other = run_op("conv2d", arrays, attrs)
    assert largest_rel(other[0], im2col[0]) <= 1e-13
    for i in (0, 1, 2):
        assert largest_rel(other[2][i], im2col[2][i]) <= 1e-13


def test_dense_conv_equals_im2col_in_float64(monkeypatch):
    arrays, attrs, _ = _conv_case(DENSE_CASES[3])
    assert_same_as_im2col(monkeypatch, conv_dense, "worth_it", arrays, attrs)


@pytest.mark.parametrize("size,kernel,per_group,out,dense", [
    ((1, 1), (3, 3), 512, 512, True),     # 8 of 9 taps read padding
    ((2, 2), (3, 3), 256, 256, False),    # building T costs more than the taps it saves
    ((8, 8), (3, 3), 64, 64, False),
    ((8, 8), (7, 7), 1, 16, True),        # depthwise: up to 8x the kernel's area
    ((8, 8), (3, 3), 1, 128, True),
    ((16, 16), (3, 3), 1, 64, False),
    ((16, 16), (7, 7), 1, 96, False),     # T would pass MAX_MATRIX
])
def test_which_convolutions_take_the_dense_kernels(size, kernel, per_group, out, dense):
    assert conv_dense.worth_it(size, kernel, per_group, out) is dense


def test_dense_taps_name_each_kernel_offset_once_per_pair():
    # 1-D view of a 3-tap kernel, stride 1, padding 1 on 4 positions: output p reads input
    # q = p - 1 + tap
    out, index, dead = conv_dense.taps((4,), (3,), (1,), (1,), (1,))
    assert out == (4,)
    expected_live = np.abs(np.subtract.outer(np.arange(4), np.arange(4))) <= 1
    np.testing.assert_array_equal(~dead, expected_live)
    for p, q in zip(*np.nonzero(expected_live)):
        assert index[p, q] == q - p + 1


# ---------------------------------------------------------------- softmax's row sums, gather's select


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_softmax_matches_torch_over_the_last_and_an_inner_axis(axis, dtype, tol):
    against_torch("softmax", [R.standard_normal((3, 4, 16)) * 3], {"axis": axis},
                  lambda t: torch.softmax(t, axis), dtype, tol)


@pytest.mark.parametrize("index", [0, 2, -1])
def test_gather_of_one_index_is_a_select_with_its_gradient(index):
    data = R.standard_normal((3, 2, 5, 4))
    for axis in (0, 2):
        value, _, grads, _ = run_op("gather", [data, np.asarray(index, np.int64)], {"axis": axis})
        t = torch.tensor(data, requires_grad=True)
        ref = t.select(axis, index)
        assert value.shape == tuple(ref.shape)
        assert largest_rel(value, ref.detach().numpy()) == 0.0
    check_op("gather", [data, np.asarray(index, np.int64)], {"axis": 1 if index != 2 else 0})


# ---------------------------------------------------------------- conv2d by Winograd F(2x2, 3x3)

# (batch, channels, out channels, height, width): even and odd sizes, down to 2x2
WINOGRAD_CASES = [(2, 3, 4, 5, 5), (3, 4, 5, 2, 2), (2, 5, 3, 7, 6), (2, 2, 2, 8, 8), (1, 3, 3, 3, 4)]


@pytest.fixture
def winograd_everywhere(monkeypatch):
    """Every 3x3 stride-1 padding-1 conv2d takes the Winograd kernels, whatever its size."""
    from hpc_rlx.graph.ops import conv_winograd

    monkeypatch.setattr(conv_dense, "worth_it", lambda *shape: False)
    monkeypatch.setattr(conv_winograd, "applies", lambda *geometry: geometry[1:5] == ((3, 3), (1, 1), (1, 1), (1, 1)))
    calls = []
    forward = conv_winograd.forward
    monkeypatch.setattr(conv_winograd, "forward", lambda *args: calls.append(1) or forward(*args))
    yield
    assert calls, "no convolution took the Winograd kernels"


def _winograd_case(case, bias=True):
    b, c, o, h, w = case
    rng = np.random.default_rng(list(case))  # the same numbers whatever ran before in this worker
    arrays = [rng.standard_normal((b, c, h, w)), rng.standard_normal((o, c, 3, 3))] + ([rng.standard_normal(o)] if bias else [])
    return arrays, {"padding": 1}


@pytest.mark.parametrize("case", WINOGRAD_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_winograd_conv_matches_torch(case, dtype, tol, winograd_everywhere):
    arrays, attrs = _winograd_case(case)
    against_torch("conv2d", arrays, attrs, lambda t, k, bb: F.conv2d(t, k, bb, padding=1), dtype, tol)


@pytest.mark.parametrize("case", WINOGRAD_CASES[:3], ids=lambda c: "x".join(map(str, c)))
def test_winograd_conv_finite_differences(case, winograd_everywhere):
    arrays, attrs = _winograd_case(case, bias=False)
    check_op("conv2d", arrays, attrs)


def test_winograd_conv_equals_im2col_in_float64(monkeypatch):
    from hpc_rlx.graph.ops import conv_winograd

    arrays, attrs = _winograd_case((2, 6, 5, 5, 4))
    assert_same_as_im2col(monkeypatch, conv_winograd, "applies", arrays, attrs)


@pytest.mark.parametrize("size,stride,padding,groups,channels,takes", [
    ((4, 4), (1, 1), (1, 1), 1, 128, True),     # a ResNet's second stage on 32x32 images
    ((2, 2), (1, 1), (1, 1), 1, 256, True),
    ((8, 8), (1, 1), (1, 1), 1, 64, False),     # the tile gathers cost more than the GEMMs save
    ((4, 4), (2, 2), (1, 1), 1, 128, False),    # stride 2
    ((4, 4), (1, 1), (0, 0), 1, 128, False),    # no padding
    ((4, 4), (1, 1), (1, 1), 2, 128, False),    # groups
    ((4, 4), (1, 1), (1, 1), 1, 32, False),     # few channels
])
def test_which_convolutions_take_winograd(size, stride, padding, groups, channels, takes):
    from hpc_rlx.graph.ops import conv_winograd

    assert conv_winograd.applies(size, (3, 3), stride, padding, (1, 1), groups, channels, channels) is takes
