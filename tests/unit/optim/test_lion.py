"""Lion (Chen et al., 2023) against its formula, step by step in float64, and an optimizer's
declaration reaching the config schema, the spec's arguments and the memory estimate."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.config.schema import GROUPS, keys_of
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.optim import OPTIMIZERS, make_optimizer, optimizer_kwargs, parameter_copies
from hpc_rlx.optim.lion import Lion


def _formula(p, m, g, lr, b1, b2, wd):
    """The paper's update, written plainly."""
    c = np.sign(b1 * m + (1 - b1) * g)
    p = p * (1 - lr * wd) - lr * c
    m = b2 * m + (1 - b2) * g
    return p, m


@pytest.mark.parametrize("betas,wd,scale", [((0.9, 0.99), 0.0, 1.0), ((0.95, 0.98), 0.1, 0.25), ((0.0, 0.5), 1.0, 3.0)])
def test_lion_follows_its_formula_for_several_steps(betas, wd, scale):
    rng = np.random.default_rng(0)
    n, steps = 1000, 6
    p0 = rng.standard_normal(n)
    grads = [rng.standard_normal(n) for _ in range(steps)]
    lrs = [1e-3 * (k + 1) for k in range(steps)]
    opt = Lion(n, np, np.float64, betas=betas, weight_decay=wd)
    p, ref_p, ref_m = p0.copy(), p0.copy(), np.zeros(n)
    for g, lr in zip(grads, lrs):
        opt.step(p, g.copy(), lr, grad_scale=scale)
        ref_p, ref_m = _formula(ref_p, ref_m, scale * g, lr, betas[0], betas[1], wd)
    np.testing.assert_allclose(p, ref_p, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(opt.state_dict()["arrays"]["exp_avg"], ref_m, rtol=1e-13, atol=1e-15)
    assert opt.step_count == steps


def test_lion_resumes_from_its_state_exactly():
    rng = np.random.default_rng(1)
    n = 64
    grads = [rng.standard_normal(n) for _ in range(4)]
    a, b = Lion(n, np, np.float64, weight_decay=0.1), Lion(n, np, np.float64, weight_decay=0.1)
    pa = rng.standard_normal(n)
    for g in grads[:2]:
        a.step(pa, g.copy(), 1e-2)
    b.load_state_dict(a.state_dict())
    pb = pa.copy()
    for g in grads[2:]:
        a.step(pa, g.copy(), 1e-2)
        b.step(pb, g.copy(), 1e-2)
    assert np.array_equal(pa, pb)


def test_lion_keeps_float32_and_checks_its_arguments():
    opt = Lion(8, np, np.float32)
    p = np.ones(8, np.float32)
    opt.step(p, np.full(8, 0.5, np.float32), 0.1)
    assert p.dtype == np.float32 and opt.state_dict()["arrays"]["exp_avg"].dtype == np.float32
    with pytest.raises(ConfigError, match=r"lion: betas\[1\] must be a number in \[0, 1\), got 1\.0"):
        Lion(8, np, np.float64, betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match=r"optimizer 'lion' does not take \['eps'\]"):
        make_optimizer("lion", 8, np, np.float64, eps=1e-8)


def test_every_declared_key_is_a_schema_key_with_that_optimizers_default():
    assert GROUPS["optim"][1] == tuple(OPTIMIZERS)
    for name, cls in OPTIMIZERS.items():
        keys = {k.name: k for k in keys_of("optim", name)}
        assert keys["lr"].default_for(name) == cls.lr
        for h in cls.hyper:
            assert keys[h.name].default_for(name) == h.default, (name, h.name)
        section = {"name": name, **{h.name: h.default for h in cls.hyper}}
        make_optimizer(name, 4, np, np.float64, **optimizer_kwargs(section))    # the defaults build


@pytest.mark.parametrize("section,copies", [
    ({"name": "sgd", "momentum": 0.0, "nesterov": False, "weight_decay": 0.0}, 1),     # scratch
    ({"name": "sgd", "momentum": 0.9, "nesterov": False, "weight_decay": 0.0}, 2),     # + momentum
    ({"name": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 0.0}, 3),
    ({"name": "adamw", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}, 3),  # m, v, scratch
    ({"name": "lion", "betas": [0.9, 0.99], "weight_decay": 0.1}, 2),                  # m, scratch
    ({"name": "lamb", "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01}, 3),   # m, v, scratch
    ({"name": "lars", "momentum": 0.9, "weight_decay": 1e-4, "trust_coefficient": 1e-3}, 2),  # v, scratch
])
def test_the_memory_estimate_counts_what_the_optimizer_holds(section, copies):
    assert parameter_copies(section) == copies
    built = make_optimizer(section["name"], 1000, np, np.float32, **optimizer_kwargs(section))
    assert built.nbytes() == copies * 1000 * 4
