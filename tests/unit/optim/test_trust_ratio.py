"""LAMB and LARS against references written here from the variants their modules state, per
parameter tensor in plain NumPy (float64, several steps); LAMB's Adam direction against
torch.optim.Adam and LARS's momentum against torch.optim.SGD's; the parameters' segments of an optimizer's flat array, and sharded slices
whose cut parameters have their norms completed (the MPI layer's part emulated by summing the
slices' partial norms here; tests/mpi/runtime/test_trust_ratio_training.py runs it over MPI)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from hpc_rlx.optim import make_optimizer
from hpc_rlx.optim.segments import Segment, check_segments, cut_parameters, slice_segments, whole_array

SHAPES = [(6, 5), (5,), (3, 4, 2), (1,), (7,)]


def _spans(shapes=SHAPES):
    spans, off = [], 0
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape))
        spans.append((f"p{i}", off, n))
        off += n
    return spans, off


def _lamb_reference(ps, ms, vs, gs, t, lr, b1, b2, eps, wd):
    """The paper's Algorithm 2 as lamb.py states it, one tensor at a time."""
    out = []
    for i, (p, g) in enumerate(zip(ps, gs)):
        ms[i] = b1 * ms[i] + (1 - b1) * g
        vs[i] = b2 * vs[i] + (1 - b2) * g * g
        u = (ms[i] / (1 - b1**t)) / (np.sqrt(vs[i] / (1 - b2**t)) + eps) + wd * p
        pn, un = np.linalg.norm(p), np.linalg.norm(u)
        ratio = pn / un if pn > 0 and un > 0 else 1.0
        out.append(p - lr * ratio * u)
    return out


def _lars_reference(ps, vs, gs, lr, momentum, wd, eta):
    """Algorithm 1 of the LARS paper as lars.py states it, one tensor at a time."""
    out = []
    for i, (p, g) in enumerate(zip(ps, gs)):
        pn, gn = np.linalg.norm(p), np.linalg.norm(g)
        ratio = eta * pn / (gn + wd * pn) if pn > 0 and gn > 0 else 1.0
        vs[i] = momentum * vs[i] + lr * ratio * (g + wd * p)
        out.append(p - vs[i])
    return out


def _split(flat, spans):
    return [flat[o:o + n].copy() for _, o, n in spans]


def _problem(seed, steps, zero_param=True):
    spans, size = _spans()
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(size)
    if zero_param:
        p0[spans[3][1]:spans[3][1] + spans[3][2]] = 0.0     # a parameter at 0: its ratio is 1
    grads = [rng.standard_normal(size) for _ in range(steps)]
    grads[1][spans[1][1]:spans[1][1] + spans[1][2]] = 0.0   # a zero gradient (LARS: ratio 1)
    lrs = [0.05 * (1 + 0.3 * math.sin(k)) for k in range(steps)]
    return spans, size, p0, grads, lrs


LAMB_CASES = [{}, {"weight_decay": 0.0}, {"betas": [0.8, 0.99], "eps": 1e-3, "weight_decay": 0.1}]
LARS_CASES = [{}, {"weight_decay": 0.0, "momentum": 0.0}, {"momentum": 0.5, "weight_decay": 0.01,
                                                           "trust_coefficient": 0.02}]


@pytest.mark.parametrize("kwargs", LAMB_CASES)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_lamb_follows_its_stated_variant_per_parameter(kwargs, scale):
    spans, size, p0, grads, lrs = _problem(0, 6)
    opt = make_optimizer("lamb", size, np, np.float64, **kwargs)
    opt.use_segments(slice_segments(spans, 0, size))
    b1, b2 = kwargs.get("betas", (0.9, 0.999))
    eps, wd = kwargs.get("eps", 1e-6), kwargs.get("weight_decay", 0.01)
    p, ref = p0.copy(), _split(p0, spans)
    ms, vs = [np.zeros_like(x) for x in ref], [np.zeros_like(x) for x in ref]
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        opt.step(p, g.copy(), lr, grad_scale=scale)
        ref = _lamb_reference(ref, ms, vs, _split(scale * g, spans), t, lr, b1, b2, eps, wd)
    assert not np.allclose(p, p0)
    np.testing.assert_allclose(p, np.concatenate(ref), rtol=1e-12, atol=1e-14)
    state = opt.state_dict()
    np.testing.assert_allclose(state["arrays"]["exp_avg"], np.concatenate(ms), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state["arrays"]["exp_avg_sq"], np.concatenate(vs), rtol=1e-12, atol=1e-15)
    assert state["scalars"]["step"] == len(grads)


@pytest.mark.parametrize("kwargs", LARS_CASES)
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_lars_follows_its_stated_variant_per_parameter(kwargs, scale):
    spans, size, p0, grads, lrs = _problem(1, 6)
    opt = make_optimizer("lars", size, np, np.float64, **kwargs)
    opt.use_segments(slice_segments(spans, 0, size))
    momentum, wd = kwargs.get("momentum", 0.9), kwargs.get("weight_decay", 1e-4)
    eta = kwargs.get("trust_coefficient", 1e-3)
    p, ref = p0.copy(), _split(p0, spans)
    vs = [np.zeros_like(x) for x in ref]
    for g, lr in zip(grads, lrs):
        opt.step(p, g.copy(), lr, grad_scale=scale)
        ref = _lars_reference(ref, vs, _split(scale * g, spans), lr, momentum, wd, eta)
    assert not np.allclose(p, p0)
    np.testing.assert_allclose(p, np.concatenate(ref), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(opt.state_dict()["arrays"]["momentum_buffer"], np.concatenate(vs),
                               rtol=1e-12, atol=1e-15)


def test_the_trust_ratio_is_per_parameter_not_over_the_whole_array():
    """Without its segments the array is one parameter: a different update (the norms differ)."""
    spans, size, p0, grads, lrs = _problem(2, 2)
    for name in ("lamb", "lars"):
        a, b = (make_optimizer(name, size, np, np.float64) for _ in range(2))
        a.use_segments(slice_segments(spans, 0, size))
        pa, pb = p0.copy(), p0.copy()
        for g, lr in zip(grads, lrs):
            a.step(pa, g.copy(), lr)
            b.step(pb, g.copy(), lr)
        assert np.abs(pa - pb).max() > 1e-6, name


def test_lambs_direction_and_moments_are_torchs_adam():
    """With lr = 1 on one tensor of norm = its update's norm, LAMB steps by Adam's direction;
    that direction and the moments are torch.optim.Adam's (bias-corrected, eps outside sqrt)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    n, steps = 50, 5
    grads = [rng.standard_normal(n) for _ in range(steps)]
    tp = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
    topt = torch.optim.Adam([tp], lr=1.0, betas=(0.9, 0.999), eps=1e-6)
    ours = make_optimizer("lamb", n, np, np.float64, weight_decay=0.0)
    for g in grads:
        before = tp.detach().numpy().copy()
        tp.grad = torch.tensor(g)
        topt.step()
        adam_direction = before - tp.detach().numpy()
        # LAMB's update on a parameter at 0 has ratio 1: the step is lr * its direction
        q = np.zeros(n)
        ours.step(q, g.copy(), 1.0)
        np.testing.assert_allclose(-q, adam_direction, rtol=1e-12)
        tstate = topt.state[tp]
        np.testing.assert_allclose(ours.state_dict()["arrays"]["exp_avg"], tstate["exp_avg"].numpy(), rtol=1e-13)
        np.testing.assert_allclose(ours.state_dict()["arrays"]["exp_avg_sq"], tstate["exp_avg_sq"].numpy(),
                                   rtol=1e-13)


def test_lars_momentum_is_torchs_sgd_momentum_times_lr():
    """Where the ratio is 1 (a parameter at 0) and lr is constant, LARS's momentum (lr inside)
    is lr times torch.optim.SGD's momentum buffer (lr outside), and its step the same."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    n, lr = 40, 0.3
    tp = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
    topt = torch.optim.SGD([tp], lr=lr, momentum=0.8)
    ours = make_optimizer("lars", n, np, np.float64, momentum=0.8, weight_decay=0.0)
    for _ in range(5):
        g = rng.standard_normal(n)
        before = tp.detach().numpy().copy()
        tp.grad = torch.tensor(g)
        topt.step()
        q = np.zeros(n)
        ours.step(q, g.copy(), lr)
        np.testing.assert_allclose(ours.state_dict()["arrays"]["momentum_buffer"],
                                   lr * topt.state[tp]["momentum_buffer"].numpy(), rtol=1e-13)
        np.testing.assert_allclose(q, tp.detach().numpy() - before, rtol=1e-12)


def test_segments_of_slices_and_the_parameters_a_boundary_cuts():
    spans, size = _spans()                     # sizes 30, 5, 24, 1, 7: offsets 0, 30, 35, 59, 60
    assert slice_segments(spans, 0, size) == tuple(
        Segment(name, i, o, o + n, True) for i, (name, o, n) in enumerate(spans))
    assert slice_segments(spans, 28, 40) == (Segment("p0", 0, 0, 2, False), Segment("p1", 1, 2, 7, True),
                                             Segment("p2", 2, 7, 12, False))
    assert slice_segments(spans, 60, 60) == ()
    assert cut_parameters(spans, [28, 40]) == [0, 2]
    assert cut_parameters(spans, [30, 35, 67]) == []      # boundaries between parameters cut none
    assert whole_array(5) == (Segment("", 0, 0, 5, True),) and whole_array(0) == ()
    with pytest.raises(ValueError, match="tile"):
        check_segments([Segment("a", 0, 0, 2, True), Segment("b", 1, 3, 5, True)], 5)
    with pytest.raises(ValueError, match="cover 2 of the optimizer's 5"):
        check_segments([Segment("a", 0, 0, 2, True)], 5)


class _Slices:
    """Slices stepped at once, one thread each, their partial squared norms summed: what the
    MPI layer (`comm.shard.SplitNorms`) does for the cut parameters, without MPI."""

    def __init__(self, spans, bounds):
        self.spans, self.bounds = spans, bounds
        self.barrier = threading.Barrier(len(bounds))
        self.posted: list = [None] * len(bounds)

    def combine_for(self, r, segments):
        def combine(partial):
            self.posted[r] = {s.index: row for s, row in zip(segments, partial)}
            self.barrier.wait()
            total = {}
            for posted in self.posted:              # rank order
                for index, row in posted.items():
                    total[index] = total[index] + row if index in total else row.copy()
            self.barrier.wait()
            return np.array([total[s.index] for s in segments]).reshape(partial.shape)
        return combine


def step_whole_and_slices(whole, parts, bounds, p0, grads, lrs):
    """(the whole array stepped by `whole`, the same stepped as slices [lo, hi) by `parts`,
    one thread each, as ranks step their shards at once)."""
    p, q = p0.copy(), p0.copy()
    for g, lr in zip(grads, lrs):
        whole.step(p, g.copy(), lr)
        gq = g.copy()
        threads = [threading.Thread(target=opt.step, args=(q[lo:hi], gq[lo:hi], lr))
                   for opt, (lo, hi) in zip(parts, bounds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    return p, q


@pytest.mark.parametrize("name", ["lamb", "lars"])
@pytest.mark.parametrize("starts, cut", [((28, 40), [0, 2]), ((10, 20), [0])],
                         ids=["two-cut", "one-over-three-slices"])
def test_sliced_state_with_cut_parameters_equals_the_whole(name, starts, cut):
    spans, size, p0, grads, lrs = _problem(5, 5)
    bounds = list(zip((0,) + starts, starts + (size,)))
    assert cut_parameters(spans, starts) == cut
    whole = make_optimizer(name, size, np, np.float64)
    whole.use_segments(slice_segments(spans, 0, size))
    slices = _Slices(spans, bounds)
    parts = []
    for r, (lo, hi) in enumerate(bounds):
        opt = make_optimizer(name, hi - lo, np, np.float64)
        segments = slice_segments(spans, lo, hi)
        opt.use_segments(segments, slices.combine_for(r, segments))
        parts.append(opt)
    p, q = step_whole_and_slices(whole, parts, bounds, p0, grads, lrs)
    np.testing.assert_allclose(q, p, rtol=1e-12, atol=1e-15)
    # and without completing the norms the slices step differently: the test can see it
    first = starts[0]
    alone = make_optimizer(name, first, np, np.float64)
    alone.use_segments(slice_segments(spans, 0, first))
    r = p0[:first].copy()
    for g, lr in zip(grads, lrs):
        alone.step(r, g[:first].copy(), lr)
    assert np.abs(r - p[:first]).max() > 1e-8


@pytest.mark.parametrize("name,kwargs", [("lamb", {}), ("lars", {})])
def test_resume_from_state_is_bitwise_and_reset_is_fresh(name, kwargs):
    spans, size, p0, grads, lrs = _problem(6, 6)
    a = make_optimizer(name, size, np, np.float64, **kwargs)
    a.use_segments(slice_segments(spans, 0, size))
    pa = p0.copy()
    for g, lr in zip(grads[:3], lrs[:3]):
        a.step(pa, g.copy(), lr)
    b = make_optimizer(name, size, np, np.float64, **kwargs)
    b.use_segments(slice_segments(spans, 0, size))
    b.load_state_dict(a.state_dict())
    pb = pa.copy()
    for g, lr in zip(grads[3:], lrs[3:]):
        a.step(pa, g.copy(), lr)
        b.step(pb, g.copy(), lr)
    assert np.array_equal(pa, pb)
    a.reset()
    fresh = make_optimizer(name, size, np, np.float64, **kwargs)
    fresh.use_segments(slice_segments(spans, 0, size))
    x, y = p0.copy(), p0.copy()
    for g, lr in zip(grads, lrs):
        a.step(x, g.copy(), lr)
        fresh.step(y, g.copy(), lr)
    assert np.array_equal(x, y)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_float32_stays_float32(name):
    opt = make_optimizer(name, 16, np, np.float32)
    p = np.ones(16, np.float32)
    for _ in range(3):
        opt.step(p, np.full(16, 0.5, np.float32), 0.01)
    assert p.dtype == np.float32 and np.all(p < 1.0)
    assert all(a.dtype == np.float32 for a in opt.state_dict()["arrays"].values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_cupy_steps_equal_numpy(name):
    """The same update on CuPy arrays (the math is backend-neutral: `xp`)."""
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:                           # noqa: BLE001 - CuPy without a usable GPU
        pytest.skip("no CUDA device")
    spans, size, p0, grads, lrs = _problem(7, 4)
    host, dev = (make_optimizer(name, size, xp, np.float64) for xp in (np, cp))
    for opt in (host, dev):
        opt.use_segments(slice_segments(spans, 0, size))
    p, q = p0.copy(), cp.asarray(p0)
    for g, lr in zip(grads, lrs):
        host.step(p, g.copy(), lr)
        dev.step(q, cp.asarray(g), lr)
    np.testing.assert_allclose(cp.asnumpy(q), p, rtol=1e-12, atol=1e-15)
    restored = make_optimizer(name, size, cp, np.float64)
    restored.load_state_dict(dev.state_dict())
    for k, a in restored.state_dict()["arrays"].items():
        np.testing.assert_array_equal(a, dev.state_dict()["arrays"][k])
