"""Gradient accumulation (`train.accumulate`): a lane's share of a step runs as K micro-batches
summed into the same bucket, so the step's gradient, loss and count are those of one big batch."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.runtime.lanes import LaneSet, micro_batch_seed, micro_batches
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params


def _model():
    g = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[16], activation="tanh")
    layout = ParamLayout(g)
    params = np.empty(layout.size, np.float64)
    init_params(g, params, 0)
    rng = np.random.default_rng(0)
    return g, layout, params, rng.standard_normal((25, 1, 8, 8)), rng.integers(0, 10, 25)


def _one_big_batch(g, layout, params, x, y):
    grad = np.empty_like(params)
    out = Executor(g, np, "float64").forward_backward(layout.views(params), layout.views(grad), {"x": x, "y": y},
                                                      train=True, seed=0, grad_scale=float(x.shape[0]))
    return grad, out["loss"] * x.shape[0]


@pytest.mark.parametrize("n,k,expect", [
    (10, 1, [(0, 10)]), (10, 3, [(0, 4), (4, 7), (7, 10)]), (3, 5, [(0, 1), (1, 2), (2, 3)]), (7, 7, [(j, j + 1) for j in range(7)]),
])
def test_micro_batches_cover_the_rows_once_and_none_is_empty(n, k, expect):
    assert micro_batches(n, k) == expect


def test_the_first_micro_batch_keeps_the_lane_seed_and_the_others_differ():
    seeds = [micro_batch_seed(12345, j) for j in range(4)]
    assert seeds[0] == 12345 and len(set(seeds)) == 4


@pytest.mark.parametrize("lanes_spec", [[("cpu", 0)], [("cpu", 0), ("cpu", 1)]])
@pytest.mark.parametrize("k", [1, 2, 4, 30])
def test_k_micro_batches_equal_one_big_batch(lanes_spec, k):
    g, layout, params, x, y = _model()
    ref, ref_loss = _one_big_batch(g, layout, params, x, y)
    payload = np.zeros(layout.size)
    lanes = LaneSet(g, lanes_spec, "float64", params, payload, layout, accumulate=k)
    n, loss_sum, _, _ = lanes.step(x, y, seed=0)
    lanes.close()
    assert n == 25
    np.testing.assert_allclose(payload, ref, rtol=1e-12, atol=1e-13)
    assert loss_sum == pytest.approx(ref_loss, rel=1e-12)


def test_overlap_hears_of_each_gradient_once_when_the_last_micro_batch_finished_it():
    g, layout, params, x, y = _model()
    ref, _ = _one_big_batch(g, layout, params, x, y)
    bucket = FusedBucket(layout.size, ("samples",), np.float64)
    lanes = LaneSet(g, [("cpu", 0)], "float64", params, bucket, layout, accumulate=3)
    assert lanes.overlap_capable
    heard = []

    def ready(name):
        lo = layout.offsets[name]
        hi = lo + int(np.prod(layout.shapes[name]))
        # by now the slot holds the sum over all three micro-batches
        np.testing.assert_allclose(bucket.payload[lo:hi], ref[lo:hi], rtol=1e-12, atol=1e-13)
        heard.append(name)

    lanes.step(x, y, seed=0, on_grad_ready=ready)
    lanes.close()
    assert sorted(heard) == sorted(layout.offsets)
