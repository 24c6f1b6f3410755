"""The split without cut points: balanced by parameter count and each node's measured forward +
backward time (``graph/node_timing.py``, rank 0 in ``config/spec.py``). The cost arithmetic
alone, the timing of real graphs, and a 2-rank pipelined job whose log names the measured
split and which ends where one rank ends (float64)."""

from __future__ import annotations

import re

import pytest

from hpc_rlx.graph.models import cnn, mlp, transformer_lm
from hpc_rlx.graph.node_timing import node_times, time_cost
from hpc_rlx.graph.partition import partition
from hpc_rlx.graph.shapes import known_prod

from tests.support.jobs import explain, train_job
from tests.mpi.pipeline.test_run import BASE, assert_same_training


def _cuts(stages) -> list:
    return [s.nodes[-1].name for s in stages[:-1]]


def _params(graph) -> int:
    return sum(known_prod(p.shape) for p in graph.params)


def test_time_moves_the_cut_a_parameter_split_would_put_elsewhere():
    # fc0 (32x256) is big and cheap, fc1 and the head small; here fc1 is the slow one
    g = mlp((32,), 10, hidden=(256, 16))
    by_params = partition(g, 2)
    assert _cuts(by_params) == ["fc0"]
    times = {n.name: 1e-6 for n in g.nodes}
    times["fc1"] = 5e-3
    cost = time_cost(times, g)
    assert abs(sum(cost.values()) - _params(g)) <= 1e-9 * _params(g)   # time weighs as much as params
    by_time = partition(g, 2, cost=cost)
    assert _cuts(by_time) != _cuts(by_params)

    def heaviest(stages):
        return max(sum(known_prod(p.shape) for p in s.params) + sum(cost.get(n.name, 0.0) for n in s.nodes)
                   for s in stages)
    assert heaviest(by_time) < heaviest(by_params)
    # equal times change nothing: the parameter split stands
    flat = time_cost({n.name: 1.0 for n in g.nodes}, g)
    assert _cuts(partition(g, 2, cost=flat)) in (["fc0"], ["act0"])


def test_time_cost_of_no_time_is_no_cost():
    g = mlp((4,), 3, hidden=(5,))
    assert time_cost({n.name: 0.0 for n in g.nodes}, g) == {}


@pytest.mark.parametrize("graph", [
    mlp((16,), 4, hidden=(8, 8)),
    cnn((1, 8, 8), 10, channels=(4, 6), hidden=12),
    transformer_lm(11, 8, d_model=16, n_heads=2, n_layers=2, d_ff=32),
], ids=["mlp", "cnn", "lm"])
def test_every_node_is_timed_and_the_cost_splits(graph):
    times = node_times(graph, 4, "float64", reps=2)
    names = {n.name for n in graph.nodes}
    assert set(times) <= names and len(times) >= len(names) - 1
    assert all(t >= 0 for t in times.values()) and sum(times.values()) > 0
    stages = partition(graph, 2, cost=time_cost(times, graph))   # the names are nodes partition knows
    assert len(stages) == 2


@pytest.mark.mpi
def test_two_stages_split_by_measured_time_train_like_one_rank(tmp_path, digits_h5):
    ref, run = tmp_path / "ref", tmp_path / "pipe"
    proc = train_job(1, ref, BASE + [f"data.path={digits_h5}"])
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, run, BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2"])
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout + proc.stderr
    m = re.findall(r"pipeline split by parameters and measured time: parallel\.cut_points=\['(\w+)'\] "
                   r"\(per stage: [\d.]+ ms, [\d,]+ params; [\d.]+ ms, [\d,]+ params\)", out)
    assert len(m) == 1, explain(proc)          # rank 0 measured, once
    assert_same_training(ref, run)


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [["parallel.cut_points=[fc0]"], ["parallel.balance=params"]],
                         ids=["cut_points", "params"])
def test_nothing_is_measured_with_cut_points_or_balance_params(tmp_path, digits_h5, extra):
    proc = train_job(2, tmp_path / "run", BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2",
                                                  "train.epochs=1", "train.max_steps=3"] + extra)
    assert proc.returncode == 0, explain(proc)
    assert "measured time" not in proc.stdout + proc.stderr, explain(proc)
