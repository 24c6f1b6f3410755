"""Pipeline schedules (pipeline/schedule.py): GPipe and 1F1B on the time grid with unit forward
and backward times -- idle slots counted exactly, the bubble fraction (S-1)/(M+S-1) for both,
live activations (1F1B at most S per stage, GPipe M), every micro-batch once each way."""

from __future__ import annotations

from fractions import Fraction

import pytest

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.pipeline.schedule import Action, build, gpipe, one_f_one_b, simulate

GRID = [(S, M) for S in (1, 2, 3, 4, 6) for M in (1, 2, 3, 4, 8, 13)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", GRID)
def test_bubble_fraction_is_the_theory(name, S, M):
    t = simulate(build(name, S, M))
    assert t.makespan == 2 * (M + S - 1)
    assert t.busy == [2 * M] * S
    assert t.idle == [2 * (S - 1)] * S          # counted slot by slot: makespan - busy
    for s in range(S):
        assert Fraction(t.idle[s], t.makespan) == Fraction(S - 1, M + S - 1)
        assert t.bubble(s) == pytest.approx((S - 1) / (M + S - 1), abs=1e-15)


@pytest.mark.parametrize("S,M", GRID)
def test_live_activations(S, M):
    assert simulate(gpipe(S, M)).peak_alive == [M] * S
    peak = simulate(one_f_one_b(S, M)).peak_alive
    assert peak == [min(S - s, M) for s in range(S)]
    assert max(peak) <= S


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,M", [(1, 1), (3, 5), (4, 8)])
def test_every_micro_batch_once_each_way_and_forward_first(name, S, M):
    for acts in build(name, S, M):
        assert sorted(acts) == sorted([Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)])
        for m in range(M):
            assert acts.index(Action("F", m)) < acts.index(Action("B", m))


def test_one_f_one_b_order_on_four_stages():
    plans = one_f_one_b(4, 6)
    assert [repr(a) for a in plans[0]] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert [repr(a) for a in plans[3]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_unequal_times_and_a_deadlock_are_seen():
    t = simulate(one_f_one_b(2, 4), forward=1, backward=2)
    assert t.makespan == (4 + 2 - 1) * (1 + 2) and t.idle == [3, 3]    # (M + S - 1)(f + b)
    bad = [[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]]
    with pytest.raises(ValueError, match="before F0|deadlocks"):
        simulate(bad)
    crossed = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
               [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(crossed)


def test_bad_names_and_counts():
    with pytest.raises(ConfigError, match="parallel.schedule='zigzag'"):
        build("zigzag", 2, 2)
    with pytest.raises(ConfigError, match="micro-batches must be an integer >= 1, got 0"):
        build("1f1b", 2, 0)
