"""The lean step's fused pieces against their plain forms: the non-finite check and the BLAS
optimizer update (pure math; the optimizer's torch checks are in test_optim.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.comm.collective import _all_finite
from hpc_rlx.runtime.blas import axpy, fusable, scal
from hpc_rlx.runtime.optim import SGD


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_finite_check_agrees_with_isfinite(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300_000).astype(dtype)
    assert _all_finite(x)
    big = np.finfo(dtype).max / 2
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 70_000, x.size - 1):
            y = x.copy()
            y[where] = bad
            assert not _all_finite(y)
    y = x.copy()
    y[[3, 9]] = (big, -big)            # finite values whose squares overflow: the exact check says finite
    assert _all_finite(y)
    assert _all_finite(x[::2])         # a strided view takes the exact check


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
