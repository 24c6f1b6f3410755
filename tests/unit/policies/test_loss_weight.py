"""A weighted loss's bucket arithmetic (policies/loss_weight.py): the gradient divided by the
summed label weight, the buffers' row-weighted statistics by the samples."""

from __future__ import annotations

import numpy as np

from hpc_rlx.policies.loss_weight import local_mean, mean_scale


def test_the_gradient_takes_the_weight_and_the_buffers_the_samples():
    payload = np.array([4.0, 8.0, 30.0, 60.0])       # 2 gradients, then 2 buffers' statistics
    scale = mean_scale(payload, 2, weight=2.0, samples=6.0)
    assert scale == 0.5
    np.testing.assert_allclose(payload * scale, [2.0, 4.0, 5.0, 10.0], rtol=1e-15)


def test_a_batch_without_a_labelled_position_takes_no_gradient_step():
    payload = np.array([4.0, 8.0, 30.0])
    scale = mean_scale(payload, 2, weight=0.0, samples=3.0)
    np.testing.assert_allclose(payload * scale, [0.0, 0.0, 10.0])


def test_a_local_step_reports_its_own_means_weighted_by_samples():
    payload = np.array([4.0])
    scale, loss, correct = local_mean(payload, 1, (2.0, 5), samples=4, loss_sum=3.0, correct=4.0, per_sample=3)
    assert scale == 0.5 and loss / 4 == 1.5 and abs(correct / (4 * 3) - 4.0 / 5) < 1e-15
