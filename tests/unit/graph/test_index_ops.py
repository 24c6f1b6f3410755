"""Running sums and index ops (hpc_rlx/graph/ops/index.py) and their ONNX import
(hpc_rlx/graph/onnx/map_index.py): each VJP against finite differences; forward and gradients
against PyTorch in float64 (relative error <= 1e-10) and float32 (<= 1e-5 of the largest
value); integer data computed at run time (position ids, decoder ids shifted right); constant
folding against ONNX's reference evaluator; NonZero's pooling pattern, and the index ops on
data, exported by both exporters against ONNX Runtime and PyTorch. What the import refuses is
checked in tests/unit/graph/test_index_refusals.py."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.graph import OPS, Executor, GraphBuilder
from hpc_rlx.graph.gradcheck import check_op
from hpc_rlx.graph.registry import VJPS
from hpc_rlx.graph.shapes import ShapeError, TensorType

from tests.unit.graph.test_onnx_ops import INDEX_OPS, TOL, oracle, rel, run_op

R = np.random.default_rng(23)


def n(*shape):
    return R.standard_normal(shape)


def ids(low, high, *shape):
    return R.integers(low, high, shape)


def distinct_along(size, count, other, axis):
    """Indices with no repeats along ``axis`` (for reduction none, where a repeat is ONNX's
    undefined case): ``count`` of ``size`` positions for each of ``other`` lines, half of them
    written negative."""
    lines = np.stack([R.permutation(size)[:count] for _ in range(other)], axis=1 - axis if axis < 2 else 0)
    return np.where(R.random(lines.shape) < 0.5, lines - size, lines)


def distinct_tuples(shape, count):
    """``count`` distinct index tuples into ``shape``, as (count, len(shape))."""
    flat = R.permutation(int(np.prod(shape)))[:count]
    return np.stack(np.unravel_index(flat, shape), axis=-1)


# (op, args, attrs): float args are differentiated, int args are fed as data
CASES = [
    ("cumsum", [n(3, 5)], {"axis": 1}),
    ("cumsum", [n(4, 3, 2)], {"axis": 0, "exclusive": True}),
    ("cumsum", [n(3, 5)], {"axis": -1, "reverse": True}),
    ("cumsum", [n(2, 6, 2)], {"axis": 1, "exclusive": True, "reverse": True}),
    ("gather_elements", [n(4, 5), ids(-4, 4, 6, 5)], {"axis": 0}),      # repeats and negative indices
    ("gather_elements", [n(3, 5, 2), ids(-5, 5, 3, 7, 2)], {"axis": 1}),
    ("gather_elements", [n(3, 5), ids(0, 5, 2, 3)], {"axis": -1}),      # indices smaller than the data
    ("gather_nd", [n(4, 5, 3), np.stack([ids(-4, 4, 6), ids(-5, 5, 6)], -1)], {}),
    ("gather_nd", [n(4, 5), ids(0, 4, 2, 3, 1)], {}),
    ("gather_nd", [n(3, 5, 2), ids(-5, 5, 3, 4, 1)], {"batch_dims": 1}),
    ("scatter_elements", [n(4, 5), distinct_along(4, 2, 5, 0), n(2, 5)], {"axis": 0}),
    ("scatter_elements", [n(3, 6), ids(-6, 6, 3, 4), n(3, 4)], {"axis": 1, "reduction": "add"}),
    ("scatter_nd", [n(5, 3), R.permutation(5)[:3].reshape(3, 1), n(3, 3)], {}),
    ("scatter_nd", [n(4, 5, 2), distinct_tuples((4, 5), 3), n(3, 2)], {}),
    ("scatter_nd", [n(4, 5), ids(-4, 4, 6, 2), n(6)], {"reduction": "add"}),  # repeats accumulate
    ("scatter_nd", [n(3, 5, 2), np.stack([R.permutation(5)[:2] for _ in range(3)])[..., None], n(3, 2, 2)],
     {"batch_dims": 1}),
]


def test_every_index_op_is_checked_here():
    assert {c[0] for c in CASES} == INDEX_OPS
    assert INDEX_OPS <= set(OPS)


@pytest.mark.parametrize("op,args,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_vjp_matches_finite_differences(op, args, attrs):
    report = check_op(op, args, attrs)
    differentiable = [i for i, a in enumerate(args) if np.asarray(a).dtype.kind == "f" and VJPS[op].fns[i]]
    assert len(report) == len(differentiable) > 0


# ---------------------------------------------------------------- against PyTorch


def _torch():
    return pytest.importorskip("torch")


def torch_cumsum(axis, exclusive=False, reverse=False):
    torch = _torch()

    def fn(x):
        y = x.flip(axis) if reverse else x
        y = y.cumsum(axis)
        if exclusive:
            size = y.shape[axis]
            y = torch.cat([torch.zeros_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, size - 1)], axis)
        return y.flip(axis) if reverse else y

    return fn


def wrapped(idx, size):
    torch = _torch()
    return torch.where(idx < 0, idx + size, idx)


def torch_gather_elements(axis):
    return lambda data, idx: _torch().gather(data, axis, wrapped(idx, data.shape[axis]))


def torch_gather_nd(batch_dims=0):
    torch = _torch()

    def fn(data, idx):
        lead = (torch.arange(idx.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 2)),) if batch_dims else ()
        return data[lead + tuple(idx[..., k] for k in range(idx.shape[-1]))]

    return fn


def torch_scatter_elements(axis, reduction="none"):
    torch = _torch()

    def fn(data, idx, upd):
        idx = wrapped(idx, data.shape[axis])
        return torch.scatter_add(data, axis, idx, upd) if reduction == "add" else torch.scatter(data, axis, idx, upd)

    return fn


def torch_scatter_nd(batch_dims=0, reduction="none"):
    torch = _torch()

    def fn(data, idx, upd):
        lead = (torch.arange(idx.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 2)),) if batch_dims else ()
        index = lead + tuple(idx[..., k] for k in range(idx.shape[-1]))
        return data.index_put(index, upd, accumulate=reduction == "add")

    return fn


def torch_fn(op, attrs):
    a = dict(attrs)
    if op == "cumsum":
        return torch_cumsum(a.get("axis", 0), a.get("exclusive", False), a.get("reverse", False))
    if op == "gather_elements":
        return torch_gather_elements(a.get("axis", 0))
    if op == "gather_nd":
        return torch_gather_nd(a.get("batch_dims", 0))
    if op == "scatter_elements":
        return torch_scatter_elements(a.get("axis", 0), a.get("reduction", "none"))
    return torch_scatter_nd(a.get("batch_dims", 0), a.get("reduction", "none"))


@pytest.mark.parametrize("op,args,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_forward_and_gradients_match_pytorch_in_float64(op, args, attrs):
    oracle(op, args, attrs, torch_fn(op, attrs))


@pytest.mark.parametrize("op,args,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_forward_and_gradients_match_pytorch_in_float32(op, args, attrs):
    """float32 against PyTorch's float64: within 1e-5 of the largest value."""
    torch = _torch()
    value, _, grads, w = run_op(op, args, attrs, dtype="float32")
    ts = [torch.tensor(np.asarray(a), requires_grad=np.asarray(a).dtype.kind == "f") for a in args]
    ref = torch_fn(op, attrs)(*ts)
    assert np.abs(value - ref.detach().numpy()).max() <= 1e-5 * np.abs(ref.detach().numpy()).max()
    (ref * torch.from_numpy(w)).sum().backward()
    for i, t in enumerate(ts):
        if t.requires_grad:
            g = t.grad.numpy()
            assert np.abs(grads[i] - g).max() <= 1e-5 * np.abs(g).max(), (op, i)


def test_overwritten_entries_pass_no_gradient_to_the_data():
    """scatter (none): the data's gradient is zero where updates replaced it; add: all of it."""
    data, upd = n(5, 3), n(2, 3)
    idx = np.array([[4], [1]])
    _, _, grads, w = run_op("scatter_nd", [data, idx, upd], {})
    assert np.all(grads[0][[1, 4]] == 0) and np.array_equal(grads[0][[0, 2, 3]], w[[0, 2, 3]])
    assert np.array_equal(grads[2], w[[4, 1]])
    _, _, grads, w = run_op("scatter_nd", [data, idx, upd], {"reduction": "add"})
    assert np.array_equal(grads[0], w)


# ---------------------------------------------------------------- integers at run time


def _int_graph(build, length):
    b = GraphBuilder()
    x = b.input("x", [None, length], "int64")
    outs = build(b, x)
    b.output("loss", b.op("sum", b.op("cast", outs[0], to="float")))  # a graph has a loss
    g = b.build()
    assert all(g.types[o].dtype == "int64" for o in outs)
    return g, outs


def test_position_ids_from_the_token_ids_at_run_time():
    """RoBERTa's position ids: a running sum of the non-padding mask, times the mask, plus the
    padding id, computed on int64 at run time for any batch size."""
    pad = 1

    def build(b, x):
        mask = b.op("logical", b.op("compare", x, b.op("constant", value=pad, shape=[], dtype="int64"),
                                    kind="equal"), kind="not")
        count = b.op("cumsum", mask, axis=1)
        return [b.op("add", b.op("mul", count, mask), b.op("constant", value=pad, shape=[], dtype="int64"))]

    g, (out,) = _int_graph(build, 9)
    for batch in (1, 4):
        x = ids(0, 4, batch, 9)
        mask = (x != pad).astype(np.int64)
        expect = np.cumsum(mask, axis=1) * mask + pad
        got = Executor(g, np, "float32").run({}, {"x": x}, [out])[out]
        assert got.dtype == np.int64 and np.array_equal(got, expect)


def test_decoder_ids_shifted_right_at_run_time():
    """BART's shift_tokens_right as the dynamo exporter writes it: the ids moved one place right
    by a scatter_nd on the transposed ids, the start token written by scatter_elements, -100
    replaced by the padding id with where, all on int64."""
    start, pad, length = 2, 1, 6

    def build(b, x):
        zeros = b.op("mul", x, b.op("constant", value=0, shape=[], dtype="int64"))
        body = b.op("transpose", b.op("slice", x, axes=[1], starts=[0], ends=[length - 1]), axes=[1, 0])
        positions = b.op("constant", value=[[k] for k in range(1, length)], shape=[length - 1, 1], dtype="int64")
        moved = b.op("transpose", b.op("scatter_nd", b.op("transpose", zeros, axes=[1, 0]), positions, body),
                     axes=[1, 0])
        first = b.op("slice", moved, axes=[1], starts=[0], ends=[1])
        started = b.op("scatter_elements", moved, b.op("mul", first, b.op("constant", value=0, shape=[],
                                                                              dtype="int64")),
                       b.op("add", b.op("mul", first, b.op("constant", value=0, shape=[], dtype="int64")),
                            b.op("constant", value=start, shape=[], dtype="int64")), axis=1)
        hidden = b.op("compare", started, b.op("constant", value=-100, shape=[], dtype="int64"), kind="equal")
        return [b.op("where", hidden, b.op("constant", value=pad, shape=[], dtype="int64"), started)]

    g, (out,) = _int_graph(build, length)
    x = ids(0, 50, 3, length)
    x[1, 2] = -100
    expect = np.concatenate([np.full((3, 1), start), x[:, :-1]], axis=1)
    expect[expect == -100] = pad
    got = Executor(g, np, "float64").run({}, {"x": x}, [out])[out]
    assert got.dtype == np.int64 and np.array_equal(got, expect)


def test_type_rules_refuse_the_batch_dim_and_mixed_dtypes():
    f, i = "float", "int64"
    with pytest.raises(ShapeError, match="batch"):
        OPS["cumsum"].infer([TensorType((None, 4), i)], OPS["cumsum"].normalise({"axis": 0}))
    with pytest.raises(ShapeError, match="batch"):
        OPS["gather_nd"].infer([TensorType((None, 4), f), TensorType((3, 1), i)], {"batch_dims": 0})
    assert OPS["gather_nd"].infer([TensorType((None, 4, 2), f), TensorType((None, 1), i)],
                                  {"batch_dims": 1}) == TensorType((None, 2), f)
    with pytest.raises(ShapeError, match="batch"):
        OPS["gather_elements"].infer([TensorType((None, 4), f), TensorType((None, 4), i)], {"axis": 0})
    with pytest.raises(ShapeError, match="updates"):
        OPS["scatter_nd"].infer([TensorType((5, 3), f), TensorType((2, 1), i), TensorType((2, 3), i)],
                                {"batch_dims": 0, "reduction": "none"})
    with pytest.raises(ShapeError, match="must have shape"):
        OPS["scatter_nd"].infer([TensorType((5, 3), f), TensorType((2, 1), i), TensorType((2, 4), f)],
                                {"batch_dims": 0, "reduction": "none"})
    with pytest.raises(ShapeError, match="reduction"):
        OPS["scatter_elements"].normalise({"reduction": "max"})
    with pytest.raises(ShapeError, match="float"):
        OPS["add"].infer([TensorType((3,), f), TensorType((3,), i)], {})
    assert OPS["mul"].infer([TensorType((None, 3), i), TensorType((3,), i)], {}) == TensorType((None, 3), i)
    assert OPS["where"].infer([TensorType((3,), i)] * 3, {}).dtype == i


# ---------------------------------------------------------------- constant folding


def _reference(op_type, arrays, **attrs):
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    names = [f"in{k}" for k in range(len(arrays))]
    node = helper.make_node(op_type, names, ["out"], **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("out", 0, None)],
                              initializer=[numpy_helper.from_array(np.asarray(a), nm) for a, nm in zip(arrays, names)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ReferenceEvaluator(model).run(None, {})[0]


FOLDS = [
    ("CumSum", [n(3, 4), np.array(1)], {}),
    ("CumSum", [ids(0, 5, 3, 4), np.array(0)], {"exclusive": 1}),
    ("CumSum", [n(3, 4), np.array(-1)], {"exclusive": 1, "reverse": 1}),
    ("GatherElements", [n(3, 4), ids(-3, 3, 2, 4)], {"axis": 0}),
    ("GatherND", [n(4, 5, 3), ids(-4, 4, 6, 2)], {}),
    ("GatherND", [n(3, 5, 2), ids(0, 5, 3, 4, 1)], {"batch_dims": 1}),
    ("ScatterElements", [n(4, 5), distinct_along(4, 2, 5, 0), n(2, 5)], {"axis": 0}),
    ("ScatterElements", [ids(0, 9, 3, 6), ids(-6, 6, 3, 4), ids(0, 9, 3, 4)], {"axis": 1, "reduction": "add"}),
    ("ScatterND", [n(4, 5, 2), distinct_tuples((4, 5), 3), n(3, 2)], {}),
    ("ScatterND", [ids(0, 9, 4, 5), ids(0, 4, 6, 2), ids(0, 9, 6)], {"reduction": "add"}),
    ("ScatterElements", [n(3, 6), ids(-6, 6, 3, 4), n(3, 4)], {"axis": 1, "reduction": "mul"}),  # constants only
    ("ScatterND", [ids(0, 9, 4, 5), ids(0, 4, 6, 2), ids(0, 9, 6)], {"reduction": "max"}),
    ("ScatterND", [n(4, 5), ids(-4, 4, 6, 1), n(6, 5)], {"reduction": "min"}),
    ("NonZero", [ids(0, 2, 3, 5)], {}),
]


@pytest.mark.parametrize("op_type,arrays,attrs", FOLDS, ids=[f"{c[0]}-{i}" for i, c in enumerate(FOLDS)])
def test_folding_matches_the_onnx_reference(op_type, arrays, attrs):
    from hpc_rlx.graph.onnx.importer import ONNX_OPS

    got = ONNX_OPS[op_type].fold([np.asarray(a) for a in arrays], dict(attrs))  # strings decoded, as the importer
    ref = _reference(op_type, arrays, **attrs)
    assert got.dtype == ref.dtype and np.array_equal(got, ref)


# ---------------------------------------------------------------- imported from PyTorch

EOS, VOCAB, SEQ, DIM = 2, 50, 7, 6


def _modules():
    torch = _torch()
    nn = torch.nn

    class PoolAtToken(nn.Module):
        """A sequence classifier that pools at its end-of-sequence token, as BART and T5 do."""

        def __init__(self, which):
            super().__init__()
            self.which = which
            self.embed, self.mix, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 3)

        def forward(self, x):
            h = torch.tanh(self.mix(self.embed(x)))
            pooled = h[x.eq(EOS), :].view(h.size(0), -1, h.size(-1))[:, self.which, :]
            return self.head(pooled)

    class IndexOps(nn.Module):
        """Position ids from the padding mask (RoBERTa), a float running sum, ids shifted right
        with a learnt start vector written by a scatter, and a gather at indices from the data."""

        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ + 2, DIM)
            self.start = nn.Parameter(torch.randn(DIM))
            self.head = nn.Linear(DIM, 3)

        def forward(self, x):
            mask = x.ne(1).int()
            positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + 1
            h = self.embed(x) + self.pos(positions)
            h = torch.cumsum(h, dim=1) / 4
            shifted = x.new_zeros(x.shape)
            shifted[:, 1:] = x[:, :-1].clone()
            shifted[:, 0] = EOS
            d = self.embed(shifted).clone()
            d[:, 0] = self.start.expand_as(d[:, 0])  # bare, TorchScript fixes the export's batch
            pick = (x > VOCAB // 2).long() * 2
            g = torch.gather(h + d, 1, pick.unsqueeze(-1).expand(-1, -1, DIM))
            return self.head(torch.tanh(g).mean(1))

    return PoolAtToken, IndexOps


def _tokens(batch, hits, seed):
    """Token ids with the end-of-sequence token ``hits`` times in every row, at varied places."""
    rng = np.random.default_rng(seed)
    x = rng.integers(3, VOCAB, (batch, SEQ))
    x[0, :2] = 1   # padding ids for the position ids, never over an end-of-sequence token
    for k, row in enumerate(x):
        row[rng.choice(np.arange(2 if k == 0 else 0, SEQ), hits, replace=False)] = EOS
    assert ((x == EOS).sum(1) == hits).all()
    return x


def _check_import(module, x, exporter, tmp_path):
    torch = _torch()
    ort = pytest.importorskip("onnxruntime")
    import torch.nn.functional as F

    from hpc_rlx.graph.onnx.importer import import_onnx

    from tests.support import onnx_zoo as zoo
    from tests.support.onnx_checks import _match, ours_forward, param_views

    module.eval()
    xt = torch.from_numpy(x)
    path = zoo.export(module, xt, tmp_path / f"{exporter}.onnx", exporter, "eval", optimize=False)
    imported = import_onnx(path)
    ours = ours_forward(imported, xt, train=False)
    assert rel(ours, ort.InferenceSession(str(path)).run(None, {"x": x})[0]) <= 1e-5
    for dtype, tol in (("float32", 1e-5), ("float64", TOL)):
        tdtype = torch.float64 if dtype == "float64" else torch.float32
        tm = __import__("copy").deepcopy(module).to(tdtype)
        logits = tm(xt)
        y = torch.arange(x.shape[0]) % logits.shape[-1]
        F.cross_entropy(logits, y).backward()
        g = imported.graph
        layout, flat = param_views(imported, g, dtype)
        grad = np.zeros_like(flat)
        Executor(g, np, dtype).forward_backward(layout.views(flat), layout.views(grad),
                                                {"x": x, "y": y.numpy()}, train=True, seed=0)
        named, grads = dict(tm.named_parameters()), layout.views(grad)
        matched = _match(imported, module)
        summed = {}
        for ir, (tname, transposed) in matched.items():
            summed[tname] = summed.get(tname, 0) + (grads[ir].T if transposed else grads[ir])
        assert set(summed) == set(named)
        for tname, ours_g in summed.items():
            assert rel(ours_g, named[tname].grad.numpy()) <= tol, (dtype, tname)
    return imported


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("which, hits", [(-1, 1), (0, 2), (1, 2), (-2, 3)])
def test_pooling_at_a_token_imports_as_a_gather(tmp_path, exporter, which, hits):
    """NonZero -> GatherND -> reshape (batch, -1, dim) -> the chosen hit per row: forward equal
    to ONNX Runtime and gradients equal to PyTorch's, for the last, first and k-th hit."""
    torch = _torch()
    torch.manual_seed(0)
    pool, _ = _modules()
    imported = _check_import(pool(which), _tokens(4, hits, seed=hits), exporter, tmp_path)
    assert "gather_nd" in {node.op for node in imported.graph.nodes}


@pytest.mark.parametrize("which, length", [(-1, SEQ), (1, SEQ), (-1, 1), (0, 1)])
def test_a_row_short_of_hits_pools_at_a_position_of_its_own(tmp_path, which, length):
    """Input against the model's contract (PyTorch's view fails, or mixes rows): a row with too
    few hits pools at its own first position (hits counted from the end) or last (from the
    start), never at another row's or out of bounds; the rows that hold enough pool as PyTorch."""
    torch = _torch()
    from hpc_rlx.graph.onnx.importer import import_onnx

    from tests.support import onnx_zoo as zoo
    from tests.support.onnx_checks import ours_forward

    torch.manual_seed(0)
    module = _modules()[0](which).eval()
    x = np.full((3, length), EOS)
    x[1] = 5        # no hit
    if length > 1:
        x = _tokens(3, 2, seed=4)
        x[1][x[1] == EOS] = 5
        x[2, np.flatnonzero(x[2] == EOS)[0]] = 5
    path = zoo.export(module, torch.from_numpy(np.full((3, length), EOS)), tmp_path / "m.onnx", "torchscript",
                      "eval", optimize=False)
    ours = ours_forward(import_onnx(path), torch.from_numpy(x), train=False)
    hits = [np.flatnonzero(row == EOS) for row in x]
    short = 0 if which < 0 else length - 1
    at = [h[which] if len(h) >= (-which if which < 0 else which + 1) else short for h in hits]
    with torch.no_grad():
        h = torch.tanh(module.mix(module.embed(torch.from_numpy(x))))
        ref = module.head(h[torch.arange(3), torch.tensor(at)]).numpy()
    assert at[1] == short
    assert rel(ours, ref) <= 1e-6


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_index_ops_on_data_import_and_train(tmp_path, exporter):
    torch = _torch()
    torch.manual_seed(1)
    _, index_ops = _modules()
    imported = _check_import(index_ops(), _tokens(3, 1, seed=5), exporter, tmp_path)
    ops = {node.op for node in imported.graph.nodes}
    assert {"cumsum", "gather_elements"} <= ops and ops & {"scatter_nd", "scatter_elements"}

