"""Unit tests of the averaging-policy math (no MPI: the Allreduce SUM is a numpy sum)."""

from __future__ import annotations

import json
import math
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.policies import (
    DiLoCo, ElcheScheduler, IntervalController, OuterAverage, SlowMo,
    SyncLayout, make_outer, plan_window, work_weight,
)
from hpc_rlx.injection.slowdown import SlowdownInjector, parse_slowdown, slowdown_for_rank
from hpc_rlx.policies.consensus import divergence_from
from hpc_rlx.policies.smoothing import adaptive_ema


def allreduce_sum(buckets):
    """What MPI Allreduce(SUM) leaves in every rank's bucket."""
    total = np.sum(np.stack(buckets), axis=0)
    return [total.copy() for _ in buckets]


def run_consensus(params_per_rank, steps, gamma=1.0, dtype=np.float64):
    """The windowed policies' sync path: `SyncLayout.pack`, the SUM, `SyncLayout.finish`."""
    layout = SyncLayout(params_per_rank[0].size, len(params_per_rank))
    buckets = []
    for rank, (W, s) in enumerate(zip(params_per_rank, steps)):
        b = np.full(layout.size, 123.0, dtype=dtype)  # garbage must be overwritten
        layout.pack(b, W.astype(dtype), work_weight(s, gamma), rank, {})
        buckets.append(b)
    reduced = allreduce_sum(buckets)
    outs, applied = [], []
    for W, b in zip(params_per_rank, reduced):
        out = W.astype(dtype).copy()
        applied.append(layout.finish(b, out))
        outs.append(out)
    return outs, applied


# ----------------------------------------------------------------------------- consensus

@pytest.mark.parametrize("gamma", [1.0, 0.5, 2.0])
def test_weighted_consensus_exact_for_unequal_steps_including_zero(gamma):
    rng = np.random.default_rng(0)
    steps = [7, 0, 2, 13]
    params = [rng.normal(size=50) for _ in steps]
    params[1][:] = np.nan  # an idle rank's stale params must not leak into the consensus
    outs, applied = run_consensus(params, steps, gamma)
    w = np.array([s ** gamma if s else 0.0 for s in steps])
    movers = [p for p, s in zip(params, steps) if s]
    expected = np.average(np.stack(movers), axis=0, weights=w[w > 0])
    assert all(applied)
    for out in outs:  # every rank holds the same consensus
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
        assert np.array_equal(out, outs[0])
    naive = np.mean(np.stack(movers), axis=0)
    assert np.max(np.abs(outs[0] - naive)) > 0.05


def test_consensus_float32_bucket():
    rng = np.random.default_rng(1)
    steps = [30, 10]
    params = [rng.normal(size=1000).astype(np.float32) for _ in steps]
    outs, _ = run_consensus(params, steps, dtype=np.float32)
    expected = (30 * params[0].astype(np.float64) + 10 * params[1]) / 40
    assert outs[0].dtype == np.float32
    np.testing.assert_allclose(outs[0], expected, rtol=1e-5, atol=1e-6)


def test_all_idle_keeps_params_unchanged_on_every_rank():
    rng = np.random.default_rng(2)
    params = [rng.normal(size=20) for _ in range(3)]
    outs, applied = run_consensus(params, [0, 0, 0])
    assert applied == [False, False, False]
    for out, p in zip(outs, params):
        assert np.array_equal(out, p)


def test_single_mover_gets_its_own_params():
    rng = np.random.default_rng(3)
    params = [rng.normal(size=10) for _ in range(3)]
    outs, applied = run_consensus(params, [0, 5, 0], gamma=1.7)
    assert all(applied)
    for out in outs:
        np.testing.assert_allclose(out, params[1], rtol=1e-15)


def test_pack_writes_into_the_callers_bucket_without_allocating():
    n = 1 << 20
    layout = SyncLayout(n, 1)
    params = np.ones(n, dtype=np.float32)
    backing = np.zeros(layout.size + 4, dtype=np.float32)
    bucket = backing[2: layout.size + 2]  # a view: the writes must land in `backing`
    tracemalloc.start()
    layout.pack(bucket, params, 3.0, 0, {})
    layout.finish(bucket, params)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < params.nbytes // 10
    assert backing[2] == 3.0 and backing[n + 1] == 3.0  # first and last weighted parameter
    assert layout.total_weight(bucket) == 3.0
    assert backing[1] == 0 and backing[layout.size + 2] == 0
    assert np.all(params == 1.0)


def test_work_weight():
    assert work_weight(0, 0.0) == 0.0  # not Python's 0**0 == 1
    assert work_weight(0, 1.0) == 0.0
    assert work_weight(4, 0.5) == 2.0
    assert work_weight(3, 1.0) == 3.0
    assert work_weight(4, -1.0) == 0.25       # the default: a rank's move divided by its steps
    assert work_weight(0, -1.0) == 0.0        # an idle rank still has no vote
    with pytest.raises(ConfigError, match="gamma"):
        work_weight(3, float("inf"))
    with pytest.raises(ValueError):
        work_weight(-1)


def test_the_default_weights_give_each_shard_the_same_pull_however_fast_its_rank():
    # cadence with rank 1 three times slower: rank 0 ran 3 local steps on its shard, rank 1 one
    # step on its own, each moving the model by d_r a step. With gamma=-1 (the default) the
    # consensus moves by d_0 + d_1 times one factor: both shards pull alike, as in sync. With
    # gamma=1 rank 0's shard pulls 9 times harder (the accuracy cadence lost, bench/README.md).
    rng = np.random.default_rng(2)
    w, d = rng.normal(size=50), [rng.normal(size=50) for _ in range(2)]
    steps = [3, 1]
    layout = SyncLayout(50, 2)
    for gamma, pulls in ((-1.0, (1.0, 1.0)), (1.0, (9.0, 1.0))):
        buckets = []
        for r in range(2):
            b = np.zeros(layout.size)
            layout.pack(b, w + steps[r] * d[r], work_weight(steps[r], gamma), r, {})
            buckets.append(b)
        out = np.empty(50)
        assert layout.finish(allreduce_sum(buckets)[0], out)
        total = sum(work_weight(s, gamma) for s in steps)
        np.testing.assert_allclose(out - w, (pulls[0] * d[0] + pulls[1] * d[1]) / total,
                                   rtol=1e-12, atol=1e-12)


def test_pack_rejects_short_bucket_and_bad_weight():
    layout = SyncLayout(4, 1)
    with pytest.raises(ValueError, match="slots"):
        layout.pack(np.zeros(4), np.ones(4), 1.0, 0, {})
    with pytest.raises(ValueError, match="weight"):
        layout.pack(np.zeros(layout.size), np.ones(4), math.nan, 0, {})


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.integers(0, 50), min_size=1, max_size=6),
       gamma=st.floats(0.0, 2.0), seed=st.integers(0, 2**16))
def test_consensus_matches_weighted_average_property(steps, gamma, seed):
    rng = np.random.default_rng(seed)
    params = [rng.normal(size=7) for _ in steps]
    outs, applied = run_consensus(params, steps, gamma)
    w = np.array([work_weight(s, gamma) for s in steps])
    if w.sum() == 0:
        assert not any(applied) and all(np.array_equal(o, p) for o, p in zip(outs, params))
    else:
        expected = (w[:, None] * np.stack(params)).sum(0) / w.sum()
        np.testing.assert_allclose(outs[0], expected, rtol=1e-10, atol=1e-12)


def test_divergence_matches_direct_formula():
    rng = np.random.default_rng(4)
    steps = [3, 1]
    params = [rng.normal(size=300) for _ in steps]
    layout = SyncLayout(300, len(steps))
    buckets = []
    for rank, (W, s) in enumerate(zip(params, steps)):
        b = np.zeros(layout.size)
        layout.pack(b, W, work_weight(s, 1.0), rank, {})
        buckets.append(b)
    reduced = allreduce_sum(buckets)
    cons = (3 * params[0] + params[1]) / 4
    for W, b in zip(params, reduced):
        want = np.linalg.norm(W - cons) / np.linalg.norm(cons)
        assert layout.divergence(W, b) == pytest.approx(want, rel=1e-12)
        # several chunks, with a ragged last one
        chunked = divergence_from(W, layout.bucket.payload_of(b), layout.total_weight(b), chunk=64)
        assert chunked == pytest.approx(want, rel=1e-12)
    assert layout.divergence(params[0], reduced[0], own_weight=0.0) == 0.0


# ----------------------------------------------------------------------------- bucket layout

def test_layout_gathers_every_rank_report_and_consensus():
    rng = np.random.default_rng(5)
    world, n = 3, 40
    layout = SyncLayout(n, world)
    params = [rng.normal(size=n).astype(np.float32) for _ in range(world)]
    steps = [12, 4, 0]
    reports = [
        dict(steps=12, samples=12 * 16, compute_ms=240.0, sync_ms=5.0, divergence=0.01),
        dict(steps=4, samples=4 * 16, compute_ms=250.0, sync_ms=2.0, divergence=0.03),
        dict(steps=0, samples=0, compute_ms=0.0, sync_ms=9.0, divergence=0.0),
    ]
    buckets = []
    for r in range(world):
        b = np.full(layout.size, 7.0, dtype=np.float32)
        layout.pack(b, params[r], work_weight(steps[r], 1.0), r, reports[r])
        buckets.append(b)
    reduced = allreduce_sum(buckets)
    reads = [layout.read(b) for b in reduced]
    for rep in reads:
        assert rep.total_weight == 16.0 and rep.applied
        assert rep.steps == steps
        assert rep.total_samples == 16 * 16
        assert rep.ms_per_step[:2] == [20.0, 62.5] and math.isnan(rep.ms_per_step[2])
        assert rep.window_ms == 250.0
        assert rep.slowest_ms_per_step == 62.5
        assert rep.comm_ms == 2.0
        assert rep.max_divergence == pytest.approx(0.03)
        for name in layout.fields:  # bit-identical on every rank
            assert np.array_equal(rep[name], reads[0][name])
    out = params[0].copy()
    assert layout.finish(reduced[0], out)
    np.testing.assert_allclose(out, (12 * params[0] + 4 * params[1]) / 16, rtol=1e-5)


def test_layout_nan_divergence_reads_as_infinite_and_first_sync_has_no_comm():
    layout = SyncLayout(2, 2)
    b0, b1 = np.zeros(layout.size), np.zeros(layout.size)
    layout.pack(b0, np.ones(2), 1.0, 0, dict(steps=1, compute_ms=1.0, divergence=math.nan))
    layout.pack(b1, np.ones(2), 1.0, 1, dict(steps=1, compute_ms=1.0))
    rep = layout.read(b0 + b1)
    assert rep.max_divergence == math.inf
    assert rep.comm_ms is None


def test_layout_rejects_mismatches():
    layout = SyncLayout(4, 2)
    with pytest.raises(ValueError, match="slots"):
        layout.pack(np.zeros(5), np.ones(4), 1.0, 0, {})
    with pytest.raises(ValueError, match="rank"):
        layout.pack(np.zeros(layout.size), np.ones(4), 1.0, 2, {})
    with pytest.raises(ValueError, match="unknown"):
        layout.pack(np.zeros(layout.size), np.ones(4), 1.0, 0, {"speed": 1.0})


# ----------------------------------------------------------------------------- ElChe

def test_adaptive_ema_rate():
    assert adaptive_ema(None, 7.0) == 7.0
    assert adaptive_ema(10.0, 10.5) == pytest.approx(10.05)  # 5% change -> a clamped to 0.1
    assert adaptive_ema(10.0, 12.0) == pytest.approx(10.4)   # 20% change -> a = 0.2
    assert adaptive_ema(10.0, 30.0) == pytest.approx(26.0)   # 200% change -> a clamped to 0.8


def simulate_cadence(sched, true_ms, windows, rng, noise=0.05, comm_ms=None):
    """Run `windows` syncs against ranks whose ms/step is true_ms (+- noise).

    comm_ms=None leaves the anchor alone, so the balancing is tested on its own.
    """
    history = []
    for _ in range(windows):
        counts = list(sched.counts)
        measured = [m * (1 + rng.uniform(-noise, noise)) for m in true_ms]
        window = max(c * m for c, m in zip(counts, measured))
        history.append(sched.observe(measured, comm_ms, window))
    return history


def test_elche_settles_at_three_to_one():
    sched = ElcheScheduler(2, anchor=10, max_anchor=200)
    hist = simulate_cadence(sched, [10.0, 30.0], 30, np.random.default_rng(6))
    for counts in hist[-10:]:
        assert counts[0] / counts[1] == pytest.approx(3.0, rel=0.12)
    c = hist[-1]
    walls = [c[0] * 10.0, c[1] * 30.0]  # both ranks reach the sync at about the same time
    assert max(walls) / min(walls) < 1.15


def test_elche_every_rank_computes_the_same_counts_from_the_bucket():
    world, n = 3, 8
    true_ms = [5.0, 10.0, 20.0]
    layout = SyncLayout(n, world)
    scheds = [ElcheScheduler(world, anchor=4) for _ in range(world)]
    rng = np.random.default_rng(7)
    counts = scheds[0].counts
    for _ in range(12):
        buckets = []
        for r in range(world):
            b = np.zeros(layout.size, dtype=np.float32)
            ms = true_ms[r] * (1 + rng.uniform(-0.2, 0.2))  # rank-local, noisy measurement
            layout.pack(b, np.ones(n, np.float32), work_weight(counts[r]), r,
                        dict(steps=counts[r], compute_ms=counts[r] * ms, sync_ms=0.5))
            buckets.append(b)
        decided = []
        for r, b in enumerate(allreduce_sum(buckets)):
            rep = layout.read(b)
            decided.append(scheds[r].observe(rep.ms_per_step, rep.comm_ms, rep.window_ms))
        assert decided[0] == decided[1] == decided[2]
        counts = decided[0]
    assert counts[0] > counts[1] > counts[2] >= 1
    assert counts[0] / counts[2] == pytest.approx(4.0, rel=0.3)


def test_elche_lockstep_when_max_batch_diff_zero():
    sched = ElcheScheduler(2, anchor=10, max_batch_diff=0)
    for counts in simulate_cadence(sched, [10.0, 30.0], 15, np.random.default_rng(8)):
        assert counts[0] == counts[1]


def test_elche_max_batch_diff_bounds_lead_and_moves():
    d = 3
    sched = ElcheScheduler(2, anchor=10, max_batch_diff=d)
    prev = list(sched.counts)
    for counts in simulate_cadence(sched, [10.0, 30.0], 15, np.random.default_rng(9)):
        assert 0 <= counts[0] - counts[1] <= d
        assert all(abs(a - b) <= d for a, b in zip(counts, prev))
        prev = counts
    assert counts[0] - counts[1] == d  # the guard is what binds, not the speeds


def test_elche_anchor_grows_under_high_overhead():
    sched = ElcheScheduler(1, anchor=10, max_anchor=1000, overhead_target=0.1)
    sched.observe([1.0], comm_ms=3.0, window_ms=10.0)  # overhead 0.3 = 3x the target
    assert sched.anchor == math.ceil(10 * 0.3 / 0.1)
    assert sched.counts == [sched.anchor]
    assert sched.metrics()["overhead"] == pytest.approx(0.3)
    json.dumps(sched.metrics())


def test_elche_anchor_is_capped():
    sched = ElcheScheduler(2, anchor=10, max_anchor=50)
    for _ in range(5):
        counts = sched.observe([1.0, 1.0], comm_ms=100.0, window_ms=10.0)
        assert sched.anchor <= 50
    assert sched.anchor == 50 and counts == [50, 50]


def test_elche_anchor_shrinks_by_one_when_overhead_is_low():
    sched = ElcheScheduler(1, anchor=20, overhead_target=0.1)
    sched.observe([1.0], comm_ms=0.4, window_ms=20.0)  # 0.02 < 0.05
    assert sched.anchor == 19
    sched.observe([1.0], comm_ms=1.4, window_ms=19.0)  # 0.074: inside the band, no change
    assert sched.anchor == 19
    for _ in range(40):
        sched.observe([1.0], comm_ms=0.0, window_ms=5.0)
    assert sched.anchor == 1  # never below one step


def test_elche_hysteresis_suppresses_jitter_but_follows_real_change():
    sched = ElcheScheduler(2, anchor=20)
    rng = np.random.default_rng(10)
    simulate_cadence(sched, [10.0, 30.0], 15, rng, noise=0.0)
    settled = list(sched.counts)
    for counts in simulate_cadence(sched, [10.0, 30.0], 60, rng, noise=0.08):
        assert counts == settled
    hist = simulate_cadence(sched, [10.0, 50.0], 20, rng, noise=0.02)  # rank 1 slows down
    assert hist[-1][0] / hist[-1][1] == pytest.approx(5.0, rel=0.12)


def test_elche_keeps_estimate_for_idle_rank():
    sched = ElcheScheduler(2, anchor=10)
    sched.observe([10.0, 30.0])
    before = list(sched.counts)
    assert sched.observe([10.0, math.nan]) == before


def test_elche_state_roundtrips_through_json():
    a = ElcheScheduler(3, anchor=8, max_batch_diff=5)
    rng = np.random.default_rng(11)
    simulate_cadence(a, [3.0, 6.0, 9.0], 5, rng)
    b = ElcheScheduler(3, anchor=8, max_batch_diff=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(5):
        ms = [3.0 * rng.uniform(0.9, 1.1), 6.0, 9.0]
        assert a.observe(ms, 0.5, 30.0) == b.observe(ms, 0.5, 30.0)
    c = ElcheScheduler(2, anchor=8)  # other world size: keep anchor, re-measure
    c.load_state_dict(a.state_dict())
    assert c.counts == [a.anchor, a.anchor]


@pytest.mark.parametrize("kwargs,match", [
    (dict(anchor=0), "policy.anchor"),
    (dict(anchor=300, max_anchor=200), "max_anchor"),
    (dict(overhead_target=0.0), "overhead_target"),
    (dict(max_batch_diff=-1), "max_batch_diff"),
])
def test_elche_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ElcheScheduler(2, **kwargs)


# ----------------------------------------------------------------------------- async K

def simulate_async(ctrl, comm_ms, step_ms, syncs, rng, noise=0.05, divergence=None):
    shares = []
    for _ in range(syncs):
        k = ctrl.k
        c = comm_ms * (1 + rng.uniform(-noise, noise))
        s = step_ms * (1 + rng.uniform(-noise, noise))
        shares.append(c / (k * s))
        ctrl.observe(c, s, divergence)
    return shares


def test_async_share_settles_within_two_points_of_target():
    ctrl = IntervalController(k=1, max_anchor=500, overhead_target=0.1)
    shares = simulate_async(ctrl, 5.0, 2.0, 40, np.random.default_rng(12))
    assert shares[0] > 0.5  # K=1 was far too chatty
    for s in shares[-20:]:
        assert abs(s - 0.1) <= 0.02
    assert ctrl.k == pytest.approx(math.ceil(5.0 / (0.1 * 2.0)), abs=3)


def test_async_k_follows_cheaper_comm_down_and_is_capped():
    ctrl = IntervalController(k=10, max_anchor=500)
    rng = np.random.default_rng(13)
    simulate_async(ctrl, 5.0, 2.0, 15, rng)
    high = ctrl.k
    simulate_async(ctrl, 1.0, 2.0, 15, rng)
    assert ctrl.k < high / 3
    capped = IntervalController(k=10, max_anchor=30)
    simulate_async(capped, 50.0, 1.0, 10, rng)
    assert capped.k == 30


def test_async_divergence_guard_shrinks_k_and_holds_it():
    ctrl = IntervalController(k=10, max_anchor=200, divergence_threshold=0.05)
    rng = np.random.default_rng(14)
    simulate_async(ctrl, 8.0, 2.0, 10, rng)  # overhead alone wants K = 40
    k0 = ctrl.k
    assert k0 >= 36
    ks = []
    for _ in range(4):
        ctrl.observe(8.0, 2.0, divergence=0.5)
        ks.append(ctrl.k)
    assert ks == [k0 // 2, k0 // 4, k0 // 8, max(1, k0 // 16)]
    assert ctrl.trips == 4
    assert ctrl.metrics()["divergence_trips"] == 4 and ctrl.metrics()["k"] == ks[-1]
    ctrl.observe(8.0, 2.0, divergence=0.04)  # between half and full threshold: hold
    assert ctrl.k == ks[-1]
    for _ in range(30):  # calm again: the ceiling relaxes back to the overhead's choice
        ctrl.observe(8.0, 2.0, divergence=0.001)
    assert ctrl.k == pytest.approx(k0, abs=4)


def test_async_nan_divergence_trips_and_guard_can_be_off():
    ctrl = IntervalController(k=16)
    ctrl.observe(None, 1.0, divergence=math.nan)
    assert ctrl.k == 8
    off = IntervalController(k=16, divergence_threshold=None)
    off.observe(None, 1.0, divergence=10.0)
    assert off.k == 16


def test_async_state_roundtrips_through_json():
    rng = np.random.default_rng(15)
    a = IntervalController(k=5)
    simulate_async(a, 3.0, 1.0, 6, rng)
    a.observe(3.0, 1.0, divergence=0.2)
    b = IntervalController(k=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for d in [0.01, 0.3, 0.01, 0.01]:
        assert a.observe(3.0, 1.0, d) == b.observe(3.0, 1.0, d)


def test_async_config_errors():
    with pytest.raises(ConfigError, match="divergence_threshold"):
        IntervalController(divergence_threshold=-1.0)
    with pytest.raises(ConfigError, match="overhead_target"):
        IntervalController(overhead_target=1.5)


# ----------------------------------------------------------------------------- outer optimizers

def test_average_outer_is_the_consensus():
    o = make_outer("average")
    assert isinstance(o, OuterAverage) and not o.resets_inner
    w = np.array([1.0, 2.0])
    o.begin(w.copy())
    o.step(w)
    assert np.array_equal(w, [1.0, 2.0])


def test_diloco_matches_hand_computed_nesterov():
    o = DiLoCo(lr=0.7, momentum=0.9, warmup=0)
    assert not o.resets_inner
    o.begin(np.array([1.0, 2.0]))
    w = np.array([0.5, 2.5])
    o.step(w)
    # g = [0.5, -0.5]; v = g; update = g + 0.9 v = 1.9 g; W = prev - 0.7 * update
    np.testing.assert_allclose(w, [1.0 - 0.7 * 0.95, 2.0 + 0.7 * 0.95], rtol=1e-14)
    w2 = np.array([0.2, 2.7])
    o.step(w2)
    # g2 = [0.135, -0.035]; v2 = 0.9 g + g2 = [0.585, -0.485]; update = g2 + 0.9 v2
    np.testing.assert_allclose(w2, [0.335 - 0.7 * 0.6615, 2.665 + 0.7 * 0.4715], rtol=1e-13)


def test_diloco_matches_torch_sgd_nesterov_oracle():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(16)
    w0 = rng.normal(size=64)
    ours = DiLoCo(lr=0.7, momentum=0.9, warmup=0)
    ours.begin(w0.copy())
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        consensus = p.detach().numpy() + rng.normal(scale=0.1, size=64)
        p.grad = p.detach() - torch.tensor(consensus)  # pseudo-gradient W_prev - W
        opt.step()
        w = consensus.copy()
        ours.step(w)
        np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_diloco_without_momentum_and_unit_lr_is_plain_averaging():
    rng = np.random.default_rng(17)
    o = DiLoCo(lr=1.0, momentum=0.0, warmup=0)
    o.begin(rng.normal(size=10))
    for _ in range(3):
        c = rng.normal(size=10)
        w = c.copy()
        o.step(w)
        np.testing.assert_allclose(w, c, rtol=1e-12, atol=1e-12)


def test_diloco_plain_momentum_variant():
    o = DiLoCo(lr=0.5, momentum=0.9, nesterov=False, warmup=0)
    o.begin(np.array([1.0]))
    w = np.array([0.0])
    o.step(w)  # v = 1; W = 1 - 0.5
    assert w[0] == pytest.approx(0.5)
    w = np.array([0.25])
    o.step(w)  # g = 0.25; v = 0.9 + 0.25; W = 0.5 - 0.5 * 1.15
    assert w[0] == pytest.approx(0.5 - 0.575)


def test_slowmo_matches_hand_computed_values():
    o = SlowMo(lr=1.0, momentum=0.5)
    assert not o.resets_inner
    o.begin(np.array([1.0, 2.0]))
    w = np.array([0.5, 2.5])
    o.step(w, inner_lr=0.1)
    # u = g / 0.1 = [5, -5]; W = prev - 1.0 * 0.1 * u = the consensus on the first sync
    np.testing.assert_allclose(w, [0.5, 2.5], rtol=1e-14)
    w2 = np.array([0.2, 2.7])
    o.step(w2, inner_lr=0.1)
    # g2 = [0.3, -0.2]; u2 = 0.5 u + g2 / 0.1 = [5.5, -4.5]; W = W1 - 0.1 u2
    np.testing.assert_allclose(w2, [0.5 - 0.55, 2.5 + 0.45], rtol=1e-13)


def test_slowmo_zero_momentum_unit_lr_is_plain_averaging_in_float32():
    rng = np.random.default_rng(18)
    o = SlowMo(lr=1.0, momentum=0.0)
    o.begin(rng.normal(size=10).astype(np.float32))
    c = rng.normal(size=10).astype(np.float32)
    w = c.copy()
    o.step(w, inner_lr=0.05)
    assert w.dtype == np.float32
    np.testing.assert_allclose(w, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["diloco", "slowmo"])
def test_outer_state_roundtrip_and_order_errors(name):
    rng = np.random.default_rng(19)
    a = make_outer(name)
    with pytest.raises(RuntimeError, match="begin"):
        a.step(np.zeros(6))
    a.begin(rng.normal(size=6))
    a.step(rng.normal(size=6))
    b = make_outer(name)
    b.begin(np.zeros(6))
    b.load_state_dict(a.state_dict())
    c = rng.normal(size=6)
    wa, wb = c.copy(), c.copy()
    a.step(wa)
    b.step(wb)
    assert np.array_equal(wa, wb)
    with pytest.raises(ValueError, match="shape"):
        bad = make_outer(name)
        bad.begin(np.zeros(5))
        bad.load_state_dict(a.state_dict())


def test_diloco_defaults_and_reset_inner():
    # the paper's lr 0.7 and momentum 0.9; the warm-up of 18 syncs and the inner state kept
    # across syncs follow bench/bench_diloco.py's measurements
    o = make_outer("diloco")
    assert (o.lr, o.momentum, o.nesterov, o.warmup, o.resets_inner) == (0.7, 0.9, True, 18, False)
    assert make_outer("slowmo").warmup == 0
    assert make_outer("diloco", reset_inner=True).resets_inner
    assert make_outer("average", reset_inner=True).resets_inner
    assert not make_outer("slowmo").resets_inner
    with pytest.raises(ConfigError, match="policy.reset_inner must be true or false, got 1"):
        make_outer("diloco", reset_inner=1)
    # one outer step without the warm-up: g = 1, v = 1, W = 1 - 0.7 * (1 + 0.9)
    o = make_outer("diloco", warmup=0)
    o.begin(np.array([1.0]))
    w = np.array([0.0])
    o.step(w)
    assert w[0] == pytest.approx(1.0 - 0.7 * 1.9, rel=1e-14)


def test_outer_from_config_reads_the_policy_keys():
    from hpc_rlx.policies.outer import outer_from_config

    o = outer_from_config({"outer": "diloco", "outer_lr": 0.5, "outer_momentum": None,
                           "outer_warmup": 3, "reset_inner": True})
    assert (o.name, o.lr, o.momentum, o.warmup, o.resets_inner) == ("diloco", 0.5, 0.9, 3, True)


@pytest.mark.parametrize("name", ["diloco", "slowmo"])
def test_outer_warmup_averages_first_then_runs_from_a_fresh_momentum(name):
    # warm-up syncs leave the consensus as it is and start no momentum: after them the outer
    # optimizer equals one that begins at the last warm-up consensus
    rng = np.random.default_rng(20)
    w0 = rng.normal(size=8)
    warm = make_outer(name, warmup=2)
    warm.begin(w0.copy())
    consensus = [w0 + rng.normal(scale=0.1, size=8) for _ in range(5)]
    for c in consensus[:2]:
        w = c.copy()
        warm.step(w, inner_lr=0.1)
        assert np.array_equal(w, c)
    fresh = make_outer(name, warmup=0)
    fresh.begin(consensus[1].copy())
    for c in consensus[2:]:
        wa, wb = c.copy(), c.copy()
        warm.step(wa, inner_lr=0.1)
        fresh.step(wb, inner_lr=0.1)
        assert np.array_equal(wa, wb)
    assert not np.array_equal(wa, consensus[-1])       # the momentum acts after the warm-up
    # the count of syncs seen travels with the state: a resumed run does not warm up again
    again = make_outer(name, warmup=2)
    again.begin(np.zeros(8))
    again.load_state_dict(warm.state_dict())
    assert again.done == [5]
    with pytest.raises(ConfigError, match="policy.outer_warmup must be an integer >= 0, got -1"):
        make_outer(name, warmup=-1)


def test_make_outer_errors():
    with pytest.raises(ConfigError, match="easgd"):
        make_outer("easgd")
    with pytest.raises(ConfigError, match="no parameters"):
        make_outer("average", lr=0.5)
    with pytest.raises(ConfigError, match="outer_momentum"):
        make_outer("slowmo", momentum=1.5)
    assert make_outer("diloco", lr=0.3).lr == 0.3


# ----------------------------------------------------------------------------- slowdown

def test_parse_slowdown():
    assert parse_slowdown({1: 3.0}) == {1: 3.0}
    assert parse_slowdown({"1": "2.5", 0: 1}) == {1: 2.5, 0: 1.0}
    assert parse_slowdown(None) == {} and parse_slowdown({}) == {}
    with pytest.raises(ConfigError, match="rank 5"):
        parse_slowdown({5: 2.0}, world_size=2)
    with pytest.raises(ConfigError, match="0.5"):
        parse_slowdown({1: 0.5})
    with pytest.raises(ConfigError, match="'x'"):
        parse_slowdown({"x": 2.0})
    with pytest.raises(ConfigError, match="'fast'"):
        parse_slowdown({1: "fast"})
    with pytest.raises(ConfigError, match="mapping"):
        parse_slowdown("1:3")
    assert not slowdown_for_rank({1: 3.0}, 0).active
    assert slowdown_for_rank({1: 3.0}, 1).factor == 3.0


def test_slowdown_carries_sleep_overshoot_as_credit():
    now = [0.0]
    requests = []

    def sleep(s):  # an OS sleep that always overshoots by 0.3 ms
        requests.append(s)
        now[0] += s + 3e-4

    inj = SlowdownInjector(3.0, sleep=sleep, clock=lambda: now[0])
    for _ in range(100):
        inj.after_step(1e-3)
    assert inj.injected_s == pytest.approx(2.0 * 100 * 1e-3, abs=3e-4)
    assert max(requests) <= 2e-3 + 1e-12
    assert SlowdownInjector(1.0, sleep=sleep).after_step(1.0) == 0.0


def test_slowdown_is_honest_wall_time():
    inj = SlowdownInjector(3.0)
    compute = 0.0
    t0 = time.perf_counter()
    for _ in range(30):
        s = time.perf_counter()
        time.sleep(0.003)  # the "compute" of a step
        t = time.perf_counter() - s
        compute += t
        inj.after_step(t)
    wall = time.perf_counter() - t0
    assert wall / compute == pytest.approx(3.0, rel=0.1)


# ----------------------------------------------------------------------------- epoch windows

def test_plan_window_fits_or_trims_proportionally():
    assert plan_window([30, 10], [16, 16], 10_000) == [30, 10]
    assert plan_window([30, 10], [16, 16], 320) == [15, 5]
    assert plan_window([30, 10], [16, 16], 0) == [0, 0]
    assert plan_window([3, 1], [8, 8], 20) == [2, 0]  # the slow rank joins with weight 0
    assert plan_window([30, 10], [16, 16], 330) == [15, 5]  # 10 left: a short batch, or drop
    assert plan_window([2, 1], [1, 3], 2) == [2, 0]  # the leftover goes to who can use it


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 60), min_size=1, max_size=5),
       data=st.data())
def test_plan_window_invariants(counts, data):
    batches = data.draw(st.lists(st.integers(1, 32), min_size=len(counts), max_size=len(counts)))
    remaining = data.draw(st.integers(0, 4000))
    got = plan_window(counts, batches, remaining)
    used = sum(g * b for g, b in zip(got, batches))
    planned = sum(c * b for c, b in zip(counts, batches))
    assert used <= remaining
    assert all(0 <= g <= c for g, c in zip(got, counts))
    if planned <= remaining:
        assert got == counts
    else:
        # nothing that still fits was left out
        assert all(g == c or b > remaining - used for g, c, b in zip(got, counts, batches))


# ----------------------------------------------------------------------------- async, end to end

def run_async_quadratic(lr, syncs=12, world=2, dim=6):
    """Local SGD on per-rank quadratics 0.5*(W - c_r)' H_r (W - c_r), H_r diagonal, synced
    through the real bucket path.

    Divergence travels one sync late in the bucket, as in the training loop.
    """
    rng = np.random.default_rng(20)
    centers = [rng.normal(size=dim) + 3.0 for _ in range(world)]
    curv = [rng.uniform(0.5, 1.5, size=dim) for _ in range(world)]
    layout = SyncLayout(dim, world)
    ctrls = [IntervalController(k=8, max_anchor=64, overhead_target=0.1,
                                divergence_threshold=0.5) for _ in range(world)]
    params = [np.zeros(dim) for _ in range(world)]
    last_div = [0.0] * world
    ks = []
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(syncs):
            k = ctrls[0].k
            buckets = []
            for r in range(world):
                for _ in range(k):
                    params[r] -= lr * curv[r] * (params[r] - centers[r])
                b = np.zeros(layout.size)
                layout.pack(b, params[r], work_weight(k), r,
                            dict(steps=k, compute_ms=k * 1.0, sync_ms=2.0, divergence=last_div[r]))
                buckets.append(b)
            decided = []
            for r, b in enumerate(allreduce_sum(buckets)):
                last_div[r] = layout.divergence(params[r], b, own_weight=work_weight(k))
                layout.finish(b, params[r])
                rep = layout.read(b)
                decided.append(ctrls[r].observe(rep.comm_ms, rep.slowest_ms_per_step,
                                                rep.max_divergence))
            assert len(set(decided)) == 1  # every rank took the same decision
            ks.append(decided[0])
    return ks, ctrls[0]


def test_async_guard_shrinks_k_in_a_diverging_run_only():
    calm_ks, calm = run_async_quadratic(lr=0.1)
    assert calm.trips == 0
    assert calm_ks[-1] == math.ceil(2.0 / (0.1 * 1.0))  # the overhead rule alone: K = 20
    wild_ks, wild = run_async_quadratic(lr=2.5)  # |1 - lr*h| > 1: local steps blow up
    assert wild.trips >= 2
    assert wild_ks[-1] < calm_ks[-1] and min(wild_ks) == 1


# ----------------------------------------------------------------------------- policy config

def test_policy_config_defaults_and_normalisation():
    from hpc_rlx.policies import validate_policy_config

    assert validate_policy_config({"name": "sync"}) == {"name": "sync"}
    cad = validate_policy_config({"name": "cadence", "anchor": 4.0, "max_batch_diff": 2})
    assert cad["anchor"] == 4 and isinstance(cad["anchor"], int)
    assert cad["max_anchor"] == 200 and cad["overhead_target"] == 0.1 and cad["gamma"] == -1.0
    assert cad["outer"] == "average" and "divergence_threshold" not in cad
    asy = validate_policy_config({"name": "async", "divergence_threshold": None})
    assert asy["divergence_threshold"] is None and "max_batch_diff" not in asy


@pytest.mark.parametrize("cfg, words", [
    ({"name": "gossip"}, "policy='gossip' is not one of"),
    ({"name": "sync", "anchor": 3}, "policy=sync does not take ['anchor']"),
    ({"name": "cadence", "divergence_threshold": 0.1}, "does not take ['divergence_threshold']"),
    ({"name": "async", "max_batch_diff": 1}, "does not take ['max_batch_diff']"),
    ({"name": "cadence", "anchor": 2.5}, "policy.anchor must be an integer, got 2.5"),
    ({"name": "cadence", "anchor": 0}, "policy.anchor must be an integer >= 1, got 0"),
    ({"name": "cadence", "anchor": 50, "max_anchor": 20}, "(50) must be <= policy.max_anchor (20)"),
    ({"name": "cadence", "max_batch_diff": -1}, "policy.max_batch_diff must be an integer >= 0"),
    ({"name": "async", "overhead_target": 1.5}, "policy.overhead_target must be in (0, 1), got 1.5"),
    ({"name": "async", "overhead_target": "high"}, "policy.overhead_target must be a number"),
    ({"name": "async", "divergence_threshold": 0}, "policy.divergence_threshold must be > 0"),
    ({"name": "cadence", "gamma": float("nan")}, "policy.gamma must be a finite number, got nan"),
    ({"name": "cadence", "outer": "adam"}, "policy.outer must be one of"),
    ({"name": "cadence", "outer_lr": 0.5}, "policy.outer=average takes no parameters"),
    ({"name": "async", "outer": "diloco", "outer_momentum": 1.0}, "policy.outer_momentum must be in [0, 1)"),
    ({"name": "async", "outer": "slowmo", "outer_lr": True}, "policy.outer_lr must be a number, got True"),
    ({"name": "async", "outer": "diloco", "reset_inner": "yes"},
     "policy.reset_inner must be true or false, got 'yes'"),
    ({"name": "async", "outer_warmup": 3}, "policy.outer=average takes no parameters"),
    ({"name": "cadence", "fragments": 2}, "policy.fragments=2 policy.fragment_delay=0 needs every rank on the "
     "same steps per sync: use policy=async with policy.tune=false"),
    ({"name": "async", "fragments": 2}, "needs a fixed K: set policy.tune=false"),
    ({"name": "async", "tune": False, "anchor": 10, "fragments": 3},
     "policy.fragments must divide policy.anchor (K=10)"),
    ({"name": "async", "tune": False, "anchor": 10, "fragments": 2, "fragment_delay": 6},
     "policy.fragment_delay=6 is longer than the 5 steps between two fragment syncs"),
    ({"name": "async", "fragments": 0}, "policy.fragments must be an integer >= 1, got 0"),
    ({"name": "async", "fragment_delay": -1}, "policy.fragment_delay must be an integer >= 0, got -1"),
    ({"name": "async", "fragment_mix": 1.5}, "policy.fragment_mix must be a number in [0, 1] or null, got 1.5"),
    ({"name": "async", "outer_wire_dtype": "int2"}, "policy.outer_wire_dtype must be null, bfloat16, float16, "
     "int8, int4; got 'int2'"),
    ({"name": "async", "outer": "diloco", "outer_warmup": 1.5},
     "policy.outer_warmup must be an integer, got 1.5"),
])
def test_policy_config_errors_name_key_and_value(cfg, words):
    from hpc_rlx.policies import validate_policy_config

    with pytest.raises(ConfigError) as e:
        validate_policy_config(cfg)
    assert words in str(e.value)


def test_build_controller_matches_the_policy():
    from hpc_rlx.policies import build_controller, validate_policy_config

    cad = build_controller(validate_policy_config({"name": "cadence", "anchor": 3}), 4)
    assert isinstance(cad, ElcheScheduler) and cad.counts == [3, 3, 3, 3]
    asy = build_controller(validate_policy_config({"name": "async", "anchor": 500}), 4)
    assert isinstance(asy, IntervalController) and asy.k == 200   # capped at max_anchor


# ----------------------------------------------------------------------------- epoch log, filters

def _report(steps, compute_ms, sync_ms, divergence, weight=1.0, world=2):
    layout = SyncLayout(3, world)
    buckets = []
    for r in range(world):
        b = np.zeros(layout.size)
        layout.pack(b, np.ones(3), weight if steps[r] else 0.0, r,
                    {"steps": steps[r], "samples": 8 * steps[r], "compute_ms": compute_ms[r],
                     "sync_ms": sync_ms[r], "divergence": divergence[r]})
        buckets.append(b)
    return layout.read(allreduce_sum(buckets)[0])


def test_epoch_log_record():
    from hpc_rlx.policies import EpochLog

    log = EpochLog(2)
    log.add(_report([30, 10], [30.0, 31.0], [0.0, 0.0], [0.0, 0.0]), k=10)   # no cost known yet
    log.add(_report([27, 9], [28.0, 27.0], [5.0, 3.0], [0.02, 0.04]), k=9)
    log.add(_report([0, 0], [0.0, 0.0], [4.0, 2.0], [0.01, float("nan")]), k=9, nonfinite_ranks=1)
    rec = log.record(9, [27, 9], anchor=9)
    assert rec["syncs"] == 3 and rec["local_steps"] == [57, 19]
    assert rec["steps_per_sync"] == [19.0, 6.333] and rec["k_trace"] == [10, 9, 9]
    assert rec["window_steps"] == [27, 9] and rec["K"] == 9 and rec["anchor"] == 9
    # cost: the smallest rank's sync time (3 ms) over the slowest compute (28 ms); the idle
    # sync has no window to compare with
    assert rec["comm_share"] == pytest.approx(3.0 / 28.0, abs=1e-5)
    assert rec["divergence"] == "inf"            # a NaN divergence reads as infinite
    assert rec["idle_syncs"] == 1 and rec["nonfinite_windows"] == 1
    json.dumps(rec)
    again = EpochLog.from_state(json.loads(json.dumps(log.state_dict())), 2)
    assert again.record(9, [27, 9]) == log.record(9, [27, 9])
    other = EpochLog.from_state(log.state_dict(), 3)
    assert other.local_steps == [0, 0, 0] and other.syncs == 3


def test_the_epoch_log_records_the_fragment_each_streaming_sync_carried():
    from hpc_rlx.policies import EpochLog

    whole = EpochLog(2)
    whole.add(_report([4, 4], [4.0, 4.0], [0.0, 0.0], [0.0, 0.0]), k=4)
    assert "fragment_trace" not in whole.record(4, [4, 4])      # whole syncs: as before
    log = EpochLog(2)
    for j in (2, 1, 0, 2):
        log.add(_report([2, 2], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]), k=6, fragment=j)
    assert log.record(6, [2, 2])["fragment_trace"] == [2, 1, 0, 2]
    again = EpochLog.from_state(json.loads(json.dumps(log.state_dict())), 2)
    assert again.record(6, [2, 2]) == log.record(6, [2, 2])
    older = {k: v for k, v in log.state_dict().items() if k != "fragment_trace"}   # a checkpoint from before
    assert "fragment_trace" not in EpochLog.from_state(older, 2).record(6, [2, 2])


def test_fragment_schedules_give_each_fragment_once_per_cycle(monkeypatch):
    from hpc_rlx.policies import fragment_schedule, validate_policy_config
    from hpc_rlx.policies.fragments import fragment_bounds

    bounds = fragment_bounds(10, 3)
    assert fragment_schedule.cycle_order("round_robin", bounds) == (0, 1, 2)
    cfg = validate_policy_config({"name": "async", "tune": False, "anchor": 6, "fragments": 3})
    assert cfg["fragment_schedule"] == "round_robin"
    with pytest.raises(ConfigError, match=r"policy.fragment_schedule must be one of \('round_robin',\), "
                                          r"got 'largest_first'"):
        validate_policy_config({"name": "async", "fragment_schedule": "largest_first"})
    monkeypatch.setitem(fragment_schedule.SCHEDULES, "twice", lambda sizes: [0] * len(sizes))
    with pytest.raises(ConfigError, match=r"policy.fragment_schedule=twice gave \[0, 0, 0\] for 3 fragments"):
        fragment_schedule.cycle_order("twice", bounds)


def test_recent_min_ignores_one_off_spikes():
    from hpc_rlx.policies import RecentMin

    f = RecentMin(3)
    assert f.value is None and f.add(None) is None
    assert f.add(2.0) == 2.0
    assert f.add(50.0) == 2.0            # a preempted sync
    assert f.add(float("nan")) == 2.0    # ignored
    assert f.add(3.0) == 2.0
    assert f.add(3.1) == 3.0             # 2.0 left the window: the real level shows
    with pytest.raises(ValueError):
        RecentMin(0)


def test_slowdown_owed_per_step_is_slept_once_per_window():
    now = [0.0]
    requests = []

    def sleep(s):
        requests.append(s)
        now[0] += s + 2e-4

    inj = SlowdownInjector(3.0, sleep=sleep, clock=lambda: now[0])
    for _ in range(10):
        for _ in range(5):
            inj.owe(1e-3)
        inj.flush()
    assert len(requests) == 10                          # one sleep per window
    assert requests[0] == pytest.approx(10e-3)
    assert inj.injected_s == pytest.approx(2.0 * 50 * 1e-3, abs=3e-4)   # overshoot repaid
    # a sleep stretched far beyond the debt is not repaid over many later windows
    inj2 = SlowdownInjector(2.0, sleep=lambda s: now.__setitem__(0, now[0] + s + 1.0),
                            clock=lambda: now[0])
    inj2.owe(1e-3)
    inj2.flush()
    inj2.owe(1e-3)
    assert inj2.flush() == pytest.approx(0.5e-3 + 1.0)  # credit capped: still slowed next window
    assert SlowdownInjector(1.0).flush() == 0.0


def test_stretch_to_epoch_avoids_a_short_last_window():
    from hpc_rlx.policies import stretch_to_epoch

    assert stretch_to_epoch(22, 89, 200) == 23          # 23, 23, 23, 20: 4 syncs, not 5
    assert stretch_to_epoch(22, 66, 200) == 22
    assert stretch_to_epoch(10, 7, 200) == 10           # the epoch's last window: plan_window trims
    assert stretch_to_epoch(32, 44, 200) == 44          # one window of 44 instead of 32 + 12
    assert stretch_to_epoch(32, 44, 40) == 40           # never past the cap ...
    assert stretch_to_epoch(50, 89, 40) == 40           # ... which also bounds K itself
    for k in range(1, 30):
        for left in range(0, 200):
            w = stretch_to_epoch(k, left, 64)
            assert min(k, 64) <= w <= 64
            if left > k and 2 * k <= 64:
                # the windows of at least k: no more syncs than whole k-step windows fit
                assert -(-left // w) <= max(1, left // k)
    with pytest.raises(ValueError):
        stretch_to_epoch(0, 10, 5)


def test_an_untuned_interval_stays_at_the_anchor_whatever_it_measures():
    tuned, fixed = IntervalController(k=25, max_anchor=25), IntervalController(k=25, max_anchor=25, tune=False)
    for comm_ms, step_ms, divergence in [(1.0, 10.0, 0.0), (50.0, 1.0, 0.2), (0.1, 5.0, float("nan"))]:
        tuned.observe(comm_ms, step_ms, divergence)
        assert fixed.observe(comm_ms, step_ms, divergence) == 25
    assert tuned.k != 25                        # the same measurements move a tuned K
    assert fixed.metrics()["divergence_trips"] == 0 and fixed.comm_ms is not None
