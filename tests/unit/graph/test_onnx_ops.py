"""The ops an imported ONNX model needs beyond the built-in layers: each VJP against finite
differences, each forward and gradient against PyTorch (float64, relative error <= 1e-10),
and the ONNX index rules (negative, clamped, huge) of slice and gather."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import OPS, Executor, Graph, GraphBuilder, ParamLayout
from hpc_rlx.graph.gradcheck import check_op, op_graph
from hpc_rlx.graph.registry import VJPS
from hpc_rlx.graph.shapes import ShapeError, TensorType

R = np.random.default_rng(11)
TOL = 1e-10


def n(*shape):
    return R.standard_normal(shape)


def pos(*shape):
    return 0.5 + R.random(shape)


def ids(low, high, *shape):
    return R.integers(low, high, shape)


# (op, args, attrs): float args are differentiated, int args are fed as data
CASES = [
    ("erf", [n(3, 5)], {}),
    ("gelu", [2 * n(3, 5)], {"approximate": "none"}),
    ("leaky_relu", [n(3, 5)], {}),
    ("leaky_relu", [n(4, 2)], {"alpha": 0.3}),
    ("neg", [n(2, 3)], {}),
    ("sqrt", [pos(3, 4)], {}),
    ("exp", [n(3, 4)], {}),
    ("log", [pos(3, 4)], {}),
    ("reciprocal", [pos(3, 4) * np.sign(n(3, 4))], {}),
    ("pow", [pos(3, 4), n(4)], {}),
    ("pow", [pos(2, 1, 3), n(4, 1)], {}),
    ("clip", [3 * n(4, 5)], {"min": -1.0, "max": 2.0}),
    ("clip", [3 * n(4, 5)], {"min": 0}),
    ("clip", [3 * n(4, 5)], {"max": 0.5}),
    ("clip", [n(2, 3)], {}),
    ("where", [ids(0, 2, 3, 1), n(3, 4), n(4)], {}),
    ("where", [ids(-1, 2, 4), n(2, 1), n(2, 4)], {}),
    ("where", [np.array([[0.0], [2.5], [-1.0]]), n(3, 4), n(4)], {}),  # a float condition is a buffer here
    ("cast", [n(3, 4)], {"to": "float"}),
    ("concat", [n(2, 3), n(2, 1), n(2, 4)], {"axis": 1}),
    ("concat", [n(1, 2, 3), n(3, 2, 3)], {"axis": -3}),
    ("concat", [n(2, 3)], {"axis": 0}),
    ("slice", [n(5, 6, 7)], {"axes": [0, 2], "starts": [1, -1], "ends": [4, -8], "steps": [2, -2]}),
    ("slice", [n(4, 6)], {"starts": [-3, 1], "ends": [2**63 - 1, -1]}),
    ("gather", [n(5, 3), ids(-5, 5, 2, 4)], {}),  # repeats and negative indices
    ("gather", [n(2, 5, 3), ids(-5, 5, 3)], {"axis": 1}),
    ("gather", [n(2, 5, 3), np.asarray(-2)], {"axis": -1}),
    ("expand", [n(3, 1)], {"shape": [2, 3, 4]}),
    ("expand", [n(4)], {"shape": [3, 1]}),
    ("batch_norm", [n(4, 3, 2, 5), n(3), n(3), n(3), pos(3)], {}),
    ("batch_norm", [n(5, 2), n(2), n(2), n(2), pos(2)], {"eps": 1e-3, "momentum": 0.3}),
    ("batch_norm", [n(3, 2, 4), n(2), n(2), n(2), pos(2)], {"training": False}),
    ("log_softmax", [n(3, 5)], {}),
    ("log_softmax", [n(3, 5, 2)], {"axis": 1}),
    ("conv2d", [n(2, 4, 7, 6), n(6, 2, 3, 2), n(6)], {"groups": 2, "stride": [2, 1], "padding": 1}),
    ("conv2d", [n(2, 3, 6, 6), n(3, 1, 3, 3)], {"groups": 3, "padding": 1}),  # depthwise
    ("conv2d", [n(2, 2, 8, 7), n(3, 2, 3, 2), n(3)], {"dilation": [2, 3], "padding": [2, 1]}),
    ("conv2d", [n(1, 4, 7, 7), n(8, 1, 2, 2)], {"groups": 4, "dilation": 2, "stride": 2}),
    ("max_pool2d", [n(2, 2, 9, 8)], {"kernel": 3, "stride": 1, "padding": 1, "dilation": 2}),
    ("max_pool2d", [n(2, 2, 9, 8)], {"kernel": 2, "dilation": [2, 1]}),
    ("avg_pool2d", [n(2, 3, 7, 5)], {"kernel": 3, "stride": 2, "padding": 1, "count_include_pad": False}),
    ("avg_pool2d", [n(1, 2, 6, 6)], {"kernel": [2, 3], "stride": 1, "padding": [1, 1], "count_include_pad": False}),
    ("linear", [n(3, 4), n(5, 4), n(5)], {"weight_layout": "out_in"}),
    ("linear", [n(2, 3, 4), n(5, 4)], {"weight_layout": "out_in"}),
    ("cos", [2 * n(3, 4)], {}),
    ("sin", [2 * n(3, 4)], {}),
    ("hard_sigmoid", [4 * n(3, 5)], {}),
    ("hard_sigmoid", [4 * n(3, 5)], {"alpha": 1 / 6, "beta": 0.5}),
    ("hard_swish", [4 * n(3, 5)], {}),
    ("sign", [n(3, 4)], {}),                   # flat: a zero gradient, as PyTorch's
    ("instance_norm", [n(3, 4, 5), n(4), n(4)], {}),
    ("instance_norm", [n(2, 3, 4, 5), n(3), n(3)], {"eps": 1e-3}),
    # recurrent layers (more in tests/unit/graph/test_recurrent_ops.py): lengths, states, directions
    ("lstm", [n(2, 3, 2), n(1, 8, 2), n(1, 8, 2), n(1, 16), n(2, 1, 2), n(2, 1, 2), ids(0, 4, 2)], {}),
    ("gru", [n(2, 3, 2), n(2, 6, 2), n(2, 6, 2), n(2, 12)], {"direction": "bidirectional", "linear_before_reset": True}),
    ("rnn", [n(2, 3, 2), n(1, 2, 2), n(1, 2, 2)], {"direction": "reverse"}),
]

# Forward-only: no float argument to differentiate, an int64 mask that carries no gradient, or
# a random draw, whose zero gradient tests/unit/graph/test_random_ops.py checks in a model.
FORWARD_ONLY = {"constant", "isnan", "isinf", "compare", "logical", "random_like", "bernoulli", "argmax"}
# checked in tests/unit/graph/test_index_ops.py (which asserts that it covers each)
INDEX_OPS = {"cumsum", "gather_elements", "gather_nd", "scatter_elements", "scatter_nd"}
CHECKED = {c[0] for c in CASES} | FORWARD_ONLY | INDEX_OPS


@pytest.mark.parametrize("op,args,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_vjp_matches_finite_differences(op, args, attrs):
    report = check_op(op, args, attrs, train=True)  # train=True: batch_norm uses the batch statistics
    differentiable = [i for i, a in enumerate(args) if np.asarray(a).dtype.kind == "f" and VJPS[op].fns[i]]
    assert len(report) == len(differentiable)


# ---------------------------------------------------------------- helpers


def run_op(op, arrays, attrs, feeds_only=(), dtype="float64", train=False):
    """Loss = sum(op(*arrays) * w). Float arrays are parameters unless their position is in
    ``feeds_only`` (then inputs); those the op's VJP rule leaves out are buffers; int arrays are
    inputs. Returns (output, loss, {position: gradient, or a buffer's emitted statistic}, w)."""
    b = GraphBuilder()
    refs, params, feeds = [], {}, {}
    rule = VJPS[op]
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype.kind in "iu":
            refs.append(b.input(f"in{i}", list(a.shape), "int64"))
            feeds[f"in{i}"] = a.astype(np.int64)
        elif i in feeds_only:
            refs.append(b.input(f"in{i}", list(a.shape)))
            feeds[f"in{i}"] = a.astype(dtype)
        else:
            trainable = rule.fns[i] is not None
            refs.append(b.param(f"a{i}", list(a.shape), {"scheme": "zeros"}, trainable=trainable))
            params[f"a{i}"] = a
    out = b.op(op, *refs, name="out", **attrs)
    w = np.random.default_rng(5).standard_normal(b.type_of(out).shape)
    b.input("w", list(w.shape))
    feeds["w"] = w.astype(dtype)
    b.output("loss", b.op("sum", b.op("mul", out, "w")))
    g = b.build()
    layout = ParamLayout(g)
    flat, grad = np.zeros(layout.size, dtype), np.zeros(layout.size, dtype)
    layout.pack(params, flat)
    ex = Executor(g, np, dtype)
    value = ex.run(layout.views(flat), feeds, "out", train=train, seed=1)["out"]
    loss = ex.forward_backward(layout.views(flat), layout.views(grad), feeds, train=train, seed=1)["loss"]
    grads = {int(k[1:]): v for k, v in layout.views(grad).items()}
    return np.array(value), loss, grads, w


def rel(ours, ref):
    ref = np.asarray(ref)
    scale = np.linalg.norm(ref)
    return np.linalg.norm(np.asarray(ours) - ref) / (scale if scale > 0 else 1.0)


def oracle(op, arrays, attrs, torch_fn, feeds_only=(), train=False, grad_tol=TOL):
    """Forward value and every float parameter's gradient against PyTorch autograd."""
    torch = pytest.importorskip("torch")
    value, loss, grads, w = run_op(op, arrays, attrs, feeds_only, train=train)
    ts = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        diff = a.dtype.kind == "f" and i not in feeds_only and VJPS[op].fns[i] is not None
        ts.append(torch.tensor(a, requires_grad=diff))
    ref = torch_fn(*ts)
    assert tuple(ref.shape) == value.shape, (op, tuple(ref.shape), value.shape)
    assert rel(value, ref.detach().numpy()) <= TOL, op
    (ref * torch.from_numpy(w)).sum().backward()
    for i, t in enumerate(ts):
        if t.requires_grad:
            assert rel(grads[i], t.grad.numpy()) <= grad_tol, (op, i, rel(grads[i], t.grad.numpy()))
    return value, grads


# ---------------------------------------------------------------- elementwise vs torch


def test_elementwise_ops_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = 2 * n(4, 6)
    p = pos(4, 6)
    oracle("erf", [x], {}, torch.erf)
    oracle("gelu", [x], {"approximate": "none"}, lambda a: F.gelu(a))
    oracle("gelu", [x], {"approximate": "tanh"}, lambda a: F.gelu(a, approximate="tanh"))
    oracle("leaky_relu", [x], {}, F.leaky_relu)
    oracle("leaky_relu", [x], {"alpha": 0.2}, lambda a: F.leaky_relu(a, 0.2))
    oracle("neg", [x], {}, torch.neg)
    oracle("sqrt", [p], {}, torch.sqrt)
    oracle("exp", [x], {}, torch.exp)
    oracle("log", [p], {}, torch.log)
    oracle("reciprocal", [-p], {}, torch.reciprocal)
    oracle("pow", [p, n(6)], {}, torch.pow)
    # a negative base with whole exponents (x ** 2 in exported graphs): the exponent is data
    oracle("pow", [x, np.array([2.0, 3.0, 0.0])[:, None, None]], {}, torch.pow, feeds_only=(1,))
    oracle("clip", [4 * x], {"min": 0.0, "max": 6.0}, F.relu6)
    oracle("clip", [x], {"min": -0.5, "max": 1.0}, lambda a: F.hardtanh(a, -0.5, 1.0))


def test_trigonometry_and_hard_activations_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = 4 * n(4, 6)
    oracle("cos", [x], {}, torch.cos)
    oracle("sin", [x], {}, torch.sin)
    # PyTorch's hardsigmoid gradient is float32's 1/6 in any dtype (0.16666667163...): its
    # definition is the float64 reference, and hardsigmoid itself only to float32's rounding
    oracle("hard_sigmoid", [x], {"alpha": 1 / 6, "beta": 0.5}, lambda a: torch.clamp(a / 6 + 0.5, 0, 1))
    oracle("hard_sigmoid", [x], {"alpha": 1 / 6, "beta": 0.5}, F.hardsigmoid, grad_tol=1e-7)
    oracle("hard_swish", [x], {}, F.hardswish)
    # at and beside the kinks (-3, 3), where the gradient rules differ
    kinks = np.array([[-4.0, -3.0, -2.5, 0.0, 2.5, 3.0, 4.0]])
    oracle("hard_swish", [kinks], {}, F.hardswish)
    oracle("hard_sigmoid", [kinks], {"alpha": 1 / 6, "beta": 0.5}, F.hardsigmoid, grad_tol=1e-7)


def test_masks_follow_numpy_and_carry_no_gradient_through_where():
    """isnan / isinf / compare / logical give int64 0/1 tensors; where(isnan(s), 0, s) passes
    the gradient to s where it selects s, and none where the mask hides it."""
    x = np.array([[1.0, np.nan, -np.inf, np.inf, 0.0]])
    b = GraphBuilder()
    xi = b.input("x", [1, 5])
    outs = {"isnan": b.op("isnan", xi), "isinf": b.op("isinf", xi),
            "neg_inf": b.op("isinf", xi, detect_positive=False),
            "less": b.op("compare", xi, b.op("constant", value=0.5, shape=[], dtype="float"), kind="less"),
            "not": b.op("logical", b.op("isnan", xi), kind="not"),
            "or": b.op("logical", b.op("isnan", xi), b.op("isinf", xi), kind="or")}
    b.output("loss", b.op("sum", b.op("cast", outs["isnan"], to="float")))
    g = b.build()
    assert all(g.types[v].dtype == "int64" for v in outs.values())
    with np.errstate(invalid="ignore"):
        got = Executor(g, np, "float64").run({}, {"x": x}, list(outs.values()))
        expect = {"isnan": np.isnan(x), "isinf": np.isinf(x), "neg_inf": np.isneginf(x), "less": x < 0.5,
                  "not": ~np.isnan(x), "or": np.isnan(x) | np.isinf(x)}
    for key, ref in expect.items():
        np.testing.assert_array_equal(got[outs[key]], ref.astype(np.int64), err_msg=key)

    # the attention pattern: scores -> softmax -> where(isnan(p), 0, p)
    b = GraphBuilder()
    s = b.param("s", [2, 4], {"scheme": "zeros"})
    p = b.op("softmax", s)
    kept = b.op("where", b.op("isnan", p), b.op("constant", value=0.0, shape=[], dtype="float"), p)
    w = b.input("w", [2, 4])
    b.output("loss", b.op("sum", b.op("mul", kept, w)))
    g = b.build()
    layout = ParamLayout(g)
    flat, grad = n(8), np.zeros(8)
    wv = n(2, 4)
    Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grad), {"w": wv})
    torch = pytest.importorskip("torch")
    st = torch.tensor(flat.reshape(2, 4), requires_grad=True)
    pt = torch.softmax(st, -1)
    (torch.where(torch.isnan(pt), 0.0, pt) * torch.from_numpy(wv)).sum().backward()
    assert rel(grad.reshape(2, 4), st.grad.numpy()) <= TOL


def test_clip_and_leaky_relu_at_their_kinks_follow_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = np.array([[-1.0, 0.0, 3.0, 6.0, 7.0]])
    _, grads = oracle("clip", [x], {"min": 0.0, "max": 6.0}, F.relu6)
    _, w_grads = oracle("leaky_relu", [x], {"alpha": 0.1}, lambda a: F.leaky_relu(a, 0.1))
    assert grads[0][0, 1] == 0.0 and grads[0][0, 3] == 0.0  # no gradient at the bounds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0 ** -1.5 and log(0), masked out as in PyTorch
def test_pow_at_zero_base_follows_torch():
    torch = pytest.importorskip("torch")
    a = np.array([0.0, 0.0, 2.0, 3.0])
    b = np.array([2.0, 0.0, 0.0, -1.5])
    oracle("pow", [a, b], {}, torch.pow)


def test_where_matches_torch_for_int_and_float_conditions():
    torch = pytest.importorskip("torch")
    cond_i = ids(0, 3, 3, 1)
    x, y = n(3, 4), n(4)
    oracle("where", [cond_i, x, y], {}, lambda c, a, b: torch.where(c != 0, a, b))
    cond_f = np.array([[0.0], [1.5], [-2.0]])
    oracle("where", [cond_f, x, y], {}, lambda c, a, b: torch.where(c != 0, a, b), feeds_only=(0,))


def test_shape_ops_match_torch():
    torch = pytest.importorskip("torch")
    a, b, c = n(2, 3, 4), n(2, 1, 4), n(2, 5, 4)
    oracle("concat", [a, b, c], {"axis": 1}, lambda *t: torch.cat(t, 1))
    x = n(5, 6, 7)
    oracle("slice", [x], {"axes": [2, 0], "starts": [1, 4], "ends": [9, 0], "steps": [3, -1]},
           lambda t: torch.flip(t[1:5], [0])[:, :, 1:9:3])
    idx = np.array([[0, -1, 2], [2, 2, -3]])
    oracle("gather", [n(4, 5, 3), idx], {"axis": 1},
           lambda t, i: torch.index_select(t, 1, torch.where(i < 0, i + 5, i).reshape(-1)).reshape(4, 2, 3, 3))
    oracle("expand", [n(3, 1)], {"shape": [2, 1, 5]}, lambda t: t.expand(2, 3, 5))


# ---------------------------------------------------------------- ONNX index rules


ONNX_SLICES = [  # (dim, start, end, step) and the indices ONNX's reference picks
    (6, 1, 4, 1, [1, 2, 3]),
    (6, -2, 2**63 - 1, 1, [4, 5]),
    (6, -100, 100, 2, [0, 2, 4]),
    (6, 100, -100, -1, [5, 4, 3, 2, 1, 0]),
    (6, -1, -2**63, -2, [5, 3, 1]),
    (6, -100, -200, -1, [0]),  # a start clamped to 0 on a negative step still takes index 0
    (6, 4, 1, 1, []),
    (6, 0, 0, -1, []),
]


@pytest.mark.parametrize("dim,start,end,step,expect", ONNX_SLICES)
def test_slice_follows_onnx_clamping(dim, start, end, step, expect):
    from hpc_rlx.graph.ops.shape import slice_bounds, slice_index

    assert slice_bounds(start, end, step, dim)[3] == len(expect)
    x = np.arange(dim)
    a = OPS["slice"].normalise({"starts": [start], "ends": [end], "steps": [step]})
    assert x[slice_index(a, x.shape)].tolist() == expect


def test_slice_type_rules():
    s = OPS["slice"]
    t = s.infer([TensorType((None, 6, 5), "float")], s.normalise({"axes": [-1, 1], "starts": [1, 0], "ends": [-1, 3]}))
    assert t.shape == (None, 3, 3)
    full = s.normalise({"axes": [0], "starts": [0], "ends": [2**63 - 1]})
    assert s.infer([TensorType((None, 4), "int64")], full) == TensorType((None, 4), "int64")
    with pytest.raises(ShapeError, match="batch dim"):
        s.infer([TensorType((None, 4), "float")], s.normalise({"axes": [0], "starts": [1], "ends": [2**63 - 1]}))
    with pytest.raises(ShapeError, match="empty"):
        s.infer([TensorType((3, 4), "float")], s.normalise({"starts": [2], "ends": [1]}))
    with pytest.raises(ShapeError, match="nonzero"):
        s.normalise({"starts": [0], "ends": [1], "steps": [0]})
    with pytest.raises(ShapeError, match="one entry per axis"):
        s.normalise({"starts": [0, 1], "ends": [1]})


def test_gather_and_expand_and_concat_type_rules():
    g = OPS["gather"]
    t = g.infer([TensorType((None, 7, 3), "float"), TensorType((2, 5), "int64")], g.normalise({"axis": 1}))
    assert t == TensorType((None, 2, 5, 3), "float")
    assert g.infer([TensorType((10, 4), "int64"), TensorType((), "int64")], g.normalise({})).shape == (4,)
    with pytest.raises(ShapeError, match="int64"):
        g.infer([TensorType((10, 4), "float"), TensorType((3,), "float")], g.normalise({}))
    e = OPS["expand"]
    assert e.infer([TensorType((None, 1, 4), "float")], e.normalise({"shape": [None, 3, 1]})).shape == (None, 3, 4)
    assert e.infer([TensorType((3, 4), "float")], e.normalise({"shape": [4]})).shape == (3, 4)
    with pytest.raises(ShapeError, match="batch"):
        e.infer([TensorType((1, 4), "float")], e.normalise({"shape": [None, 4]}))
    with pytest.raises(ShapeError, match="broadcast"):
        e.infer([TensorType((3, 4), "float")], e.normalise({"shape": [2, 4]}))
    c = OPS["concat"]
    f = TensorType((None, 3), "float")
    assert c.infer([f, TensorType((None, 2), "float")], c.normalise({"axis": 1})).shape == (None, 5)
    with pytest.raises(ShapeError, match="batch"):
        c.infer([f, f], c.normalise({"axis": 0}))
    with pytest.raises(ShapeError, match="int64"):
        c.infer([f, TensorType((None, 2), "int64")], c.normalise({"axis": 1}))


def test_gather_and_expand_run_on_batched_inputs():
    b = GraphBuilder()
    b.input("x", [None, 4])
    b.input("idx", [None, 2], "int64")
    table = b.param("table", [6, 4], {"scheme": "normal", "std": 1.0})
    rows = b.op("gather", table, "idx", name="rows")  # (B, 2, 4)
    grown = b.op("expand", b.op("reshape", "x", shape=[None, 1, 4]), shape=[None, 2, 1], name="grown")
    b.output("loss", b.op("mean", b.op("mul", rows, grown)))
    g = b.build()
    layout = ParamLayout(g)
    flat = R.standard_normal(layout.size)
    x, idx = n(3, 4), np.array([[0, -1], [5, 5], [2, 3]])
    out = Executor(g, np, "float64").run(layout.views(flat), {"x": x, "idx": idx}, ["rows", "grown"])
    table_v = layout.views(flat)["table"]
    np.testing.assert_array_equal(out["rows"], table_v[np.where(idx < 0, idx + 6, idx)])
    np.testing.assert_array_equal(out["grown"], np.broadcast_to(x[:, None, :], (3, 2, 4)))


# ---------------------------------------------------------------- cast and constant


def test_cast_converts_and_truncates_like_onnx():
    b = GraphBuilder()
    b.input("x", [None, 3])
    b.input("i", [None, 3], "int64")
    as_int = b.op("cast", "x", to="int64", name="as_int")
    as_float = b.op("cast", "i", to="float", name="as_float")
    b.output("loss", b.op("sum", b.op("add", b.op("cast", as_int, to="float"), as_float)))
    g = b.build()
    assert g.types["as_int"] == TensorType((None, 3), "int64")
    x = np.array([[1.7, -1.7, 0.2]])
    for dtype in ("float32", "float64"):
        out = Executor(g, np, dtype).run({}, {"x": x.astype(dtype), "i": np.array([[4, -5, 6]])},
                                         ["as_int", "as_float"])
        assert out["as_int"].tolist() == [[1, -1, 0]] and out["as_int"].dtype == np.int64
        assert out["as_float"].tolist() == [[4.0, -5.0, 6.0]]


def test_constant_values_shapes_and_dtypes():
    b = GraphBuilder()
    b.input("x", [None, 2, 3])
    k = b.op("constant", value=[[1.5, -2, 0.25], [3, 4, 5]], shape=[2, 3], name="k")
    s = b.op("constant", value=7, dtype="int64", shape=[], name="s")
    b.output("loss", b.op("sum", b.op("mul", "x", k)))
    g = b.build()
    assert g.types["k"] == TensorType((2, 3), "float") and g.types["s"] == TensorType((), "int64")
    x = np.ones((2, 2, 3))
    out = Executor(g, np, "float64").run({}, {"x": x}, ["k", "s"])
    assert out["k"].tolist() == [[1.5, -2.0, 0.25], [3.0, 4.0, 5.0]] and out["k"].dtype == np.float64
    assert int(out["s"]) == 7 and out["s"].dtype == np.int64
    assert Executor(g, np, "float64").forward({}, {"x": x})["loss"] == pytest.approx(2 * 11.75)
    c = OPS["constant"]
    with pytest.raises(ShapeError, match="needs 4"):
        c.normalise({"value": [1, 2, 3], "shape": [2, 2]})
    with pytest.raises(ShapeError, match="integers"):
        c.normalise({"value": [1.5], "shape": [1], "dtype": "int64"})
    with pytest.raises(ShapeError, match="finite"):
        c.normalise({"value": [float("nan")], "shape": [1]})


def test_created_floats_take_the_executor_dtype():
    b = GraphBuilder()
    b.input("i", [None, 2], "int64")
    k = b.op("constant", value=[0.5, 2.0], shape=[2], name="k")
    f = b.op("cast", "i", to="float", name="f")
    b.output("loss", b.op("sum", b.op("mul", f, k)))
    out = Executor(b.build(), np, "float32").run({}, {"i": np.array([[1, 2]])}, ["k", "f"])
    assert out["k"].dtype == np.float32 and out["f"].dtype == np.float32


def test_constant_graph_round_trips_through_json():
    b = GraphBuilder()
    b.input("x", [None, 2])
    k = b.op("constant", value=[0.5, 2.0], shape=[2])
    b.output("loss", b.op("sum", b.op("mul", "x", k)))
    g = b.build()
    again = Graph.from_json(g.to_json())
    x = np.array([[1.0, 1.0]])
    assert Executor(again, np, "float64").forward({}, {"x": x})["loss"] == 2.5


def test_unknown_or_bad_attributes_are_refused():
    b = GraphBuilder()
    b.input("x", [None, 3])
    with pytest.raises(GraphError, match="'to'"):
        b.op("cast", "x", to="float16")
    with pytest.raises(GraphError, match="min <= max"):
        b.op("clip", "x", min=2, max=1)
    with pytest.raises(GraphError, match="approximate"):
        b.op("gelu", "x", approximate="sigmoid")


# ---------------------------------------------------------------- batch norm and log_softmax


def test_batch_norm_in_eval_uses_the_running_statistics():
    args = [n(4, 3, 2, 5), n(3), n(3), n(3), pos(3)]
    check_op("batch_norm", args, {}, train=False)
    x, scale, bias, mean, var = args
    value, _, grads, _ = run_op("batch_norm", args, {}, train=False)
    ref = (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-5) * scale[:, None, None] + bias[:, None, None]
    assert rel(value, ref) <= TOL
    # no statistic emitted outside training: each buffer's slot holds its current value
    assert np.array_equal(grads[3], mean) and np.array_equal(grads[4], var)


@pytest.mark.parametrize("shape", [(6, 3, 4, 5), (7, 4), (5, 2, 6)])
def test_batch_norm_training_matches_torch_and_emits_its_running_update(shape):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    c = shape[1]
    x, scale, bias, mean, var = 2 + 3 * n(*shape), n(c), n(c), n(c), pos(c)
    t_mean, t_var = torch.tensor(mean), torch.tensor(var)
    _, grads = oracle("batch_norm", [x, scale, bias, mean, var], {"eps": 1e-3},
                      lambda a, s, b, m, v: F.batch_norm(a, t_mean, t_var, s, b, training=True, momentum=1.0,
                                                         eps=1e-3), train=True)
    # momentum 1.0: PyTorch's running buffers become the batch mean and the unbiased variance
    assert rel(grads[3], t_mean.numpy()) <= TOL and rel(grads[4], t_var.numpy()) <= TOL


def test_batch_norm_eval_forms_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    args = [n(4, 3, 5, 2), n(3), n(3), n(3), pos(3)]

    def ref(a, s, b, m, v):
        return F.batch_norm(a, m, v, s, b, training=False, eps=1e-5)

    oracle("batch_norm", args, {}, ref, train=False)
    oracle("batch_norm", args, {"training": False}, ref, train=True)  # a frozen batch norm while training


def test_batch_norm_rejects_bad_shapes_and_attributes():
    bn = OPS["batch_norm"]
    x, v = TensorType((None, 3, 4, 4), "float"), TensorType((3,), "float")
    assert bn.infer([x, v, v, v, v], bn.normalise({})) == x
    with pytest.raises(ShapeError, match="running_var"):
        bn.infer([x, v, v, v, TensorType((4,), "float")], bn.normalise({}))
    with pytest.raises(ShapeError, match="momentum"):
        bn.normalise({"momentum": 1.5})
    with pytest.raises(ShapeError, match="training"):
        bn.normalise({"training": 1})


def test_batch_norm_buffers_take_its_momentum():
    b = GraphBuilder()
    b.input("x", [None, 2])
    s, t = b.param("s", [2], {"scheme": "ones"}), b.param("t", [2], {"scheme": "zeros"})
    m = b.param("m", [2], {"scheme": "zeros"}, trainable=False)
    v = b.param("v", [2], {"scheme": "ones"}, trainable=False)
    b.output("loss", b.op("mean", b.op("batch_norm", "x", s, t, m, v, momentum=0.25)))
    assert b.build().buffer_momentum() == {"m": 0.25, "v": 0.25}


def test_log_softmax_matches_torch_and_is_stable():
    torch = pytest.importorskip("torch")
    oracle("log_softmax", [n(3, 4, 5)], {"axis": 1}, lambda a: torch.log_softmax(a, 1))
    oracle("log_softmax", [np.array([[1000.0, 0.0, -1000.0], [5e3, 5e3, -5e3]])], {},
           lambda a: torch.log_softmax(a, -1))


# ---------------------------------------------------------------- extended conv, pooling and linear


def test_grouped_and_dilated_conv_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = n(3, 6, 9, 8)
    for attrs, w_shape in [({"groups": 3, "stride": [2, 1], "padding": [1, 2]}, (9, 2, 3, 3)),
                           ({"groups": 6, "padding": 1}, (6, 1, 3, 3)),  # depthwise
                           ({"groups": 6, "padding": 1}, (12, 1, 3, 3)),  # depthwise, multiplier 2
                           ({"dilation": [2, 3], "padding": [2, 3]}, (4, 6, 3, 3)),
                           ({"groups": 2, "dilation": 2, "stride": 2, "padding": 1}, (4, 3, 2, 3))]:
        tattrs = {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}
        oracle("conv2d", [x, n(*w_shape), n(w_shape[0])], attrs, lambda a, w, b: F.conv2d(a, w, b, **tattrs))
        oracle("conv2d", [x, n(*w_shape)], attrs, lambda a, w: F.conv2d(a, w, **tattrs))


def test_conv_without_groups_or_dilation_is_unchanged():
    x, w, b = n(2, 3, 7, 6), n(4, 3, 3, 2), n(4)
    base = run_op("conv2d", [x, w, b], {"stride": [2, 1], "padding": 1})
    explicit = run_op("conv2d", [x, w, b], {"stride": [2, 1], "padding": 1, "dilation": 1, "groups": 1})
    assert np.array_equal(base[0], explicit[0])
    assert all(np.array_equal(base[2][i], explicit[2][i]) for i in range(3))


def test_pooling_options_match_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = n(2, 3, 9, 8)
    oracle("avg_pool2d", [x], {"kernel": 3, "stride": 2, "padding": 1, "count_include_pad": False},
           lambda a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=False))
    oracle("avg_pool2d", [x], {"kernel": [3, 2], "stride": [1, 2], "padding": [1, 1], "count_include_pad": False},
           lambda a: F.avg_pool2d(a, (3, 2), (1, 2), (1, 1), count_include_pad=False))
    oracle("avg_pool2d", [x], {"kernel": 3, "stride": 2, "padding": 1},
           lambda a: F.avg_pool2d(a, 3, 2, 1, count_include_pad=True))
    oracle("max_pool2d", [x], {"kernel": 3, "stride": 1, "padding": 1, "dilation": 2},
           lambda a: F.max_pool2d(a, 3, 1, 1, dilation=2))
    oracle("max_pool2d", [x], {"kernel": [2, 3], "stride": [2, 1], "padding": [1, 0], "dilation": [3, 2]},
           lambda a: F.max_pool2d(a, (2, 3), (2, 1), (1, 0), dilation=(3, 2)))


def test_linear_out_in_matches_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    oracle("linear", [n(4, 6), n(3, 6), n(3)], {"weight_layout": "out_in"}, F.linear)
    oracle("linear", [n(2, 4, 6), n(3, 6)], {"weight_layout": "out_in"}, F.linear)


def test_extended_conv_pool_and_linear_type_rules():
    c = OPS["conv2d"]
    x = TensorType((None, 6, 9, 9), "float")
    t = c.infer([x, TensorType((12, 1, 3, 3), "float")], c.normalise({"groups": 6, "dilation": 2}))
    assert t.shape == (None, 12, 5, 5)
    with pytest.raises(ShapeError, match="channels"):
        c.infer([x, TensorType((12, 2, 3, 3), "float")], c.normalise({"groups": 6}))
    with pytest.raises(ShapeError, match="groups"):
        c.infer([x, TensorType((5, 2, 3, 3), "float")], c.normalise({"groups": 3}))
    with pytest.raises(ShapeError, match="groups"):
        c.normalise({"groups": 0})
    mp = OPS["max_pool2d"]
    assert mp.infer([x], mp.normalise({"kernel": 3, "dilation": 3})).shape == (None, 6, 1, 1)
    with pytest.raises(ShapeError, match="count_include_pad"):
        OPS["avg_pool2d"].normalise({"kernel": 2, "count_include_pad": 0})
    with pytest.raises(ShapeError, match="unknown attribute"):
        OPS["avg_pool2d"].normalise({"kernel": 2, "dilation": 2})
    lin = OPS["linear"]
    v = TensorType((None, 6), "float")
    assert lin.infer([v, TensorType((3, 6), "float"), TensorType((3,), "float")],
                     lin.normalise({"weight_layout": "out_in"})).shape == (None, 3)
    with pytest.raises(ShapeError, match="does not match"):
        lin.infer([v, TensorType((3, 6), "float")], lin.normalise({}))
    with pytest.raises(ShapeError, match="weight_layout"):
        lin.normalise({"weight_layout": "transposed"})


# ---------------------------------------------------------------- the same ops on CuPy


@pytest.mark.gpu
@pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("op,args,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_cupy_matches_numpy(op, args, attrs):
    (hv, hg), (dv, dg) = on_numpy_and_cupy(op, args, attrs)
    assert rel(dv, hv) <= TOL and rel(dg, hg) <= TOL


def on_numpy_and_cupy(op, args, attrs):
    """((value, gradient) on NumPy, the same on CuPy) of one op's graph in float64, a training
    step with seed 1."""
    g, params, feeds = op_graph(op, args, attrs)
    layout = ParamLayout(g)
    host = np.zeros(layout.size)
    layout.pack(params, host)
    results = []
    for xp in (np, backend.get_xp("cuda")):
        flat, grad = xp.asarray(host), xp.zeros(layout.size)
        ex = Executor(g, xp, "float64")
        f = {k: xp.asarray(v) for k, v in feeds.items()}
        value = ex.run(layout.views(flat), f, "out", train=True, seed=1)["out"]
        ex.forward_backward(layout.views(flat), layout.views(grad), f, train=True, seed=1)
        results.append((backend.to_numpy(value), backend.to_numpy(grad)))
    return results
