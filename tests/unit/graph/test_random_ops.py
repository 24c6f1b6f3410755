"""Random draws a model makes itself (hpc_rlx/graph/ops/random.py, graph/onnx/map_random.py):
their distributions, their reproducibility, evaluation at their expectation, and stochastic
depth as PyTorch's exporters write it, against PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout, init_params

N = 200_000


def _builder() -> GraphBuilder:
    """A graph over x (batch, 4) with the loss every graph has (on x itself: never run here)."""
    b = GraphBuilder()
    b.input("x", [None, 4])
    b.input("y", [None], "int64")
    b.output("loss", b.op("softmax_cross_entropy", "x", "y"))
    return b


def _draw_graph(op: str, **attrs):
    b = _builder()
    b.op(op, "x", name="draw", **attrs)
    return b.build()


def _run(g, x, train=True, seed=0):
    return Executor(g, np, "float64").run({}, {"x": x}, ["draw"], train=train, seed=seed)["draw"]


@pytest.mark.parametrize("dist, a, b, mean, std", [
    ("uniform", 0.0, 1.0, 0.5, (1 / 12) ** 0.5),
    ("uniform", -2.0, 3.0, 0.5, 5 * (1 / 12) ** 0.5),
    ("normal", 0.0, 1.0, 0.0, 1.0),
    ("normal", 1.5, 0.25, 1.5, 0.25),
])
def test_random_like_draws_its_distribution_and_evaluates_at_the_mean(dist, a, b, mean, std):
    g = _draw_graph("random_like", dist=dist, a=a, b=b)
    x = np.zeros((N // 4, 4))
    v = _run(g, x)
    assert v.shape == x.shape
    # 200k draws: the sample mean is within 5 standard errors, the spread within 2%
    assert abs(v.mean() - mean) < 5 * std / N ** 0.5
    assert v.std() == pytest.approx(std, rel=0.02)
    if dist == "uniform":
        assert v.min() >= a and v.max() < b
    else:   # a normal's tails: about 4.55% beyond two standard deviations
        assert np.mean(np.abs(v - mean) > 2 * std) == pytest.approx(0.0455, abs=0.004)
    assert (_run(g, x, train=False) == mean).all()


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_bernoulli_draws_ones_with_its_probability_and_evaluates_at_it(p):
    b = _builder()
    probs = b.op("where", "x", b.op("constant", value=p, dtype="float", shape=[]), b.op("constant", value=p, dtype="float", shape=[]))
    b.op("bernoulli", probs, name="draw")
    g = b.build()
    x = np.zeros((N // 4, 4))
    v = _run(g, x)
    assert set(np.unique(v)) <= {0.0, 1.0}
    assert v.mean() == pytest.approx(p, abs=5 * (p * (1 - p) / N) ** 0.5 + 1e-12)
    assert (_run(g, x, train=False) == p).all()


def test_draws_repeat_with_the_seed_and_differ_by_seed_and_node():
    b = _builder()
    first = b.op("random_like", "x", dist="uniform", a=0.0, b=1.0, name="first")
    second = b.op("random_like", "x", dist="uniform", a=0.0, b=1.0, name="second")
    assert (first, second) == ("first", "second")
    g = b.build()
    ex = Executor(g, np, "float64")
    x = np.zeros((64, 4))

    def draw(seed):
        out = ex.run({}, {"x": x}, ["first", "second"], train=True, seed=seed)
        return out["first"], out["second"]

    a1, b1 = draw(7)
    a2, b2 = draw(7)
    c1, _ = draw(8)
    assert np.array_equal(a1, a2) and np.array_equal(b1, b2)     # a run repeats exactly
    assert not np.array_equal(a1, b1)                             # each node its own draw
    assert not np.array_equal(a1, c1)                             # each step (seed) its own
    with pytest.raises(ValueError, match="needs a seed"):
        ex.run({}, {"x": x}, ["first"], train=True, seed=None)


def test_no_gradient_flows_through_a_draw():
    """A mask drawn from an activation: the weights under it get the gradient of the masked
    product alone (the draw's own input gets none)."""
    b = GraphBuilder()
    b.input("x", [None, 3])
    b.input("y", [None], "int64")
    h = b.op("linear", "x", b.param("w", [3, 3], {"scheme": "normal", "std": 1.0}), name="h")
    mask = b.op("bernoulli", b.op("sigmoid", h), name="mask")
    b.output("loss", b.op("softmax_cross_entropy", b.op("mul", h, mask), "y"))
    g = b.build()
    layout = ParamLayout(g)
    params, grads = np.empty(layout.size), np.empty(layout.size)
    init_params(g, params, 0)
    x = np.random.default_rng(1).standard_normal((16, 3))
    y = np.random.default_rng(2).integers(0, 3, 16)
    ex = Executor(g, np, "float64")
    ex.forward_backward(layout.views(params), layout.views(grads), {"x": x, "y": y}, train=True, seed=5)
    m = ex.run(layout.views(params), {"x": x}, ["mask"], train=True, seed=5)["mask"]
    # the same gradient by hand: d loss / d w through h * m with m held fixed
    w = layout.views(params)["w"]
    logits = (x @ w) * m
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    prob[np.arange(16), y] -= 1
    expected = x.T @ (prob / 16 * m)
    assert np.allclose(layout.views(grads)["w"], expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ stochastic depth from PyTorch

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402


class StochasticDepthNet(torch.nn.Module):
    """A residual block with stochastic depth as torchvision's StochasticDepth(mode="row")
    and timm's DropPath write it: one Bernoulli(keep) per sample, divided by keep."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        y = self.block(x)
        if self.training and self.p > 0:
            keep = 1 - self.p
            noise = torch.empty([x.shape[0], 1], dtype=x.dtype).bernoulli_(keep)
            y = y * noise.div_(keep)
        return self.head(x + y)


def _export(module, path, exporter: str):
    import warnings
    module.train()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=False, input_names=["x"],
                              output_names=["logits"], dynamic_shapes=({0: torch.export.Dim("batch")},))
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=["x"], output_names=["logits"],
                              dynamic_axes={"x": {0: "batch"}}, training=torch.onnx.TrainingMode.TRAINING)
    return import_onnx(str(path))


def _forward(imported, x, train: bool, seed: int = 0):
    g = imported.graph
    node = g.meta["onnx"]["output_node"]
    params = {p.name: imported.initial[p.name] for p in g.params}
    return Executor(g, np, "float64").run(params, {"x": x}, [node], train=train, seed=seed)[node]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_stochastic_depth_drops_whole_rows_in_training_and_is_identity_in_eval(tmp_path, exporter):
    torch.manual_seed(0)
    module = StochasticDepthNet(p=0.5)
    imported = _export(module, tmp_path / "sd.onnx", exporter)
    assert {n.op for n in imported.graph.nodes} >= {"bernoulli"}
    x = np.random.default_rng(3).standard_normal((4000, 8))
    xt = torch.from_numpy(x).double()
    m = module.double().eval()
    with torch.no_grad():
        kept = m.head(xt + m.block(xt) / 0.5).numpy()       # a row whose mask drew 1
        dropped = m.head(xt).numpy()                         # a row whose mask drew 0
        evaluated = m(xt).numpy()
    assert np.allclose(_forward(imported, x, train=False), evaluated, rtol=1e-10, atol=1e-12)
    out = _forward(imported, x, train=True, seed=1)
    is_kept = np.isclose(out, kept, rtol=1e-10, atol=1e-12).all(1)
    is_dropped = np.isclose(out, dropped, rtol=1e-10, atol=1e-12).all(1)
    assert (is_kept ^ is_dropped).all(), "every row is either kept and scaled, or dropped"
    assert is_kept.mean() == pytest.approx(0.5, abs=5 * (0.25 / 4000) ** 0.5)
    assert np.array_equal(out, _forward(imported, x, train=True, seed=1))
    assert not np.array_equal(out, _forward(imported, x, train=True, seed=2))


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_stochastic_depth_at_p_zero_trains_like_pytorch(tmp_path, exporter):
    """A file with the draw at p ~ 0 (1e-9: 1.0 in float32) keeps everything: loss and
    gradients equal PyTorch autograd on the same module at p = 0."""
    torch.manual_seed(1)
    module = StochasticDepthNet(p=1e-9)
    imported = _export(module, tmp_path / "sd.onnx", exporter)
    assert "bernoulli" in {n.op for n in imported.graph.nodes}
    module.p = 0.0
    g, meta = imported.graph, imported.graph.meta["onnx"]
    layout = ParamLayout(g)
    flat = np.empty(layout.size)
    for name, view in layout.views(flat).items():
        view[...] = imported.initial[name]
    grads = np.zeros_like(flat)
    x = np.random.default_rng(4).standard_normal((16, 8))
    y = np.random.default_rng(5).integers(0, 3, 16)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grads), {"x": x, "y": y},
                                                        train=True, seed=0)
    m = module.double().train()
    loss = torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    assert out["loss"] == pytest.approx(loss.item(), rel=1e-10)
    named = dict(m.named_parameters())
    torch_names = {**meta.get("torch_names", {}), **meta.get("transposed", {})}
    assert set(torch_names.values()) == set(named), torch_names
    for ir, name in torch_names.items():
        got = layout.views(grads)[ir]
        got = got.T if ir in meta.get("transposed", {}) else got
        assert np.allclose(got, named[name].grad.numpy(), rtol=1e-9, atol=1e-12), name


def test_the_exported_model_keeps_a_stochastic_depth_branch_whole(tmp_path):
    """python -m hpc_rlx.export writes the inference forward: each draw at its expectation,
    which ONNX Runtime then computes as PyTorch's eval mode does."""
    pytest.importorskip("onnxruntime")
    from hpc_rlx.export.command import main
    from hpc_rlx.export.onnx_source import SOURCE_FILE
    from tests.mpi.export.test_export import fake_run, ort_run, rel_err

    torch.manual_seed(2)
    module = StochasticDepthNet(p=0.5)
    imported = _export(module, tmp_path / "sd.onnx", "dynamo")
    params = {p.name: imported.initial[p.name].astype(np.float32) for p in imported.graph.params}
    fake_run(tmp_path / "run", imported.graph, params)
    (tmp_path / "run" / SOURCE_FILE).write_bytes((tmp_path / "sd.onnx").read_bytes())
    assert main([str(tmp_path / "run"), "--onnx", str(tmp_path / "out.onnx")]) == 0
    x = np.random.default_rng(6).standard_normal((5, 8)).astype(np.float32)
    with torch.no_grad():
        expected = module.float().eval()(torch.from_numpy(x)).numpy()
    assert rel_err(ort_run(tmp_path / "out.onnx", {"x": x}), expected) <= 1e-5
