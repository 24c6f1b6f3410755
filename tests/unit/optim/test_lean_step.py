"""The lean step's fused pieces against their plain forms: the non-finite check and the BLAS
optimizer update (pure math; the optimizer's torch checks are in test_optim.py)."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from hpc_rlx.comm.finite import all_finite
from hpc_rlx.optim.blas import axpy, fusable, scal
from hpc_rlx.optim import base as optim_base
from hpc_rlx.optim.adamw import AdamW
from hpc_rlx.optim.sgd import SGD


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finite_check_agrees_with_isfinite(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300_000).astype(dtype)
    assert all_finite(x)
    big = np.finfo(dtype).max / 2
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 70_000, x.size - 1):
            y = x.copy()
            y[where] = bad
            assert not all_finite(y)
    y = x.copy()
    y[[3, 9]] = (big, -big)            # finite values whose squares overflow: the exact check says finite
    assert all_finite(y)
    assert all_finite(x[::2])         # a strided view takes the exact check


def test_blas_updates_in_place():
    x, y = np.arange(5.0, dtype=np.float32), np.ones(5, np.float32)
    axpy(2.0, x, y)
    np.testing.assert_array_equal(y, 1 + 2 * np.arange(5.0))
    scal(0.5, y)
    np.testing.assert_array_equal(y, 0.5 + np.arange(5.0))
    assert fusable(x, y) and not fusable(x, y[::2]) and not fusable(x, np.ones(5))


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"momentum": 0.9, "weight_decay": 0.01},
                                {"weight_decay": 0.1}, {"momentum": 0.5, "nesterov": True}])
def test_fused_sgd_with_a_grad_scale_equals_the_plain_update_of_the_mean(kw):
    """step(p, sum, lr, grad_scale=1/n) == step(p, sum / n, lr), to float64 rounding."""
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(1000)
    fused, plain = SGD(1000, np, "float64", **kw), SGD(1000, np, "float64", **kw)
    pa, pb = p0.copy(), p0.copy()
    for step in range(4):
        g = rng.standard_normal(1000) * 24
        fused.step(pa, g.copy(), 0.05, grad_scale=1 / 24)
        ref = g / 24
        plain._plain_step(pb, ref, 0.05)
        plain.step_count += 1
        np.testing.assert_allclose(pa, pb, rtol=1e-13, atol=1e-13)


def _textbook_adamw(p, grads, lrs, b1, b2, eps, wd, scale):
    """AdamW as the paper writes it (Loshchilov & Hutter; torch's form), on the mean gradient."""
    m, v = np.zeros_like(p), np.zeros_like(p)
    for k, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g * scale
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**k), v / (1 - b2**k)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.0}, {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
                                {"betas": (0.3, 0.5), "eps": 1e-3}])
@pytest.mark.parametrize("scale", [1.0, 1 / 24])
def test_fused_adamw_equals_the_textbook_formula_and_the_plain_form(kw, scale):
    """The fused update (BLAS passes, scale folded in) equals the textbook AdamW and the
    op-for-op torch form (`_plain_step`, kept for CuPy and strided arrays) to float64 rounding."""
    rng = np.random.default_rng(2)
    n, steps = 5000, 6
    p0 = rng.standard_normal(n)
    grads = [rng.standard_normal(n) * 24 for _ in range(steps)]
    lrs = [0.01 * (1 + i) for i in range(steps)]
    fused, plain = AdamW(n, np, "float64", **kw), AdamW(n, np, "float64", **kw)
    pa, pb = p0.copy(), p0.copy()
    for g, lr in zip(grads, lrs):
        fused.step(pa, g.copy(), lr, grad_scale=scale)
        plain.step_count += 1
        plain._plain_step(pb, g * scale, lr)
    b1, b2 = kw.get("betas", (0.9, 0.999))
    ref, m, v = _textbook_adamw(p0, grads, lrs, b1, b2, kw.get("eps", 1e-8), kw.get("weight_decay", 0.01), scale)
    assert not np.allclose(pa, p0)
    for ours, want in ((pa, ref), (pb, ref), (fused._exp_avg, m), (fused._exp_avg_sq, v)):
        # relative to the array's scale (as test_optim's torch checks): an element of m near 0
        # is a difference of rounded terms, not a relative quantity
        assert np.max(np.abs(ours - want)) <= 1e-12 * np.max(np.abs(want))


def test_fused_adamw_allocates_nothing_of_the_parameters_size():
    import tracemalloc
    n = 200_000
    opt, p = AdamW(n, np, "float32"), np.zeros(n, np.float32)
    g = np.ones(n, np.float32)
    opt.step(p, g, 0.01, grad_scale=0.5)
    tracemalloc.start()
    try:
        for _ in range(3):
            opt.step(p, g, 0.01, grad_scale=0.5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < n * 4 // 10, peak       # no temporary of the parameters' size (800 kB)


@pytest.mark.parametrize("make", [lambda n: SGD(n, np, "float32", momentum=0.9, weight_decay=0.01),
                                  lambda n: AdamW(n, np, "float32")])
def test_blocked_updates_equal_whole_array_updates_bitwise(make, monkeypatch):
    rng = np.random.default_rng(4)
    n = 300_001                    # not a multiple of the block: a short last block
    p0 = rng.standard_normal(n).astype(np.float32)
    blocked = make(n)
    monkeypatch.setattr(optim_base, "BLOCK_BYTES", 1 << 62)
    whole = make(n)
    assert len(blocked._ranges) > 1 and len(whole._ranges) == 1
    pa, pb = p0.copy(), p0.copy()
    # one BLAS thread (train.threads_per_rank=1): with several, OpenBLAS cuts each axpy among
    # them and may round the elements at its cuts differently (one ulp), blocked or not
    with threadpool_limits(1):
        for _ in range(3):
            g = rng.standard_normal(n).astype(np.float32) * 64
            blocked.step(pa, g.copy(), 0.01, grad_scale=1 / 64)
            whole.step(pb, g.copy(), 0.01, grad_scale=1 / 64)
    np.testing.assert_array_equal(pa, pb)
