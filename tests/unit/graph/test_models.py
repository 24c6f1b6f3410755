"""Model builders: argument checking, structure, init, and that the models actually learn."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import ConfigError, GraphError
from hpc_rlx.graph import Executor, Graph, ParamLayout, build_model, init_params


def test_builders_are_deterministic_and_named():
    a = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, channels=[16, 32], kernel=3, hidden=64, pool="max")
    b = build_model("cnn", input_shape=[1, 8, 8], num_classes=10, channels=(16, 32), kernel=3, hidden=64, pool="max")
    assert a == b and a.fingerprint() == b.fingerprint()
    assert [p.name for p in a.params] == [
        "conv0.weight", "conv0.bias", "conv1.weight", "conv1.bias", "fc.weight", "fc.bias", "head.weight", "head.bias"]
    assert a.params[0].shape == (16, 1, 3, 3) and a.params[4].shape == (32 * 2 * 2, 64)
    assert a.meta["builder"] == "cnn" and a.meta["args"]["channels"] == [16, 32]


def test_mlp_flattens_any_input_shape():
    g = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[128, 128], activation="relu", dropout=0.0)
    assert g.nodes[0].op == "flatten" and g.params[0].shape == (64, 128)
    assert g.input("x").shape == (None, 1, 8, 8) and g.input("y").shape == (None,)
    flat = build_model("mlp", input_shape=(64,), num_classes=10, hidden=[128])
    assert flat.nodes[0].op == "linear"
    with_drop = build_model("mlp", input_shape=(64,), num_classes=10, hidden=[8, 8], dropout=0.5)
    assert [n.op for n in with_drop.nodes].count("dropout") == 2


def test_transformer_structure():
    g = build_model("transformer_lm", vocab_size=50, seq_len=12, d_model=64, n_heads=4, n_layers=2, d_ff=256)
    ops = [n.op for n in g.nodes]
    assert ops.count("causal_mask") == 2 and ops.count("layer_norm") == 5 and ops.count("embedding") == 1
    assert g.node("block0.attn.scores").shape == (None, 4, 12, 12)
    assert g.node("logits").shape == (None, 12, 50)
    tied = build_model("transformer_lm", vocab_size=50, seq_len=12, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                       tie_embeddings=True)
    assert "head.weight" not in [p.name for p in tied.params]
    assert len(tied.params) == len(g.params) - 1


@pytest.mark.parametrize(
    "kind,kwargs,fragment",
    [
        ("mlp", dict(input_shape=(4,), num_classes=0), "num_classes"),
        ("mlp", dict(input_shape=(4,), hidden=[8, -1]), "hidden"),
        ("mlp", dict(input_shape=(4,), activation="swish"), "activation"),
        ("mlp", dict(input_shape=(4,), dropout=1.0), "dropout"),
        ("mlp", dict(input_shape=()), "input_shape"),
        ("cnn", dict(input_shape=(8, 8)), "input_shape"),
        ("cnn", dict(input_shape=(1, 8, 8), pool="median"), "pool"),
        ("cnn", dict(input_shape=(1, 8, 8), hidden=-1), "hidden"),
        ("transformer_lm", dict(vocab_size=10, seq_len=4, d_model=30, n_heads=4), "d_model=30"),
        ("transformer_lm", dict(vocab_size=10, seq_len=0), "seq_len"),
        ("resnet", dict(), "unknown model kind 'resnet'"),
        ("mlp", dict(input_shape=(4,), widths=[3]), "does not take ['widths']"),
        ("transformer_lm", dict(vocab_size=10), "needs ['seq_len']"),
    ],
)
def test_bad_builder_arguments_raise_config_errors(kind, kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        build_model(kind, **kwargs)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "kind,kwargs,key,detail",
    [
        ("mlp", dict(input_shape=(4,), dropout=1.5), "dropout", " must be in [0, 1), got 1.5"),
        ("mlp", dict(input_shape=(4,), hidden=[8, "abc"]), "hidden", " must be a positive int, got 'abc'"),
        ("cnn", dict(input_shape=(8, 8)), "input_shape", " (C, H, W) must have 3 dims, got (8, 8)"),
        ("cnn", dict(input_shape=(1, 8, 8), hidden=-1), "hidden", " must be an int >= 0, got -1"),
        ("transformer_lm", dict(vocab_size=10, seq_len=4, d_model=30, n_heads=4), "d_model",
         "=30 must be divisible by n_heads=4"),
        ("transformer_lm", dict(vocab_size=10, seq_len=4, tie_embeddings="yes"), "tie_embeddings",
         " must be true or false, got 'yes'"),
    ],
)
def test_bad_builder_arguments_name_the_argument_apart_from_the_text(kind, kwargs, key, detail):
    """The builders' own argument names: config.spec restates them as `model.<key><detail>`."""
    with pytest.raises(ConfigError) as err:
        build_model(kind, **kwargs)
    assert type(err.value) is ConfigError
    assert (err.value.key, err.value.detail, str(err.value)) == (key, detail, f"{key}{detail}")


def test_builder_errors_about_no_argument_name_none():
    for kind, kwargs in (("resnet", {}), ("mlp", dict(input_shape=(4,), widths=[3]))):
        with pytest.raises(ConfigError) as err:
            build_model(kind, **kwargs)
        assert err.value.key is None


def test_file_kind_validates(tmp_path):
    p = tmp_path / "g.json"
    p.write_text("[]")
    with pytest.raises(GraphError, match="g.json"):
        build_model("file", path=str(p))


def test_init_schemes_follow_the_activation():
    relu = build_model("mlp", input_shape=(100,), num_classes=10, hidden=[400], activation="relu")
    tanh = build_model("mlp", input_shape=(100,), num_classes=10, hidden=[400], activation="tanh")
    assert relu.params[0].init["scheme"] == "he_normal"
    assert tanh.params[0].init["scheme"] == "xavier_uniform"
    for g, std in ((relu, np.sqrt(2 / 100)), (tanh, np.sqrt(2 / 500))):
        flat = np.empty(ParamLayout(g).size)
        init_params(g, flat, 1)
        w = ParamLayout(g).views(flat)["fc0.weight"]
        assert w.std() == pytest.approx(std, rel=0.05)
    lm = build_model("transformer_lm", vocab_size=10, seq_len=4, d_model=8, n_heads=2, n_layers=1, d_ff=8)
    flat = np.empty(ParamLayout(lm).size)
    init_params(lm, flat, 0)
    v = ParamLayout(lm).views(flat)
    assert (v["block0.ln1.gamma"] == 1).all() and (v["block0.ln1.beta"] == 0).all()
    assert v["tok_emb"].std() == pytest.approx(0.02, rel=0.3)


def sgd(g, feeds, steps, lr, dtype="float32", seed=0):
    layout = ParamLayout(g)
    params = np.empty(layout.size, dtype)
    grads = np.empty(layout.size, dtype)
    init_params(g, params, seed)
    ex = Executor(g, np, dtype)
    pv, gv = layout.views(params), layout.views(grads)
    losses = []
    for step in range(steps):
        out = ex.forward_backward(pv, gv, feeds, seed=step)
        losses.append(out["loss"])
        params -= lr * grads
    return losses, ex.evaluate(pv, feeds)


def test_models_learn_a_fixed_batch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 32)
    for g, lr in (
        (build_model("mlp", input_shape=(1, 8, 8), num_classes=4, hidden=[32]), 0.5),
        (build_model("cnn", input_shape=(1, 8, 8), num_classes=4, channels=[8], kernel=3, hidden=16), 0.3),
    ):
        losses, final = sgd(g, {"x": x, "y": y}, 40, lr)
        assert losses[-1] < 0.5 * losses[0], (g.name, losses[0], losses[-1])
        assert final["correct"] >= 24
    tokens = rng.integers(0, 8, (8, 9))
    lm = build_model("transformer_lm", vocab_size=8, seq_len=8, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    losses, final = sgd(lm, {"x": tokens[:, :-1], "y": tokens[:, 1:]}, 60, 0.5)
    assert losses[-1] < 0.6 * losses[0], (losses[0], losses[-1])


def test_user_graph_trains_like_a_built_one(tmp_path):
    """A graph exported to JSON and loaded back trains identically to the builder's graph."""
    g = build_model("mlp", input_shape=(6,), num_classes=3, hidden=[10], activation="tanh")
    path = tmp_path / "user.json"
    path.write_text(g.to_json())
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((12, 6)).astype(np.float32), "y": rng.integers(0, 3, 12)}
    a, _ = sgd(g, feeds, 5, 0.1)
    b, _ = sgd(Graph.from_file(path), feeds, 5, 0.1)
    assert a == b
