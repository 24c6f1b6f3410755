"""Optimizers and schedules against torch.optim as the oracle (float64, several steps)."""

import math
import pickle
import tracemalloc
import warnings

import numpy as np
import pytest

from hpc_rlx.base.errors import CheckpointError, ConfigError
from hpc_rlx.optim import clip_grad_norm_, make_optimizer, make_schedule, scaled_lr
from hpc_rlx.optim.adamw import AdamW
from hpc_rlx.optim.sgd import SGD

torch = pytest.importorskip("torch")

N = 257
STEPS = 8


def _grads(seed, steps, n=N):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n) for _ in range(steps)]


def _lrs(steps):
    # a varying LR, as a schedule would feed it
    return [0.05 * (1 + 0.3 * math.sin(k)) for k in range(steps)]


def _run_ours(name, kwargs, p0, grads, lrs):
    p = p0.copy()
    opt = make_optimizer(name, p.size, np, np.float64, **kwargs)
    for g, lr in zip(grads, lrs):
        opt.step(p, g, lr)
    return p, opt


def _run_torch(name, kwargs, p0, grads, lrs):
    tp = torch.nn.Parameter(torch.tensor(p0.copy(), dtype=torch.float64))
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    kw = dict(kwargs)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    opt = cls([tp], lr=lrs[0], **kw)
    for g, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        tp.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return tp.detach().numpy(), opt


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


CASES = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "nesterov": True}),
    ("sgd", {"weight_decay": 0.05}),
    ("sgd", {"momentum": 0.8, "weight_decay": 0.05}),
    ("sgd", {"momentum": 0.7, "nesterov": True, "weight_decay": 0.1}),
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.0}),
    ("adamw", {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    ("adamw", {"betas": [0.3, 0.5], "eps": 1e-3}),  # beta1 < 0.5 takes torch's other lerp branch
]


@pytest.mark.parametrize("name,kwargs", CASES)
def test_matches_torch_float64(name, kwargs):
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(N)
    grads, lrs = _grads(2, STEPS), _lrs(STEPS)
    ours, _ = _run_ours(name, kwargs, p0, grads, lrs)
    ref, _ = _run_torch(name, kwargs, p0, grads, lrs)
    assert not np.allclose(ours, p0)  # the run actually moved the parameters
    assert _rel_err(ours, ref) <= 1e-12


@pytest.mark.parametrize("name,kwargs", [c for c in CASES if c[1]])
def test_state_matches_torch_and_resumes(name, kwargs):
    rng = np.random.default_rng(3)
    p0 = rng.standard_normal(N)
    grads, lrs = _grads(4, STEPS), _lrs(STEPS)
    half = STEPS // 2
    ours, opt = _run_ours(name, kwargs, p0, grads[:half], lrs[:half])
    _, topt = _run_torch(name, kwargs, p0, grads[:half], lrs[:half])
    tstate = dict(next(iter(topt.state.values()), {}))
    tstate.pop("step", None)
    sd = opt.state_dict()
    assert sd["scalars"]["step"] == half
    assert sorted(sd["arrays"]) == sorted(tstate)  # same state kept as torch, by the same names
    for k, a in sd["arrays"].items():
        assert isinstance(a, np.ndarray)
        assert _rel_err(a, tstate[k].numpy()) <= 1e-12

    # a fresh optimizer loaded from the snapshot continues exactly like the uninterrupted one
    resumed = make_optimizer(name, N, np, np.float64, **kwargs)
    resumed.load_state_dict(sd)
    p_resumed = ours.copy()
    for g, lr in zip(grads[half:], lrs[half:]):
        resumed.step(p_resumed, g, lr)
        opt.step(ours, g, lr)
    np.testing.assert_array_equal(p_resumed, ours)


def test_state_dict_is_a_snapshot():
    opt = SGD(4, np, np.float64, momentum=0.9)
    p = np.zeros(4)
    opt.step(p, np.ones(4), 0.1)
    sd = opt.state_dict()
    opt.step(p, np.ones(4), 0.1)
    np.testing.assert_array_equal(sd["arrays"]["momentum_buffer"], np.ones(4))


@pytest.mark.parametrize("name,kwargs", [("sgd", {"momentum": 0.9}), ("adamw", {})])
def test_reset_behaves_like_fresh(name, kwargs):
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(N)
    grads = _grads(6, 3)
    used = make_optimizer(name, N, np, np.float64, **kwargs)
    junk = p0.copy()
    for g in grads:
        used.step(junk, g[::-1].copy(), 0.1)
    used.reset()
    assert used.state_dict()["scalars"]["step"] == 0
    fresh = make_optimizer(name, N, np, np.float64, **kwargs)
    a, b = p0.copy(), p0.copy()
    for g in grads:
        used.step(a, g, 0.1)
        fresh.step(b, g, 0.1)
    np.testing.assert_array_equal(a, b)


def test_load_state_dict_rejects_mismatch():
    opt = AdamW(8, np, np.float64)
    sd = opt.state_dict()
    with pytest.raises(CheckpointError, match=r"'exp_avg' has shape \(8,\), the model has 5 parameters"):
        AdamW(5, np, np.float64).load_state_dict(sd)
    with pytest.raises(CheckpointError, match=r"lacks arrays \['momentum_buffer'\]"):
        SGD(8, np, np.float64, momentum=0.5).load_state_dict(sd)
    with pytest.raises(CheckpointError, match="step"):
        opt.load_state_dict({"arrays": sd["arrays"], "scalars": {}})


@pytest.mark.parametrize("name,kwargs", [("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
                                         ("sgd", {}), ("adamw", {})])
def test_float32_stays_float32(name, kwargs):
    p = np.ones(16, dtype=np.float32)
    opt = make_optimizer(name, 16, np, np.float32, **kwargs)
    for _ in range(3):
        opt.step(p, np.full(16, 0.5, dtype=np.float32), 0.01)
    assert p.dtype == np.float32
    assert all(a.dtype == np.float32 for a in opt.state_dict()["arrays"].values())
    assert np.all(p < 1.0)


@pytest.mark.parametrize("name,kwargs", [("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
                                         ("sgd", {}), ("adamw", {}), ("lamb", {}), ("lars", {})])
def test_step_allocates_no_full_size_temporaries(name, kwargs):
    n = 1_000_000  # 8 MB per float64 array
    p, g = np.ones(n), np.full(n, 0.5)
    opt = make_optimizer(name, n, np, np.float64, **kwargs)
    opt.step(p, g, 0.01)
    tracemalloc.start()
    try:
        opt.step(p, g, 0.01)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < n * 8 // 4, f"step allocated {peak} bytes"


@pytest.mark.parametrize(
    "name,kwargs,pattern",
    [
        ("sgd", {"momentum": 1.0}, r"momentum must be a number in \[0, 1\), got 1.0"),
        ("sgd", {"momentum": -0.1}, "momentum"),
        ("sgd", {"nesterov": True}, "nesterov=true needs momentum > 0"),
        ("sgd", {"weight_decay": -1e-4}, r"weight_decay must be a finite number >= 0, got -0.0001"),
        ("sgd", {"betas": (0.9, 0.99)}, r"does not take \['betas'\]"),
        ("adamw", {"betas": (0.9, 1.0)}, r"betas\[1\] must be a number in \[0, 1\), got 1.0"),
        ("adamw", {"betas": (0.9,)}, "betas must be a pair"),
        ("adamw", {"eps": 0.0}, "eps must be a finite number > 0, got 0.0"),
        ("adamw", {"momentum": 0.9}, r"does not take \['momentum'\]"),
        ("adagrad", {}, r"unknown optimizer 'adagrad'; choose one of \['adamw', 'lamb', 'lars', 'lion', 'sgd'\]"),
    ],
)
def test_make_optimizer_validates(name, kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_optimizer(name, 4, np, np.float64, **kwargs)


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_clip_grad_norm_matches_torch(scale):
    rng = np.random.default_rng(7)
    g = rng.standard_normal(300) * scale
    t = torch.nn.Parameter(torch.zeros(300, dtype=torch.float64))
    t.grad = torch.tensor(g.copy())
    ref_norm = float(torch.nn.utils.clip_grad_norm_([t], max_norm=2.0))
    ours = g.copy()
    norm = clip_grad_norm_(ours, 2.0)
    assert isinstance(norm, float)
    assert math.isclose(norm, ref_norm, rel_tol=1e-12)
    assert math.isclose(norm, float(np.linalg.norm(g)), rel_tol=1e-12)
    if norm > 2.0:
        np.testing.assert_allclose(ours, t.grad.numpy(), rtol=1e-12)
        assert math.isclose(float(np.linalg.norm(ours)), 2.0, rel_tol=1e-5)
    else:
        np.testing.assert_array_equal(ours, g)  # untouched below the threshold


def test_clip_grad_norm_nonfinite_and_bad_max():
    g = np.array([1.0, np.inf, 2.0])
    assert clip_grad_norm_(g, 1.0) == math.inf
    np.testing.assert_array_equal(g, [1.0, np.inf, 2.0])
    with pytest.raises(ConfigError, match="max_norm must be a number > 0, got 0"):
        clip_grad_norm_(np.ones(3), 0)


def _torch_lrs(make_sched, steps, base_lr):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make_sched(opt)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return np.array(out)


def _ours(sched, steps):
    return np.array([sched(k) for k in range(steps)])


def test_step_schedule_matches_torch():
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5), 40, 0.2)
    ours = _ours(make_schedule("step", 0.2, 40, step_size=7, gamma=0.5), 40)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)
    assert ours[0] == 0.2 and ours[-1] == 0.2 * 0.5**5  # 39 // 7 == 5 decays


def test_cosine_schedule_matches_torch():
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=50, eta_min=1e-3), 50, 0.1)
    ours = _ours(make_schedule("cosine", 0.1, 50, min_lr=1e-3), 50)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)
    assert ours[0] == 0.1


def test_cosine_with_warmup_matches_torch():
    w, total = 5, 30

    def torch_sched(o):
        warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / w, end_factor=1.0, total_iters=w - 1)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total - w, eta_min=0.0)
        return torch.optim.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[w])

    ref = _torch_lrs(torch_sched, total, 0.4)
    ours = _ours(make_schedule("cosine", 0.4, total, warmup_steps=w), total)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours[:w], 0.4 * np.arange(1, w + 1) / w, rtol=1e-15)
    assert ours[w] == 0.4 and np.all(np.diff(ours[w:]) < 0)


def test_constant_schedule_with_warmup_matches_torch():
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=3), 10, 0.08)
    ours = _ours(make_schedule("constant", 0.08, 10, warmup_steps=4), 10)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)


def test_multistep_schedule_matches_torch():
    ref = _torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 12, 13], gamma=0.3), 30, 0.2)
    ours = _ours(make_schedule("multistep", 0.2, 30, milestones=[5, 12, 13], gamma=0.3), 30)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)
    assert ours[4] == 0.2 and ours[5] == pytest.approx(0.06) and ours[-1] == pytest.approx(0.2 * 0.3**3)


def test_multistep_milestones_count_from_the_end_of_the_warm_up():
    """As torch's SequentialLR hands over to MultiStepLR at the warm-up's end (its milestones
    then count from there), and as schedule=step counts; against the formula too."""
    w, total, milestones = 4, 25, [3, 10]

    def torch_sched(o):
        warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / w, end_factor=1.0, total_iters=w - 1)
        decay = torch.optim.lr_scheduler.MultiStepLR(o, milestones=milestones, gamma=0.5)
        return torch.optim.lr_scheduler.SequentialLR(o, [warm, decay], milestones=[w])

    ours = _ours(make_schedule("multistep", 0.4, total, warmup_steps=w, milestones=milestones, gamma=0.5), total)
    np.testing.assert_allclose(ours, _torch_lrs(torch_sched, total, 0.4), rtol=0, atol=1e-12)
    formula = [0.4 * (k + 1) / w if k < w else 0.4 * 0.5 ** sum(m <= k - w for m in milestones)
               for k in range(total)]
    np.testing.assert_allclose(ours, formula, rtol=1e-15)
    assert ours[w + 2] == 0.4 and ours[w + 3] == 0.2 and ours[w + 10] == 0.1
    floored = make_schedule("multistep", 1.0, 20, milestones=[1, 2, 3], gamma=0.1, min_lr=0.05)
    assert [floored(k) for k in range(4)] == [1.0, 0.1, 0.05, 0.05]


def test_cosine_holds_min_lr_after_total_and_step_floor():
    s = make_schedule("cosine", 1.0, 10, warmup_steps=2, min_lr=0.05)
    assert s(10) == 0.05 and s(1000) == 0.05
    assert s(9) > 0.05
    st = make_schedule("step", 1.0, 100, step_size=1, gamma=0.5, min_lr=0.1)
    assert st(2) == 0.25 and st(50) == 0.1
    with pytest.raises(ValueError, match="-1"):
        s(-1)


@pytest.mark.parametrize(
    "args,kwargs,pattern",
    [
        (("linear", 0.1, 10), {}, r"unknown lr schedule 'linear'"),
        (("cosine", 0.1, 10), {"warmup_steps": 10}, r"warmup_steps \(10\) leaves no steps"),
        (("constant", 0.1, 10), {"warmup_steps": 11}, r"warmup_steps \(11\) is more than total_steps \(10\)"),
        (("step", 0.1, 10), {}, "step_size must be an integer >= 1, got None"),
        (("step", 0.1, 10), {"step_size": 3, "gamma": 0.0}, r"gamma must be a number in \(0, 1\], got 0.0"),
        (("cosine", 0.1, 10), {"min_lr": 0.2}, r"min_lr \(0.2\) is above base_lr \(0.1\)"),
        (("cosine", 0.1, 0), {}, "total_steps must be >= 1, got 0"),
        (("cosine", -0.1, 10), {}, "base_lr must be a finite number >= 0, got -0.1"),
        (("multistep", 0.1, 10), {}, r"milestones must be a non-empty list of steps after the warm-up, got \(\)"),
        (("multistep", 0.1, 10), {"milestones": [3, 3]}, r"milestones must be strictly increasing, got \[3, 3\]"),
        (("multistep", 0.1, 10), {"milestones": [0]}, r"milestones\[0\] must be an integer >= 1, got 0"),
        (("multistep", 0.1, 10), {"milestones": [2, 8], "warmup_steps": 2},
         r"milestones\[1\] \(8\) is not before the schedule's end: 8 steps follow the warm-up"),
        (("multistep", 0.1, 10), {"milestones": [2], "gamma": 0.0}, r"gamma must be a number in \(0, 1\]"),
    ],
)
def test_make_schedule_validates(args, kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_schedule(*args, **kwargs)


@pytest.mark.parametrize(
    "build,key,detail,message",
    [
        (lambda: make_optimizer("sgd", 4, np, np.float64, momentum=2), "momentum",
         " must be a number in [0, 1), got 2", "sgd: momentum must be a number in [0, 1), got 2"),
        (lambda: make_optimizer("sgd", 4, np, np.float64, nesterov=True), "nesterov",
         "=true needs momentum > 0, got momentum=0", "sgd: nesterov=true needs momentum > 0, got momentum=0"),
        (lambda: make_optimizer("adamw", 4, np, np.float64, betas=(0.9, 1.0)), "betas",
         "[1] must be a number in [0, 1), got 1.0", "adamw: betas[1] must be a number in [0, 1), got 1.0"),
        (lambda: make_optimizer("lion", 4, np, np.float64, betas=0.9), "betas",
         " must be a pair of numbers, got 0.9", "lion: betas must be a pair of numbers, got 0.9"),
        (lambda: make_optimizer("adamw", 4, np, np.float64, eps=0.0), "eps",
         " must be a finite number > 0, got 0.0", "adamw: eps must be a finite number > 0, got 0.0"),
        (lambda: make_schedule("step", 0.1, 10, step_size=3, gamma=5), "gamma",
         " must be a number in (0, 1], got 5", "lr schedule 'step': gamma must be a number in (0, 1], got 5"),
        (lambda: make_schedule("constant", 0.1, 10, warmup_steps=11), "warmup_steps",
         " (11) is more than total_steps (10)",
         "lr schedule 'constant': warmup_steps (11) is more than total_steps (10)"),
        (lambda: make_schedule("cosine", -0.1, 10), "base_lr",
         " must be a finite number >= 0, got -0.1",
         "lr schedule 'cosine': base_lr must be a finite number >= 0, got -0.1"),
    ],
)
def test_errors_name_the_parameter_apart_from_the_text(build, key, detail, message):
    """An optimizer's or schedule's error about one of its parameters carries the parameter's
    name and the rest of the message, which the config restates as `optim.<key><detail>`."""
    with pytest.raises(ConfigError) as err:
        build()
    assert type(err.value) is ConfigError                  # the kind every rank prints
    assert (err.value.key, err.value.detail, str(err.value)) == (key, detail, message)
    assert str(err.value.restated("optim")) == f"optim.{key}{detail}"
    again = pickle.loads(pickle.dumps(err.value))
    assert (again.key, again.detail, str(again)) == (key, detail, message)


def test_errors_about_no_parameter_name_none():
    with pytest.raises(ConfigError) as err:
        make_optimizer("adagrad", 4, np, np.float64)
    assert err.value.key is None
    with pytest.raises(ConfigError) as err:
        make_schedule("linear", 0.1, 10)
    assert err.value.key is None


def test_scaled_lr():
    assert scaled_lr(0.1, 1, 1.0) == 0.1
    assert math.isclose(scaled_lr(0.1, 8, 1.0), 0.8)
    assert math.isclose(scaled_lr(0.1, 5, 0.5), 0.3)
    assert scaled_lr(0.1, 64, 0.0) == 0.1
    with pytest.raises(ConfigError, match="world size must be an integer >= 1, got 0"):
        scaled_lr(0.1, 0, 1.0)
    with pytest.raises(ConfigError, match="-1"):
        scaled_lr(0.1, 4, -1)
