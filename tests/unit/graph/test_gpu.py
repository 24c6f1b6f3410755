"""The same graphs on CuPy: results match NumPy, and host arrays are refused (needs a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.base.errors import DeviceError
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA device"),
]

MODELS = [
    ("mlp", dict(input_shape=(1, 8, 8), num_classes=10, hidden=[32, 16], activation="gelu")),
    ("cnn", dict(input_shape=(2, 9, 8), num_classes=5, channels=[4, 6], kernel=3, hidden=12, pool="max")),
    ("cnn", dict(input_shape=(1, 8, 8), num_classes=5, channels=[3], kernel=3, hidden=0, pool="avg")),
    ("transformer_lm", dict(vocab_size=23, seq_len=7, d_model=16, n_heads=4, n_layers=2, d_ff=24,
                            tie_embeddings=True)),
]


def feeds_for(g, rng, dtype):
    if g.input("x").dtype == "int64":
        t = g.input("x").shape[1]
        return {"x": rng.integers(0, g.num_classes, (5, t)), "y": rng.integers(0, g.num_classes, (5, t))}
    shape = (6,) + g.input("x").shape[1:]
    return {"x": rng.standard_normal(shape).astype(dtype), "y": rng.integers(0, g.num_classes, 6)}


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-4)])
@pytest.mark.parametrize("kind,kwargs", MODELS, ids=[m[0] for m in MODELS])
def test_cupy_matches_numpy(kind, kwargs, dtype, tol):
    cp = backend.get_xp("cuda")
    g = build_model(kind, **kwargs)
    layout = ParamLayout(g)
    host = np.empty(layout.size, dtype)
    init_params(g, host, 0)
    feeds = feeds_for(g, np.random.default_rng(0), dtype)
    hgrad = np.empty_like(host)
    ref = Executor(g, np, dtype).forward_backward(layout.views(host), layout.views(hgrad), feeds, grad_scale=3.0)
    dev = cp.asarray(host)
    dgrad = cp.full(layout.size, cp.nan, dtype=dtype)
    ex = Executor(g, cp, dtype)
    out = ex.forward_backward(layout.views(dev), layout.views(dgrad), {k: cp.asarray(v) for k, v in feeds.items()},
                              grad_scale=3.0)
    assert out["loss"] == pytest.approx(ref["loss"], rel=tol)
    assert out["correct"] == ref["correct"]
    got = backend.to_numpy(dgrad)
    assert np.linalg.norm(got - hgrad) <= tol * np.linalg.norm(hgrad)
    assert ex.evaluate(layout.views(dev), {k: cp.asarray(v) for k, v in feeds.items()})["loss"] == \
        pytest.approx(Executor(g, np, dtype).evaluate(layout.views(host), feeds)["loss"], rel=tol)


def test_host_feed_to_cupy_executor_raises():
    cp = backend.get_xp("cuda")
    g = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[5], dropout=0.3)
    layout = ParamLayout(g)
    host = np.empty(layout.size, np.float32)
    init_params(g, host, 0)
    dev, dgrad = cp.asarray(host), cp.zeros(layout.size, cp.float32)
    x, y = np.ones((2, 4), np.float32), np.zeros(2, np.int64)
    ex = Executor(g, cp)
    with pytest.raises(DeviceError, match="input 'x'.*numpy"):
        ex.forward_backward(layout.views(dev), layout.views(dgrad), {"x": x, "y": cp.asarray(y)}, seed=1)
    with pytest.raises(DeviceError):
        ex.forward_backward(layout.views(host), layout.views(dgrad), {"x": cp.asarray(x), "y": cp.asarray(y)}, seed=1)
    out = ex.forward_backward(layout.views(dev), layout.views(dgrad), {"x": cp.asarray(x), "y": cp.asarray(y)},
                              seed=1)
    assert np.isfinite(out["loss"])
    with pytest.raises(DeviceError, match="numpy"):
        Executor(g, np).evaluate(layout.views(dev), {"x": x, "y": y})


def test_smoke_test_runs_kernels_gemm_and_pinned_copy_on_every_gpu():
    # what the doctor runs on each rank's GPU: on a healthy GPU it reports no problem
    for index in range(backend.gpu_count()):
        assert backend.smoke_test(index) == "", index
    backend.select_device(0)
