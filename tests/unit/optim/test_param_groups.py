"""optim.no_decay and optim.lr_mult (`optim/groups.py`): the globs' settings, and every optimizer
stepping its parameter groups as PyTorch's parameter groups do (SGD, AdamW against torch.optim
with one group per setting; Lion against one instance per group; LAMB and LARS against the
references of test_trust_ratio.py with the stated exemption), also sliced as under
comm.shard=optimizer with a boundary inside a parameter."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.optim import make_optimizer
from hpc_rlx.optim.groups import DEFAULT, ParamSetting, runs, settings_for
from hpc_rlx.optim.segments import slice_segments
from tests.unit.optim.test_trust_ratio import _lamb_reference, _lars_reference, _Slices, step_whole_and_slices

NAMES = ["encoder.0.weight", "encoder.0.bias", "norm.weight", "head.weight", "head.bias"]
SHAPES = [(6, 5), (5,), (5,), (3, 5), (3,)]
NO_DECAY = ["*bias", "norm.*"]
LR_MULT = {"head.*": 10.0, "encoder.0.bias": 0.5}
STEPS = 5


def _spans():
    spans, off = [], 0
    for name, shape in zip(NAMES, SHAPES):
        n = int(np.prod(shape))
        spans.append((name, off, n))
        off += n
    return spans, off


def _problem(seed=0):
    spans, size = _spans()
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(size)
    grads = [rng.standard_normal(size) for _ in range(STEPS)]
    lrs = [0.03, 0.05, 0.04, 0.02, 0.05]
    return spans, size, p0, grads, lrs


def test_globs_give_each_parameter_its_setting_and_the_first_factor_wins():
    got = settings_for(NAMES, NO_DECAY, {"head.bias": 2.0, "head.*": 10.0})
    assert got == [DEFAULT, ParamSetting(1.0, False), ParamSetting(1.0, False), ParamSetting(10.0, True),
                   ParamSetting(2.0, False)]
    spans, _ = _spans()
    segs = slice_segments(spans, 0, 63)
    assert [(a, b) for a, b, _ in runs(segs, got)] == [(0, 30), (30, 40), (40, 55), (55, 58)]
    assert settings_for(NAMES) == [DEFAULT] * 5


@pytest.mark.parametrize("no_decay, lr_mult, match", [
    (["*.baias"], {}, r"optim.no_decay: '\*.baias' matches no trainable parameter; the closest names: "
                      r"'head.bias', 'encoder.0.bias' \(5 in all\)"),
    ([], {"heads.*": 2.0}, r"optim.lr_mult: 'heads.\*' matches no .*'head.weight'"),
    ([], {"head.*": -1}, r"optim.lr_mult: the factor of 'head.\*' must be a finite number >= 0"),
    ("*bias", {}, r"optim.no_decay must be a list"),
])
def test_a_glob_that_matches_nothing_or_a_bad_factor_is_one_error(no_decay, lr_mult, match):
    with pytest.raises(ConfigError, match=match):
        settings_for(NAMES, no_decay, lr_mult)


def _grouped(name, size, spans, **kwargs):
    opt = make_optimizer(name, size, np, np.float64, **kwargs)
    opt.use_segments(slice_segments(spans, 0, size))
    opt.use_settings(settings_for(NAMES, NO_DECAY, LR_MULT))
    return opt


def _torch_groups(cls, p0, spans, **kwargs):
    """One torch parameter group per parameter, with its lr factor and weight decay."""
    torch = pytest.importorskip("torch")
    params = [torch.tensor(p0[o:o + n].copy(), requires_grad=True) for _, o, n in spans]
    settings = settings_for(NAMES, NO_DECAY, LR_MULT)
    wd = kwargs.pop("weight_decay")
    groups = [{"params": [t], "lr_mult": s.lr_mult, "weight_decay": wd if s.decay else 0.0}
              for t, s in zip(params, settings)]
    return params, cls(groups, lr=1.0, **kwargs)


@pytest.mark.parametrize("name, kwargs", [("sgd", {"momentum": 0.9, "weight_decay": 0.1}),
                                          ("adamw", {"weight_decay": 0.1})])
def test_sgd_and_adamw_step_groups_as_torchs_parameter_groups(name, kwargs):
    torch = pytest.importorskip("torch")
    spans, size, p0, grads, lrs = _problem()
    opt = _grouped(name, size, spans, **kwargs)
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    params, ref = _torch_groups(cls, p0, spans, **dict(kwargs, **({"momentum": 0.9} if name == "sgd" else {})))
    p = p0.copy()
    for g, lr in zip(grads, lrs):
        opt.step(p, g.copy(), lr)
        for group, t, (_, o, n) in zip(ref.param_groups, params, spans):
            group["lr"] = lr * group["lr_mult"]
            t.grad = torch.tensor(g[o:o + n].copy())
        ref.step()
    want = np.concatenate([t.detach().numpy() for t in params])
    np.testing.assert_allclose(p, want, rtol=1e-12, atol=1e-14)
    assert opt.step_count == STEPS


def test_lion_steps_each_group_as_its_own_optimizer():
    spans, size, p0, grads, lrs = _problem(1)
    opt = _grouped("lion", size, spans, weight_decay=0.3)
    settings = settings_for(NAMES, NO_DECAY, LR_MULT)
    alone = [make_optimizer("lion", n, np, np.float64, weight_decay=0.3 if s.decay else 0.0)
             for (_, _, n), s in zip(spans, settings)]
    p, q = p0.copy(), p0.copy()
    for g, lr in zip(grads, lrs):
        opt.step(p, g.copy(), lr)
        for o_, (_, o, n), s in zip(alone, spans, settings):
            o_.step(q[o:o + n], g[o:o + n].copy(), lr * s.lr_mult)
    np.testing.assert_array_equal(p, q)
    # and without the settings the step differs: the test can see it
    plain = make_optimizer("lion", size, np, np.float64, weight_decay=0.3)
    r = p0.copy()
    for g, lr in zip(grads, lrs):
        plain.step(r, g.copy(), lr)
    assert np.abs(r - p).max() > 1e-3


def _trust_reference(name, p0, spans, grads, lrs):
    """test_trust_ratio's per-tensor references, with a no_decay tensor stepped without weight
    decay and with a ratio of 1, and each tensor's learning rate times its factor."""
    settings = settings_for(NAMES, NO_DECAY, LR_MULT)
    ps = [p0[o:o + n].copy() for _, o, n in spans]
    ms, vs = [np.zeros_like(p) for p in ps], [np.zeros_like(p) for p in ps]
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        gs = [g[o:o + n] for _, o, n in spans]
        for i, s in enumerate(settings):
            m, v = [ms[i]], [vs[i]]       # the references update these lists in place
            if name == "lamb" and s.decay:
                (new,) = _lamb_reference([ps[i]], m, v, [gs[i]], t, lr * s.lr_mult, 0.9, 0.999, 1e-6, 0.01)
            elif name == "lamb":              # ratio 1, no decay: the plain Adam direction
                m[0] = 0.9 * m[0] + 0.1 * gs[i]
                v[0] = 0.999 * v[0] + 0.001 * gs[i] * gs[i]
                m_hat, v_hat = m[0] / (1 - 0.9**t), v[0] / (1 - 0.999**t)
                new = ps[i] - lr * s.lr_mult * m_hat / (np.sqrt(v_hat) + 1e-6)
            elif s.decay:
                (new,) = _lars_reference([ps[i]], v, [gs[i]], lr * s.lr_mult, 0.9, 0.0001, 0.001)
            else:
                v[0] = 0.9 * v[0] + lr * s.lr_mult * gs[i]
                new = ps[i] - v[0]
            ps[i], ms[i], vs[i] = new, m[0], v[0]
    return np.concatenate(ps)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_exempt_no_decay_parameters_from_decay_and_ratio(name):
    spans, size, p0, grads, lrs = _problem(2)
    opt = _grouped(name, size, spans)
    p = p0.copy()
    for g, lr in zip(grads, lrs):
        opt.step(p, g.copy(), lr)
    np.testing.assert_allclose(p, _trust_reference(name, p0, spans, grads, lrs), rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "sgd"])
def test_sliced_with_a_cut_parameter_equals_the_whole(name):
    """comm.shard=optimizer: each rank steps a slice; a boundary at 20 cuts encoder.0.weight."""
    spans, size, p0, grads, lrs = _problem(3)
    whole = _grouped(name, size, spans)
    bounds = [(0, 20), (20, size)]
    slices = _Slices(spans, bounds)
    parts = []
    for r, (lo, hi) in enumerate(bounds):
        opt = make_optimizer(name, hi - lo, np, np.float64)
        segments = slice_segments(spans, lo, hi)
        opt.use_segments(segments, slices.combine_for(r, segments))
        opt.use_settings(settings_for(NAMES, NO_DECAY, LR_MULT))
        parts.append(opt)
    p, q = step_whole_and_slices(whole, parts, bounds, p0, grads, lrs)
    np.testing.assert_allclose(q, p, rtol=1e-12, atol=1e-15)


def test_state_round_trips_and_default_settings_keep_the_plain_step():
    spans, size, p0, grads, lrs = _problem(4)
    a = _grouped("adamw", size, spans)
    p = p0.copy()
    for g, lr in zip(grads[:2], lrs[:2]):
        a.step(p, g.copy(), lr)
    b = _grouped("adamw", size, spans)
    b.load_state_dict(a.state_dict())
    q = p.copy()
    for g, lr in zip(grads[2:], lrs[2:]):
        a.step(p, g.copy(), lr)
        b.step(q, g.copy(), lr)
    np.testing.assert_array_equal(p, q)
    plain = make_optimizer("adamw", size, np, np.float64)
    plain.use_segments(slice_segments(spans, 0, size))
    plain.use_settings(settings_for(NAMES))       # nothing set: no runs, the whole-array step
    assert plain.settings is None
