"""`device.cpu_blas=mkl`: the CPU lanes' matrix products on Intel MKL (`hpc_rlx.device.host_blas`).

MKL's products against NumPy's for every operand layout the engine passes and for the ones it
must leave to NumPy; the executor with MKL's GEMMs against NumPy's on an MLP and a CNN; real
mpirun training with the setting, and the clear errors. The `mkl` wheel comes with the test
install (`scripts/install.sh --test`); without it the tests that need MKL are skipped, except
under CI, where they must run."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpc_rlx.base import backend

from hpc_rlx.device import host_blas
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params

from tests.support.jobs import explain, train_job


@pytest.fixture(scope="module")
def mkl():
    try:
        return host_blas.host_array_module("mkl", 1)
    except ConfigError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the mkl wheel (hpc_rlx[test]), yet: {exc}")
        pytest.skip(str(exc))


def _pair(rng, m, k, n, dtype):
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("m,k,n", [(128, 784, 1024), (784, 128, 1024), (1, 7, 1), (5, 1, 3), (33, 17, 2)])
def test_every_layout_the_engine_passes_matches_numpy(mkl, dtype, tol, m, k, n):
    rng = np.random.default_rng([m, k, n])
    a, b = _pair(rng, m, k, n, dtype)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).sum(1, keepdims=True) * np.abs(b).max()
    for left in (a, np.ascontiguousarray(a.T).T):            # as stored, and a transposed view
        for right in (b, np.ascontiguousarray(b.T).T):
            got = mkl.matmul(left, right)
            assert got.dtype == dtype and got.shape == (m, n)
            assert np.all(np.abs(got - want) <= tol * scale)
            out = np.full((m, n), np.nan, dtype)
            assert mkl.matmul(left, right, out=out) is out
            assert np.array_equal(out, got)                  # same bits either way


def test_what_mkl_cannot_take_stays_numpys(mkl):
    rng = np.random.default_rng(0)
    a, b = _pair(rng, 6, 8, 4, np.float32)
    cases = {
        "strided": (a[:, ::2], b[::2]),
        "vector": (a, b[:, 0].copy()),
        "batched": (np.stack([a, a]), b),
        "integer": (a.astype(np.int64), b.astype(np.int64)),
        "mixed dtypes": (a, b.astype(np.float64)),
        "empty": (a[:0], b),
    }
    for what, (x, y) in cases.items():
        assert np.array_equal(mkl.matmul(x, y), np.matmul(x, y)), what
    # an output that is also an input, or not contiguous, is NumPy's to handle
    sq = rng.standard_normal((5, 5)).astype(np.float32)
    want = sq @ sq
    assert np.allclose(mkl.matmul(sq, sq, out=sq), want, rtol=1e-5, atol=1e-5)
    wide = np.zeros((6, 8), np.float32)
    mkl.matmul(a, b, out=wide[:, ::2])
    assert np.allclose(wide[:, ::2], a @ b, rtol=1e-5, atol=1e-5) and not wide[:, 1::2].any()


def test_the_array_module_is_numpy_but_for_matmul(mkl):
    assert host_blas.host_array_module("numpy") is np
    assert backend.is_host(np) and backend.is_host(mkl)
    assert mkl.ndarray is np.ndarray and mkl.maximum is np.maximum
    assert mkl.matmul is not np.matmul
    with pytest.raises(ConfigError, match="device.cpu_blas must be one of numpy, mkl, got 'blis'"):
        host_blas.host_array_module("blis")


def test_a_missing_mkl_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(host_blas, "_mkl_candidates", lambda: [])
    monkeypatch.setattr(host_blas, "_MODULES", {})
    with pytest.raises(ConfigError, match=r"device.cpu_blas=mkl needs Intel MKL: pip install mkl"):
        host_blas.host_array_module("mkl", 1)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_executor_on_mkl_computes_what_it_does_on_numpy(mkl, model):
    if model == "mlp":
        g = build_model("mlp", input_shape=(20,), num_classes=5, hidden=[32, 16], activation="relu")
        x = np.random.default_rng(1).standard_normal((12, 20))
    else:
        g = build_model("cnn", input_shape=(1, 12, 12), num_classes=5, channels=[4, 8], kernel=3, hidden=16,
                        pool="max")
        x = np.random.default_rng(1).standard_normal((6, 1, 12, 12))
    feeds = {"x": x, "y": np.arange(x.shape[0]) % 5}
    layout = ParamLayout(g)
    params = np.empty(layout.size)
    init_params(g, params, 0)
    grads = {}
    for name, xp in (("numpy", np), ("mkl", mkl)):
        flat = np.empty(layout.size)
        out = Executor(g, xp, "float64").forward_backward(layout.views(params), layout.views(flat), feeds)
        grads[name] = (out, flat)
    (out_np, g_np), (out_mkl, g_mkl) = grads["numpy"], grads["mkl"]
    assert out_np.keys() == out_mkl.keys()
    assert all(abs(out_np[k] - out_mkl[k]) <= 1e-12 * max(1.0, abs(out_np[k])) for k in out_np)
    assert np.max(np.abs(g_np - g_mkl)) <= 1e-12 * np.max(np.abs(g_np))
    assert not np.array_equal(g_np, np.zeros_like(g_np))


@pytest.mark.mpi
def test_training_on_mkl_ends_where_numpy_does(mkl, tmp_path, digits_h5):
    import h5py

    base = ["train.epochs=2", "checkpoint=off", f"data.path={digits_h5}", "train.dtype=float64",
            "model.hidden=[32]"]
    runs = {}
    for blas in ("numpy", "mkl"):
        proc = train_job(2, tmp_path / blas, base + [f"device.cpu_blas={blas}"])
        assert proc.returncode == 0, explain(proc)
        lanes = next(line for line in proc.stdout.splitlines() if "lanes:" in line)
        assert ("matrix products on MKL" in lanes) == (blas == "mkl"), lanes
        with h5py.File(tmp_path / blas / "model.h5", "r") as f:
            runs[blas] = {k: f[k][...] for k in f.keys()}
    a, b = runs["numpy"], runs["mkl"]
    worst = max(float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in a)
    assert 0 < worst <= 1e-10, worst     # another BLAS: other rounding, the same training


@pytest.mark.mpi
def test_a_misspelt_blas_is_refused_before_training(tmp_path, digits_h5):
    proc = train_job(2, tmp_path / "run", ["train.epochs=1", f"data.path={digits_h5}", "device.cpu_blas=openblas"])
    assert proc.returncode != 0
    assert "device.cpu_blas" in proc.stderr + proc.stdout and "numpy" in proc.stderr + proc.stdout, explain(proc)
    assert not (tmp_path / "run" / "model.h5").exists()
