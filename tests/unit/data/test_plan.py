"""Shard planning: the global batch at every step is the same whatever the world size."""

import numpy as np
import pytest

from hpc_rlx.data.plan import EVAL_BATCH_CAP, EpochOrder, eval_batch_rows, plan_shards
from hpc_rlx.base.errors import ConfigError


def global_batches(n, batch, world, leftover, epoch=0, seed=7, shuffle=True):
    plan = plan_shards(n, batch, world, leftover)
    steps = []
    orders = [EpochOrder(plan, r, epoch, seed, shuffle) for r in range(world)]
    for s in range(plan.steps_per_epoch):
        ids = []
        for r in range(world):
            start = plan.shard_bounds(r)[0]
            ids.extend((orders[r].step_indices(s) + start).tolist())
        steps.append(sorted(ids))
    return plan, steps


@pytest.mark.parametrize("leftover", ["drop", "partial"])
@pytest.mark.parametrize("n,batch", [(100, 10), (103, 8), (57, 6), (1797, 64)])
def test_global_batches_do_not_depend_on_world_size(n, batch, leftover):
    _, ref = global_batches(n, batch, 1, leftover)
    for world in (2, 3, 4):
        if world > batch:
            continue
        _, got = global_batches(n, batch, world, leftover)
        assert got == ref, f"world={world} changes the batches"


def test_partial_uses_every_sample_once_and_drop_drops_the_remainder():
    plan, steps = global_batches(103, 8, 4, "partial")
    used = sorted(i for s in steps for i in s)
    assert used == list(range(103))
    assert plan.steps_per_epoch == 13 and plan.dropped == 0
    plan, steps = global_batches(103, 8, 4, "drop")
    used = [i for s in steps for i in s]
    assert len(used) == len(set(used)) == 96 and plan.dropped == 7
    assert all(len(s) == 8 for s in steps)


def test_drop_leaves_out_a_different_random_set_each_epoch():
    left_out = []
    for epoch in range(4):
        _, steps = global_batches(103, 8, 2, "drop", epoch=epoch)
        used = {i for s in steps for i in s}
        assert len(used) == 96
        left_out.append(frozenset(range(103)) - used)
    assert len(set(left_out)) == 4, left_out          # not the same samples every epoch
    assert frozenset().union(*left_out) != left_out[0]


def test_shards_are_contiguous_and_cover_the_rows():
    plan = plan_shards(1000, 30, 4, "partial")
    bounds = plan.all_bounds()
    assert bounds[0][0] == 0 and bounds[-1][1] == 1000
    for (a0, a1), (b0, b1) in zip(bounds, bounds[1:]):
        assert a1 == b0
    assert sum(plan.rank_batch(r) for r in range(4)) == 30


def test_epochs_shuffle_differently_and_reproducibly():
    _, e0 = global_batches(200, 10, 2, "drop", epoch=0)
    _, e1 = global_batches(200, 10, 2, "drop", epoch=1)
    _, e0b = global_batches(200, 10, 2, "drop", epoch=0)
    assert e0 == e0b
    assert e0 != e1
    _, plain = global_batches(200, 10, 2, "drop", shuffle=False)
    assert plain[0] == [j * 20 for j in range(10)]


@pytest.mark.parametrize("n,batch,world,fragment", [
    (100, 0, 2, "must be positive"),
    (100, -4, 2, "must be positive"),
    (100, 101, 2, "larger than the training set"),
    (3, 2, 4, "more ranks (4) than training samples (3)"),
    (100, 3, 4, "smaller than the number of ranks"),
])
def test_impossible_plans_raise_clear_errors(n, batch, world, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        plan_shards(n, batch, world)
    assert fragment in str(err.value)


@pytest.mark.parametrize("batch,world,splits,configured,rows", [
    (64, 1, 1, None, 64),        # one rank: its whole training batch
    (24, 4, 1, None, 6),         # a rank's share of the global batch
    (10, 4, 1, None, 3),         # uneven shares (3,3,2,2): the largest
    (24, 2, 4, None, 3),         # train.accumulate=4: a micro-batch's rows
    (25, 2, 4, None, 4),         # 13 rows in 4 micro-batches: 4,3,3,3
    (8192, 2, 1, None, 1024),    # never more than EVAL_BATCH_CAP by default
    (64, 2, 1, 5000, 5000),      # train.eval_batch_size wins, above the cap too
    (64, 2, 8, 7, 7),
])
def test_evaluation_batch_is_the_largest_training_micro_batch_unless_set(batch, world, splits, configured, rows):
    assert eval_batch_rows(batch, world, splits, configured) == rows
    if configured is None:
        assert rows <= EVAL_BATCH_CAP
