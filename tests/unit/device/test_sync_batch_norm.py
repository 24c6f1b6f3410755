"""model.sync_batch_norm without MPI: batch norm's statistics summed over the parts of a batch
(lanes on threads) equal those of the whole batch, in the forward, the VJP and the running
statistics; a lane without rows and gradient accumulation's micro-batches take part in step."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpc_rlx.runtime.batch_sync import BatchStatSum, results_of
from hpc_rlx.runtime.lanes import LaneSet, micro_batches
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout


def _bn_params(b, name, c, mean=0.0):
    return (b.param(f"{name}.weight", [c], {"scheme": "normal", "std": 0.3}),
            b.param(f"{name}.bias", [c], {"scheme": "normal", "std": 0.3}),
            b.param(f"{name}.running_mean", [c], {"scheme": "zeros"}, trainable=False),
            b.param(f"{name}.running_var", [c], {"scheme": "ones"}, trainable=False))


def _graph():
    """Batch norm on the input (no x-gradient: no backward sum), conv, batch norm, a head."""
    b = GraphBuilder("bn")
    x, y = b.input("x", [None, 2, 4, 4]), b.input("y", [None], "int64")
    h = b.op("batch_norm", x, *_bn_params(b, "bn0", 2), momentum=0.1)
    w = b.param("conv.weight", [3, 2, 3, 3], {"scheme": "normal", "std": 0.4})
    h = b.op("conv2d", h, w, padding=1)
    h = b.op("relu", b.op("batch_norm", h, *_bn_params(b, "bn1", 3), momentum=0.2))
    fc = b.param("fc.weight", [48, 5], {"scheme": "normal", "std": 0.2})
    logits = b.op("linear", b.op("flatten", h), fc)
    b.output("loss", b.op("softmax_cross_entropy", logits, y))
    return b.build()


def _setup(rows=9, seed=0):
    g = _graph()
    layout = ParamLayout(g)
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(layout.size) * 0.5
    rv = layout.views(params)
    for name in ("bn0", "bn1"):      # running statistics not at 0 and 1: the shift matters
        rv[f"{name}.running_var"][...] = 1.0 + rng.random(rv[f"{name}.running_var"].shape)
    x = rng.standard_normal((rows, 2, 4, 4)) * 1.5 + 0.7
    return g, layout, params, x, rng.integers(0, 5, rows)


def _whole(g, layout, params, x, y):
    """The gradient (and statistics) of the sum of the losses, one batch, no sync."""
    grad = np.empty_like(params)
    out = Executor(g, np, "float64").forward_backward(layout.views(params), layout.views(grad), {"x": x, "y": y},
                                                      train=True, seed=0, grad_scale=float(x.shape[0]))
    return grad, out["loss"] * x.shape[0]


def test_global_statistics_from_parts_equal_the_whole_batch():
    g, layout, params, x, y = _setup()
    ref, ref_loss = _whole(g, layout, params, x, y)
    bounds = [(0, 5), (5, 8), (8, 9)]
    summer = BatchStatSum(len(bounds))
    grads = [np.empty_like(params) for _ in bounds]
    losses = [0.0] * len(bounds)

    def part(i):
        lo, hi = bounds[i]
        ex = Executor(g, np, "float64")
        out = ex.forward_backward(layout.views(params), layout.views(grads[i]), {"x": x[lo:hi], "y": y[lo:hi]},
                                  train=True, seed=0, grad_scale=float(hi - lo), sync=summer.hook(i, np))
        losses[i] = out["loss"] * (hi - lo)

    threads = [threading.Thread(target=part, args=(i,)) for i in range(len(bounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # per part: forward of bn0 and bn1; backward of bn1 only (bn0's input needs no gradient)
    assert summer.calls == 3
    np.testing.assert_allclose(sum(grads), ref, rtol=1e-12, atol=1e-12)
    assert sum(losses) == pytest.approx(ref_loss, rel=1e-12)
    # the buffers' slots: every part emitted the global statistic (unbiased variance, global count)
    n = layout.trainable_size
    for gp, (lo, hi) in zip(grads, bounds):
        np.testing.assert_allclose(gp[n:] / (hi - lo), ref[n:] / x.shape[0], rtol=1e-12)


def test_without_sync_the_parts_differ_from_the_whole_batch():
    """The same split without the hook: each part's own statistics (the per-lane default)."""
    g, layout, params, x, y = _setup()
    ref, _ = _whole(g, layout, params, x, y)
    parts = [_whole(g, layout, params, x[lo:hi], y[lo:hi])[0] for lo, hi in [(0, 5), (5, 9)]]
    assert np.abs(sum(parts) - ref).max() > 1e-3


def _micro_batch_reference(g, layout, params, x, y, counts, k):
    """The gradient when micro-batch j of every lane is normalised together."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    groups = [[] for _ in range(k)]
    for i, c in enumerate(counts):
        for j, (lo, hi) in enumerate(micro_batches(c, k) if c else []):
            groups[j].extend(range(bounds[i] + lo, bounds[i] + hi))
    total = np.zeros_like(params)
    for rows in groups:
        if rows:
            total += _whole(g, layout, params, x[rows], y[rows])[0]
    return total


@pytest.mark.parametrize("rows,lanes,k", [(9, 1, 1), (9, 3, 1), (2, 3, 1), (5, 2, 2), (3, 2, 3)])
def test_lanes_with_sync_equal_their_micro_batches_normalised_together(rows, lanes, k):
    """(2, 3, 1): a lane without rows; (5, 2, 2): micro-batches of unequal sizes; (3, 2, 3): a
    micro-batch without rows on a lane, and one without rows anywhere."""
    g, layout, params, x, y = _setup(rows)
    payload = np.zeros(layout.size)
    ls = LaneSet(g, [("cpu", i) for i in range(lanes)], "float64", params, payload, layout,
                 accumulate=k, sync_comm=True)
    try:
        n, _, _, _ = ls.step(x, y, seed=0)
        counts = list(ls.last_counts)
        n_calls = ls.batch_sync.calls
    finally:
        ls.close()
    assert n == rows
    assert n_calls == 3 * k          # every micro-batch index, whoever has rows in it
    ref = _micro_batch_reference(g, layout, params, x, y, counts, k)
    np.testing.assert_allclose(payload, ref, rtol=1e-11, atol=1e-12)


def test_a_failing_lane_releases_the_others_with_its_own_error():
    summer = BatchStatSum(2)
    hooks = [summer.hook(i, np) for i in range(2)]

    def waits():
        return hooks[0](np.ones(3))

    def fails():
        hooks[1].abort()
        raise ValueError("lane 1 broke")

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="lane 1 broke"):
            results_of([pool.submit(waits), pool.submit(fails)])
    summer.start_step()                     # whole again for the next step
    assert not summer._barrier.broken


def test_float32_statistics_stay_exact_far_from_the_running_mean():
    """A one-pass sum of squares about the running mean (0 at the start) would lose the
    variance of inputs centred at 300 in float32; the parts' own centred sums keep it."""
    from hpc_rlx.graph.ops.norm import global_moments
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((24, 4, 8, 8)) + 300.0).astype(np.float32)
    parts, summer, out = [x[:15], x[15:]], BatchStatSum(2), [None, None]

    def part(i):
        out[i] = global_moments(np, parts[i], np.zeros(4, np.float32), summer.hook(i, np))

    threads = [threading.Thread(target=part, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    ref = x.astype(np.float64)
    mean, var, count, xc = out[1]
    assert count == 24 * 64
    np.testing.assert_allclose(var, ref.var(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(mean, ref.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(xc, ref[15:] - ref.mean(axis=(0, 2, 3))[None, :, None, None], atol=1e-4)
