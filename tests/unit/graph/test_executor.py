"""Executor semantics the runtime relies on: overwritten gradient views, grad_scale, mean loss,
no gradient storage allocated per step, activations freed early, strict feeds, dropout seeds."""

from __future__ import annotations

import threading
import tracemalloc
import weakref

import numpy as np
import pytest

from hpc_rlx.base.errors import DataError, DeviceError, GraphError
from hpc_rlx.graph import OPS, Executor, GraphBuilder, ParamLayout, build_model, init_params

R = np.random.default_rng(3)


def setup(g, dtype="float32", seed=0):
    layout = ParamLayout(g)
    params = np.empty(layout.size, dtype)
    grads = np.empty(layout.size, dtype)
    init_params(g, params, seed)
    return layout, params, grads, layout.views(params), layout.views(grads)


def digits_batch(b=6, dtype=np.float32):
    return {"x": R.standard_normal((b, 1, 8, 8)).astype(dtype), "y": R.integers(0, 10, b)}


MLP = dict(input_shape=(1, 8, 8), num_classes=10, hidden=[16, 12])


def test_forward_backward_overwrites_grads_and_scales():
    g = build_model("mlp", **MLP)
    layout, params, grads, pv, gv = setup(g, "float64")
    ex = Executor(g, np, "float64")
    feeds = digits_batch(dtype=np.float64)
    grads[:] = np.nan  # stale garbage must not leak into the result
    out1 = ex.forward_backward(pv, gv, feeds, seed=0)
    g1 = grads.copy()
    assert np.isfinite(g1).all() and np.abs(g1).sum() > 0
    grads[:] = 123.0
    out2 = ex.forward_backward(pv, gv, feeds, seed=0, grad_scale=6.0)
    np.testing.assert_allclose(grads, 6.0 * g1, rtol=1e-12)
    assert out1 == out2 and set(out1) == {"loss", "correct"}
    assert all(type(v) is float for v in out1.values())


def test_loss_is_the_batch_mean():
    g = build_model("mlp", **MLP)
    _, _, grads, pv, gv = setup(g, "float64")
    ex = Executor(g, np, "float64")
    f = digits_batch(dtype=np.float64)
    doubled = {k: np.concatenate([v, v]) for k, v in f.items()}
    o1 = ex.forward_backward(pv, gv, f)
    g1 = grads.copy()
    o2 = ex.forward_backward(pv, gv, doubled)
    assert o2["loss"] == pytest.approx(o1["loss"], rel=1e-12)
    assert o2["correct"] == 2 * o1["correct"]
    np.testing.assert_allclose(grads, g1, rtol=1e-10, atol=1e-14)


def test_outputs_match_a_direct_computation():
    g = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[])
    _, _, _, pv, gv = setup(g, "float64")
    x, y = R.standard_normal((7, 4)), R.integers(0, 3, 7)
    logits = x @ pv["head.weight"] + pv["head.bias"]
    z = logits - logits.max(1, keepdims=True)
    loss = np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(7), y])
    out = Executor(g, np, "float64").forward_backward(pv, gv, {"x": x, "y": y})
    assert out["loss"] == pytest.approx(loss, rel=1e-12)
    assert out["correct"] == float((logits.argmax(1) == y).sum())
    assert Executor(g, np, "float64").evaluate(pv, {"x": x, "y": y}) == out


def test_grads_written_into_the_callers_flat_buffer():
    g = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, channels=[4], hidden=8)
    layout, params, grads, pv, gv = setup(g)
    Executor(g).forward_backward(pv, gv, digits_batch())
    for name, v in gv.items():
        assert np.shares_memory(v, grads)
        off = layout.offsets[name]
        np.testing.assert_array_equal(grads[off: off + v.size], v.reshape(-1))


def test_no_gradient_storage_allocated_per_step():
    """Wide weights, tiny batch: gradient storage would dwarf everything else the step needs."""
    g = build_model("mlp", input_shape=(1024,), num_classes=4, hidden=[1024, 512])
    layout, params, grads, pv, gv = setup(g)
    ex = Executor(g)
    feeds = {"x": R.standard_normal((2, 1024)).astype(np.float32), "y": R.integers(0, 4, 2)}
    ex.forward_backward(pv, gv, feeds, seed=0)
    tracemalloc.start()
    try:
        ex.forward_backward(pv, gv, feeds, seed=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert layout.size * 4 > 4_000_000
    assert peak < layout.size * 4 / 10, f"peak {peak} bytes vs {layout.size * 4} bytes of gradients"


def test_activations_are_freed_as_soon_as_possible(monkeypatch):
    """Record every node output with a weak reference; check what is still alive mid-pass."""
    alive_at = {}
    refs = {}

    def recording(opdef):
        def forward(xp, args, attrs, ctx):
            out, saved = opdef.forward(xp, args, attrs, ctx)
            refs[ctx.node] = weakref.ref(out)
            return out, saved

        return opdef.__class__(**{**opdef.__dict__, "forward": forward})

    def snapshot(tag):
        alive_at[tag] = {k for k, r in refs.items() if r() is not None}

    def spy_forward(xp, args, attrs, ctx):
        snapshot(f"forward:{ctx.node}")
        return args[0] * 1.0, None

    from hpc_rlx.graph.registry import VJPS, VJPRule

    for name in ("linear", "relu", "tanh", "softmax_cross_entropy", "correct_count"):
        monkeypatch.setitem(OPS, name, recording(OPS[name]))
    monkeypatch.setitem(OPS, "spy", OPS["relu"].__class__("spy", spy_forward, lambda t, a: t[0], (1, 1)))

    def spy_vjp(xp, g, args, ans, s, a, out):
        snapshot("backward:spy")
        return g

    monkeypatch.setitem(VJPS, "spy", VJPRule((spy_vjp,), (), False))

    b = GraphBuilder()
    b.input("x", [None, 6])
    b.input("y", [None], "int64")
    init = {"scheme": "normal", "std": 0.5}
    h0 = b.op("linear", "x", b.param("w0", [6, 6], init), name="h0")
    a0 = b.op("relu", b.op("spy", h0, name="early"), name="a0")
    h1 = b.op("linear", a0, b.param("w1", [6, 6], init), name="h1")
    a1 = b.op("tanh", h1, name="a1")
    logits = b.op("linear", a1, b.param("w2", [6, 3], init), name="logits")
    late = b.op("spy", logits, name="late")
    b.output("loss", b.op("softmax_cross_entropy", late, "y", name="xent"))
    g = b.build()
    _, _, _, pv, gv = setup(g, "float64")
    Executor(g, np, "float64").forward_backward(pv, gv, {"x": R.standard_normal((5, 6)), "y": R.integers(0, 3, 5)})

    fwd = alive_at["forward:late"]
    # Pre-activations feed only a relu/tanh whose VJP reads its own output: gone already.
    assert "h0" not in fwd and "h1" not in fwd
    # Inputs of a weight gradient and outputs read by their own VJP are kept.
    assert {"a0", "a1", "logits"} <= fwd
    # By the time the backward pass is back at the first layer, everything later is gone.
    assert alive_at["backward:spy"].isdisjoint({"a1", "logits", "h1"})
    assert all(r() is None for r in refs.values())  # nothing outlives the call


def test_unused_parameter_gets_zero_gradient():
    b = GraphBuilder()
    b.input("x", [None, 3])
    b.input("y", [None], "int64")
    w = b.param("w", [3, 2], {"scheme": "normal", "std": 1.0})
    b.param("unused", [4], {"scheme": "ones"})
    b.output("loss", b.op("softmax_cross_entropy", b.op("matmul", "x", w), "y"))
    g = b.build()
    layout, params, grads, pv, gv = setup(g)
    grads[:] = 7.0
    Executor(g).forward_backward(pv, gv, {"x": R.standard_normal((4, 3)).astype(np.float32), "y": R.integers(0, 2, 4)})
    assert (gv["unused"] == 0).all() and (gv["w"] != 7.0).all()


def test_shared_parameter_accumulates_over_uses():
    g = build_model("transformer_lm", vocab_size=9, seq_len=4, d_model=8, n_heads=2, n_layers=1, d_ff=8,
                    tie_embeddings=True)
    layout, params, grads, pv, gv = setup(g, "float64")
    ex = Executor(g, np, "float64")
    feeds = {"x": R.integers(0, 9, (3, 4)), "y": R.integers(0, 9, (3, 4))}
    grads[:] = 0.0
    ex.forward_backward(pv, gv, feeds)
    clean = grads.copy()
    grads[:] = 1e6
    ex.forward_backward(pv, gv, feeds)
    np.testing.assert_array_equal(grads, clean)


def test_float32_default_and_float64_on_request():
    g = build_model("mlp", **MLP)
    assert Executor(g).dtype == np.float32
    _, p32, g32, pv32, gv32 = setup(g, "float32")
    _, p64, g64, pv64, gv64 = setup(g, "float64")
    f64 = digits_batch(dtype=np.float64)
    f32 = {"x": f64["x"].astype(np.float32), "y": f64["y"]}
    o32 = Executor(g, np, "float32").forward_backward(pv32, gv32, f32)
    o64 = Executor(g, np, np.float64).forward_backward(pv64, gv64, f64)
    assert o32["loss"] == pytest.approx(o64["loss"], rel=1e-5)
    rel = np.linalg.norm(g32 - g64) / np.linalg.norm(g64)
    assert 0 < rel < 1e-5
    with pytest.raises(ValueError, match="float16"):
        Executor(g, np, "float16")


def test_feeds_are_checked_strictly():
    g = build_model("mlp", **MLP)
    _, _, _, pv, gv = setup(g)
    ex = Executor(g)
    good = digits_batch()
    ex.forward_backward(pv, gv, good)
    with pytest.raises(DataError, match="'x'.*float64.*float32"):
        ex.forward_backward(pv, gv, {**good, "x": good["x"].astype(np.float64)})
    with pytest.raises(DataError, match="'y'.*integers"):
        ex.forward_backward(pv, gv, {**good, "y": good["y"].astype(np.float32)})
    with pytest.raises(DataError, match="'y' has shape \\(5,\\).*batch 6"):
        ex.forward_backward(pv, gv, {**good, "y": good["y"][:5]})
    with pytest.raises(DataError, match="'x' has shape \\(6, 64\\)"):
        ex.forward_backward(pv, gv, {**good, "x": good["x"].reshape(6, 64)})
    with pytest.raises(DataError, match="'y' was not fed"):
        ex.forward_backward(pv, gv, {"x": good["x"]})
    with pytest.raises(DataError, match="'labels'"):
        ex.forward_backward(pv, gv, {**good, "labels": good["y"]})
    with pytest.raises(DataError, match="'x'"):
        ex.forward_backward(pv, gv, {"x": good["x"][:0], "y": good["y"][:0]})


def test_host_device_mixing_raises():
    g = build_model("mlp", **MLP)
    _, _, _, pv, gv = setup(g)
    ex = Executor(g)
    good = digits_batch()

    class FakeDeviceArray:  # stands in for an array of another module (e.g. cupy.ndarray)
        shape, ndim, dtype = good["x"].shape, 4, np.dtype(np.float32)

    with pytest.raises(DeviceError, match="input 'x'.*FakeDeviceArray.*numpy"):
        ex.forward_backward(pv, gv, {**good, "x": FakeDeviceArray()})
    with pytest.raises(DeviceError, match="head.bias"):
        ex.forward_backward(pv, {**gv, "head.bias": FakeDeviceArray()}, good)
    with pytest.raises(GraphError, match="float64"):
        ex.forward_backward({**pv, "fc0.bias": pv["fc0.bias"].astype(np.float64)}, gv, good)
    with pytest.raises(GraphError, match="'fc0.weight' is missing"):
        ex.evaluate({k: v for k, v in pv.items() if k != "fc0.weight"}, good)


def test_dropout_is_seeded_and_off_in_evaluate():
    g = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[32], dropout=0.5)
    _, _, grads, pv, gv = setup(g, "float64")
    ex = Executor(g, np, "float64")
    f = digits_batch(dtype=np.float64)
    a = ex.forward_backward(pv, gv, f, seed=11)
    ga = grads.copy()
    b = ex.forward_backward(pv, gv, f, seed=11)
    np.testing.assert_array_equal(grads, ga)
    c = ex.forward_backward(pv, gv, f, seed=12)
    assert a == b and (c["loss"] != a["loss"] or not np.array_equal(grads, ga))
    e1 = ex.evaluate(pv, f)
    nodrop = ex.forward_backward(pv, gv, f, train=False)
    assert e1 == ex.evaluate(pv, f) == nodrop and e1["loss"] != a["loss"]
    with pytest.raises(ValueError, match="needs a seed"):
        ex.forward_backward(pv, gv, f, train=True)


def test_dropout_keeps_the_expected_fraction():
    b = GraphBuilder()
    b.input("x", [None, 1000])
    w = b.param("w", [1000], {"scheme": "ones"})
    b.output("loss", b.op("mean", b.op("dropout", b.op("mul", "x", w), p=0.3)))
    g = b.build()
    _, _, _, pv, gv = setup(g, "float64")
    x = np.ones((20, 1000))
    out = Executor(g, np, "float64").forward_backward(pv, gv, {"x": x}, seed=5)
    assert out["loss"] == pytest.approx(1.0, abs=0.02)  # inverted dropout keeps the mean
    # d loss / d w_j = (kept rows of column j) / 0.7 / (20 * 1000)
    kept_rows = gv["w"] * 20 * 1000 * 0.7
    np.testing.assert_allclose(kept_rows, np.round(kept_rows), atol=1e-9)
    assert kept_rows.sum() / (20 * 1000) == pytest.approx(0.7, abs=0.02)


def test_concurrent_executors_in_threads_agree():
    g = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, channels=[4], hidden=8, dropout=0.2)
    feeds = digits_batch(8)
    _, _, ref, pv, gv = setup(g)
    Executor(g).forward_backward(pv, gv, feeds, seed=4)
    results = [None, None]

    def work(i):
        _, _, grads, pv_i, gv_i = setup(g)
        Executor(g).forward_backward(pv_i, gv_i, feeds, seed=4)
        results[i] = grads

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in results:
        np.testing.assert_array_equal(r, ref)


def test_layout_views_and_init():
    g = build_model("mlp", **MLP)
    layout = ParamLayout(g)
    assert layout.size == 64 * 16 + 16 + 16 * 12 + 12 + 12 * 10 + 10
    assert list(layout.offsets) == [p.name for p in g.params]
    assert layout.offsets["fc0.bias"] == 64 * 16
    bigger = np.zeros(layout.size + 5)  # a bucket with extra slots after the payload
    views = layout.views(bigger)
    views["head.bias"][...] = 1
    assert bigger[layout.size - 10: layout.size].tolist() == [1.0] * 10 and bigger[-5:].tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="needs"):
        layout.views(np.zeros(layout.size - 1))
    with pytest.raises(ValueError, match="contiguous"):
        layout.views(np.zeros(2 * layout.size)[::2])
    a, b32 = np.empty(layout.size), np.empty(layout.size, np.float32)
    init_params(g, a, 5)
    init_params(g, b32, 5)
    np.testing.assert_array_equal(a.astype(np.float32), b32)
    c = np.empty(layout.size)
    init_params(g, c, 6)
    assert not np.array_equal(a, c)
    v = layout.views(a)
    assert (v["fc0.bias"] == 0).all()
    assert v["fc0.weight"].std() == pytest.approx(np.sqrt(2 / 64), rel=0.15)  # He for relu
    packed = layout.pack({k: x.copy() for k, x in v.items()}, np.empty(layout.size))
    np.testing.assert_array_equal(packed, a)


def test_float32_stays_float32_everywhere(monkeypatch):
    """No op may silently promote to float64 (it would double the memory traffic)."""
    from hpc_rlx.graph.registry import VJPS, VJPRule

    seen = []

    def record_fwd(opdef):
        def forward(xp, args, attrs, ctx):
            out, saved = opdef.forward(xp, args, attrs, ctx)
            seen.append((f"{opdef.name} forward", out.dtype))
            return out, saved

        return opdef.__class__(**{**opdef.__dict__, "forward": forward})

    def record_vjp(name, fn):
        def vjp(*a):
            r = fn(*a)
            seen.append((f"{name} vjp", r.dtype))
            return r

        return None if fn is None else vjp

    for name in list(OPS):
        monkeypatch.setitem(OPS, name, record_fwd(OPS[name]))
    for name, rule in list(VJPS.items()):
        monkeypatch.setitem(VJPS, name, VJPRule(tuple(record_vjp(name, f) for f in rule.fns), rule.needs_args,
                                                rule.needs_ans))
    models = [
        (build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[8], activation="gelu", dropout=0.2),
         digits_batch()),
        (build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[8], activation="sigmoid"), digits_batch()),
        (build_model("cnn", input_shape=(1, 8, 8), num_classes=10, channels=[2, 3], hidden=4, pool="avg",
                     activation="tanh"), digits_batch()),
        (build_model("cnn", input_shape=(1, 8, 8), num_classes=10, channels=[2], hidden=4, dropout=0.1),
         digits_batch()),
        (build_model("transformer_lm", vocab_size=7, seq_len=5, d_model=8, n_heads=2, n_layers=1, d_ff=8,
                     dropout=0.1, tie_embeddings=True),
         {"x": R.integers(0, 7, (3, 5)), "y": R.integers(0, 7, (3, 5))}),
    ]
    for g, feeds in models:
        _, _, _, pv, gv = setup(g)
        Executor(g).forward_backward(pv, gv, feeds, seed=2)
    promoted = sorted({k for k, dt in seen if dt == np.float64})
    assert promoted == []
    assert {k.split()[0] for k, _ in seen} >= {"gelu", "dropout", "conv2d", "avg_pool2d", "max_pool2d",
                                               "layer_norm", "softmax", "causal_mask", "embedding", "sigmoid"}
