"""PyTorch (CPU) as an external oracle: same weights, same batch, same loss and gradients.

Relative error per parameter: <= 1e-5 in float32, <= 1e-10 in float64 (the issue's bound).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout, build_model, init_params

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

TOL = {"float32": 1e-5, "float64": 1e-10}
TDTYPE = {"float32": torch.float32, "float64": torch.float64}


def engine(g, dtype, feeds, seed=0):
    """Initialise, jitter (so no parameter is exactly zero), run one forward_backward."""
    layout = ParamLayout(g)
    params64 = np.empty(layout.size)
    init_params(g, params64, seed)
    params64 += 0.05 * np.random.default_rng(seed + 1).standard_normal(layout.size)
    params = params64.astype(dtype)
    grads = np.empty(layout.size, dtype)
    out = Executor(g, np, dtype).forward_backward(layout.views(params), layout.views(grads), feeds)
    return out, layout.views(params), layout.views(grads)


def load(module_param, value, transpose=False):
    with torch.no_grad():
        module_param.copy_(torch.from_numpy(np.ascontiguousarray(value.T if transpose else value)))


def compare(out, grads, loss_t, mapping, dtype):
    """mapping: our name -> (torch parameter, transposed?)."""
    tol = TOL[dtype]
    assert out["loss"] == pytest.approx(loss_t.item(), rel=tol)
    assert set(mapping) == set(grads)
    total = np.sqrt(sum(np.linalg.norm(p.grad.numpy()) ** 2 for p, _ in mapping.values()))
    for name, (p, transposed) in mapping.items():
        ref = p.grad.numpy()
        ours = grads[name].T if transposed else grads[name]
        if np.linalg.norm(ref) < 1e-6 * total:
            # Analytically zero (the attention key bias: softmax ignores a per-query shift);
            # both sides are rounding noise, so only their size can be compared.
            assert np.linalg.norm(ours) <= tol * total, name
            continue
        err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def linear_map(prefix, layer, mapping, bias=True):
    mapping[f"{prefix}.weight"] = (layer.weight, True)
    if bias:
        mapping[f"{prefix}.bias"] = (layer.bias, False)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_mlp_matches_torch(dtype, activation):
    g = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[32, 24], activation=activation)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1, 8, 8)).astype(dtype)
    y = rng.integers(0, 10, 16)
    out, params, grads = engine(g, dtype, {"x": x, "y": y})

    act = nn.ReLU if activation == "relu" else nn.Tanh
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), act(), nn.Linear(32, 24), act(), nn.Linear(24, 10))
    model = model.to(TDTYPE[dtype])
    mapping = {}
    for prefix, layer in (("fc0", model[1]), ("fc1", model[3]), ("head", model[5])):
        linear_map(prefix, layer, mapping)
    for name, (p, tr) in mapping.items():
        load(p, params[name], tr)
    loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    compare(out, grads, loss, mapping, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("pool", ["max", "avg"])
def test_cnn_matches_torch(dtype, pool):
    g = build_model("cnn", input_shape=(2, 9, 8), num_classes=5, channels=[4, 6], kernel=3, hidden=12, pool=pool)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 2, 9, 8)).astype(dtype)
    y = rng.integers(0, 5, 8)
    out, params, grads = engine(g, dtype, {"x": x, "y": y})

    pool_layer = nn.MaxPool2d if pool == "max" else nn.AvgPool2d
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), pool_layer(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), pool_layer(2),
        nn.Flatten(), nn.Linear(6 * 2 * 2, 12), nn.ReLU(), nn.Linear(12, 5),
    ).to(TDTYPE[dtype])
    mapping = {
        "conv0.weight": (model[0].weight, False), "conv0.bias": (model[0].bias, False),
        "conv1.weight": (model[3].weight, False), "conv1.bias": (model[3].bias, False),
    }
    linear_map("fc", model[7], mapping)
    linear_map("head", model[9], mapping)
    for name, (p, tr) in mapping.items():
        load(p, params[name], tr)
    loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    compare(out, grads, loss, mapping, dtype)


class TorchBlock(nn.Module):
    def __init__(self, D, H, Fd):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.fc, self.proj = nn.Linear(D, Fd), nn.Linear(Fd, D)

    def forward(self, h):
        B, T, D = h.shape
        a = self.ln1(h)
        q, k, v = (m(a).view(B, T, self.H, D // self.H).transpose(1, 2) for m in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        h = h + self.o(o)
        return h + self.proj(F.gelu(self.fc(self.ln2(h)), approximate="tanh"))


class TorchLM(nn.Module):
    def __init__(self, V, T, D, H, L, Fd, tie):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList(TorchBlock(D, H, Fd) for _ in range(L))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        h = self.tok(ids) + self.pos
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h))


@pytest.mark.parametrize("dtype,tie", [("float32", False), ("float64", False), ("float64", True)])
def test_transformer_lm_matches_torch(dtype, tie):
    V, T, D, H, L, Fd = 23, 7, 16, 4, 2, 24
    g = build_model("transformer_lm", vocab_size=V, seq_len=T, d_model=D, n_heads=H, n_layers=L, d_ff=Fd,
                    tie_embeddings=tie)
    rng = np.random.default_rng(2)
    x = rng.integers(0, V, (5, T))
    y = rng.integers(0, V, (5, T))
    out, params, grads = engine(g, dtype, {"x": x, "y": y})

    model = TorchLM(V, T, D, H, L, Fd, tie).to(TDTYPE[dtype])
    mapping = {"tok_emb": (model.tok.weight, False), "pos_emb": (model.pos, False)}
    for i, blk in enumerate(model.blocks):
        p = f"block{i}"
        for ln, mod in (("ln1", blk.ln1), ("ln2", blk.ln2)):
            mapping[f"{p}.{ln}.gamma"], mapping[f"{p}.{ln}.beta"] = (mod.weight, False), (mod.bias, False)
        for nm, mod in (("q", blk.q), ("k", blk.k), ("v", blk.v), ("out", blk.o)):
            linear_map(f"{p}.attn.{nm}", mod, mapping)
        linear_map(f"{p}.mlp.fc", blk.fc, mapping)
        linear_map(f"{p}.mlp.proj", blk.proj, mapping)
    mapping["ln_f.gamma"], mapping["ln_f.beta"] = (model.ln_f.weight, False), (model.ln_f.bias, False)
    if not tie:
        linear_map("head", model.head, mapping, bias=False)
    for name, (p, tr) in mapping.items():
        load(p, params[name], tr)
    logits = model(torch.from_numpy(x))
    loss = F.cross_entropy(logits.reshape(-1, V), torch.from_numpy(y).reshape(-1))
    loss.backward()
    compare(out, grads, loss, mapping, dtype)
    assert out["correct"] == float((logits.argmax(-1).numpy() == y).sum())


# ---------------------------------------------------------------- single ops with odd settings, float64


def op_vs_torch(op, arrays, attrs, torch_fn):
    """Loss = sum(op(*arrays) * w); compare value and every gradient with PyTorch."""
    b = GraphBuilder()
    names = [b.param(f"a{i}", list(a.shape), {"scheme": "zeros"}) for i, a in enumerate(arrays)]
    out = b.op(op, *names, **attrs)
    w = np.random.default_rng(5).standard_normal(b.type_of(out).shape)
    b.input("w", list(w.shape))
    b.output("loss", b.op("sum", b.op("mul", out, "w")))
    g = b.build()
    layout = ParamLayout(g)
    flat, grad = np.empty(layout.size), np.empty(layout.size)
    layout.pack({f"a{i}": a for i, a in enumerate(arrays)}, flat)
    res = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grad), {"w": w})
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    loss = (torch_fn(*ts) * torch.from_numpy(w)).sum()
    loss.backward()
    assert res["loss"] == pytest.approx(loss.item(), rel=1e-10)
    for i, t in enumerate(ts):
        ours = layout.views(grad)[f"a{i}"]
        assert np.linalg.norm(ours - t.grad.numpy()) <= 1e-10 * np.linalg.norm(t.grad.numpy())


def test_ops_with_odd_settings_match_torch():
    r = np.random.default_rng(9)
    x = r.standard_normal((3, 2, 9, 7))
    op_vs_torch("conv2d", [x, r.standard_normal((4, 2, 3, 2)), r.standard_normal(4)],
                {"stride": [2, 3], "padding": [1, 2]},
                lambda a, w, b: F.conv2d(a, w, b, stride=(2, 3), padding=(1, 2)))
    op_vs_torch("max_pool2d", [x], {"kernel": 3, "stride": 2, "padding": 1},
                lambda a: F.max_pool2d(a, 3, 2, 1))
    op_vs_torch("avg_pool2d", [x], {"kernel": [3, 2], "stride": [2, 1], "padding": [1, 1]},
                lambda a: F.avg_pool2d(a, (3, 2), (2, 1), (1, 1), count_include_pad=True))
    op_vs_torch("layer_norm", [r.standard_normal((4, 3, 5)), r.standard_normal(5), r.standard_normal(5)], {},
                lambda a, gm, bt: F.layer_norm(a, (5,), gm, bt, eps=1e-5))
    op_vs_torch("gelu", [3 * r.standard_normal((4, 6))], {}, lambda a: F.gelu(a, approximate="tanh"))
    op_vs_torch("sigmoid", [8 * r.standard_normal((4, 6))], {}, torch.sigmoid)
    op_vs_torch("softmax", [r.standard_normal((3, 4, 5))], {"axis": 1}, lambda a: torch.softmax(a, 1))


def test_cross_entropy_is_stable_for_huge_logits():
    b = GraphBuilder()
    logits = b.param("logits", [4, 3], {"scheme": "zeros"})
    b.input("y", [4], "int64")
    b.output("loss", b.op("softmax_cross_entropy", logits, "y"))
    g = b.build()
    z = np.array([[1000.0, 0.0, -1000.0], [-800.0, 800.0, 0.0], [0.0, 0.0, 0.0], [5e3, 5e3, -5e3]])
    y = np.array([0, 0, 2, 1])
    layout = ParamLayout(g)
    flat, grad = z.reshape(-1).copy(), np.empty(12)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grad), {"y": y})
    tz = torch.tensor(z, requires_grad=True)
    ref = F.cross_entropy(tz, torch.from_numpy(y))
    ref.backward()
    assert np.isfinite(out["loss"]) and out["loss"] == pytest.approx(ref.item(), rel=1e-12)
    np.testing.assert_allclose(grad.reshape(4, 3), tz.grad.numpy(), rtol=1e-12, atol=1e-15)
