"""Pipeline stages (graph/partition.py) and the executor's stage forward/backward: the stages run
one after another, then backward in reverse passing the boundary gradients, give the whole
graph's loss and every parameter gradient (float64); micro-batches accumulate to the whole
batch; the split's errors."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import ConfigError, GraphError
from hpc_rlx.graph import Executor, GraphBuilder, ParamLayout, build_model, init_params
from hpc_rlx.graph.partition import StageGraph, partition

R = np.random.default_rng(5)
MLP = dict(input_shape=(20,), num_classes=5, hidden=[16, 16, 16])
CNN = dict(input_shape=(1, 8, 8), num_classes=4, channels=[4, 6], hidden=10)
LM = dict(vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=2, d_ff=16)


def feeds_for(kind, b):
    if kind == "mlp":
        return {"x": R.standard_normal((b, 20)), "y": R.integers(0, 5, b)}
    if kind == "cnn":
        return {"x": R.standard_normal((b, 1, 8, 8)), "y": R.integers(0, 4, b)}
    return {"x": R.integers(0, 11, (b, 6)), "y": R.integers(0, 11, (b, 6))}


def whole(g, feeds, grad_scale=1.0):
    layout = ParamLayout(g)
    params, grads = np.empty(layout.size), np.empty(layout.size)
    init_params(g, params, seed=1)
    out = Executor(g, np, "float64").forward_backward(layout.views(params), layout.views(grads), feeds,
                                                       seed=0, grad_scale=grad_scale)
    return layout.views(params), layout.views(grads), out


def pipelined(stages, pviews, micro_feeds):
    """Forward every micro-batch through every stage, then backward in reverse; gradients of
    each stage accumulate over the micro-batches with grad_scale = the micro-batch's size."""
    exs = [Executor(st, np, "float64") for st in stages]
    layouts = [ParamLayout(st) for st in stages]
    grads = [np.zeros(lay.size) for lay in layouts]
    losses = []
    for feeds in micro_feeds:
        n = len(next(iter(feeds.values())))
        runs, vals = [], {}
        for st, ex in zip(stages, exs):
            f = {name: feeds[name] for name in st.feeds}
            f.update({name: vals[name] for name in st.boundary_inputs})
            runs.append(ex.stage_forward({p.name: pviews[p.name] for p in st.params}, f, seed=0))
            vals.update(runs[-1].boundary)
        losses.append((n, runs[-1].outputs["loss"]))
        bgrads = {}
        for k in reversed(range(len(stages))):
            bgrads = exs[k].stage_backward(runs[k], layouts[k].views(grads[k]), bgrads, grad_scale=float(n))
            assert set(bgrads) == set(stages[k].boundary_inputs)
    views = {}
    for lay, g in zip(layouts, grads):
        views.update(lay.views(g))
    return losses, views


def assert_same(kind, g, stages, batch=6, micro=(6,)):
    feeds = feeds_for(kind, batch)
    pv, gv, out = whole(g, feeds, grad_scale=float(batch))
    assert [s.index for s in stages] == list(range(len(stages)))
    assert sorted(p.name for s in stages for p in s.params) == sorted(p.name for p in g.params)
    micro_feeds, lo = [], 0
    for m in micro:
        micro_feeds.append({k: v[lo:lo + m] for k, v in feeds.items()})
        lo += m
    losses, sv = pipelined(stages, pv, micro_feeds)
    loss = sum(n * v for n, v in losses) / batch
    assert abs(loss - out["loss"]) <= 1e-12 * abs(out["loss"])
    scale = max(float(np.max(np.abs(gv[p.name]))) for p in g.params)
    for p in g.params:  # relative to the largest gradient: some (attention's key bias) are zero up to rounding
        err = float(np.max(np.abs(sv[p.name] - gv[p.name])))
        assert err <= 1e-12 * max(float(np.max(np.abs(gv[p.name]))), 1e-6 * scale), p.name


@pytest.mark.parametrize("kind,args", [("mlp", MLP), ("cnn", CNN), ("transformer_lm", LM)])
@pytest.mark.parametrize("S", [2, 3, 4])
def test_balanced_stages_equal_the_whole_graph(kind, args, S):
    g = build_model(kind, **args)
    stages = partition(g, S)
    assert len(stages) == S and all(isinstance(s, StageGraph) for s in stages)
    assert all(s.nodes for s in stages)
    assert "loss" in stages[-1].outputs and not any(s.outputs for s in stages[:-1])
    assert stages[-1].boundary_outputs == () and stages[0].boundary_inputs == ()
    assert_same(kind, g, stages)


@pytest.mark.parametrize("kind,args,cuts", [
    ("mlp", MLP, ["fc0", "act1"]),
    ("cnn", CNN, ["act0", "flatten"]),
    # inside the first block: the residual stream (embed) is carried past the attention branch
    ("transformer_lm", LM, ["block0.attn.q", "block0.attn.scores", "block1.attn_residual"]),
])
def test_cut_points_equal_the_whole_graph(kind, args, cuts):
    g = build_model(kind, **args)
    stages = partition(g, cut_points=cuts)
    assert len(stages) == len(cuts) + 1
    assert [s.nodes[-1].name for s in stages[:-1]] == cuts
    assert_same(kind, g, stages)


def test_a_value_read_two_stages_later_passes_through_the_middle_stage():
    g = build_model("transformer_lm", **LM)
    stages = partition(g, cut_points=["block0.ln1", "block0.attn.q"])
    assert "embed" in stages[1].boundary_inputs and "embed" in stages[1].boundary_outputs
    assert "embed" not in {n.name for n in stages[1].nodes}
    assert_same("transformer_lm", g, stages)


@pytest.mark.parametrize("micro", [(2, 2, 2), (3, 2, 1), (5, 1)])
def test_micro_batches_of_unequal_size_accumulate_to_the_whole_batch(micro):
    g = build_model("transformer_lm", **LM)
    assert_same("transformer_lm", g, partition(g, 3), batch=6, micro=micro)


def test_balanced_split_weighs_parameters_and_cost():
    g = build_model("mlp", input_shape=(20,), num_classes=5, hidden=[16, 16, 16])
    stages = partition(g, 2)
    sizes = [sum(int(np.prod(p.shape)) for p in s.params) for s in stages]
    assert max(sizes) == 608  # fc0 + fc1 | fc2 + logits (336 + 272 | 272 + 85)
    heavy = partition(g, 2, cost={"fc2": 10_000})
    assert {"fc0", "fc1"} <= {n.name for n in heavy[0].nodes} and "fc2" in {n.name for n in heavy[1].nodes}


def test_stage_graph_round_trips_through_json():
    g = build_model("cnn", **CNN)
    for st in partition(g, 3):
        again = StageGraph.from_json(st.to_json())
        assert again == st and again.boundary_outputs == st.boundary_outputs


def test_one_stage_is_the_whole_graph():
    g = build_model("mlp", **MLP)
    (st,) = partition(g, 1)
    assert [n.name for n in st.nodes] == [g.nodes[i].name for i in g.order]
    assert st.boundary_inputs == () and st.boundary_outputs == ()


@pytest.mark.parametrize("cuts,message", [
    (["nope"], "cut point 'nope' is not a node of the graph"),
    (["x"], "cut point 'x' is not a node of the graph"),
    (["fc0", "fc0"], "leave stage 2 of 3 empty"),
    (["correct"], "leave stage 2 of 2 empty"),
    (["xent"], "leaves output node 'xent' outside the last stage"),
])
def test_bad_cut_points(cuts, message):
    g = build_model("mlp", **MLP)
    with pytest.raises(ConfigError, match=message):
        partition(g, cut_points=cuts)


def test_too_many_stages_and_mismatched_counts():
    g = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[])
    with pytest.raises(ConfigError, match="5 stages need at least 5 nodes"):
        partition(g, 5)
    with pytest.raises(ConfigError, match="1 cut point\\(s\\) make 2 stages, but 3"):
        partition(g, 3, cut_points=["logits"])
    with pytest.raises(ConfigError, match="integer >= 1"):
        partition(g, 0)


def test_tied_weights_cannot_be_split():
    g = build_model("transformer_lm", **LM, tie_embeddings=True)
    # the embedding's readers span the graph up to the head: only the head and the loss can go
    assert [n.name for n in partition(g, 2)[1].nodes] == ["xent", "correct"]
    with pytest.raises(ConfigError, match="cannot be split into 4 stages"):
        partition(g, 4)
    with pytest.raises(ConfigError, match="separates the readers of parameter 'tok_emb'"):
        partition(g, cut_points=["block0.mlp_residual"])


def test_a_dead_node_is_no_cut_point():
    b = GraphBuilder("dead")
    x = b.input("x", [None, 3])
    y = b.input("y", [None], "int64")
    w = b.param("w", [3, 2], {"scheme": "normal", "std": 1.0})
    b.op("relu", x, name="unused")
    logits = b.op("linear", x, w, name="logits")
    b.output("loss", b.op("softmax_cross_entropy", logits, y, name="xent"))
    g = b.build()
    with pytest.raises(ConfigError, match="'unused' is a node no output depends on"):
        partition(g, cut_points=["unused"])


def test_stage_backward_checks_the_gradients_it_is_given():
    g = build_model("mlp", **MLP)
    first = partition(g, 2)[0]
    layout = ParamLayout(first)
    params, grads = np.empty(layout.size), np.zeros(layout.size)
    init_params(first, params, seed=0)
    ex = Executor(first, np, "float64")
    run = ex.stage_forward(layout.views(params), {"x": R.standard_normal((3, 20))})
    with pytest.raises(GraphError, match="the gradient of 'fc1' must be float64 \\(3, 16\\), got nothing"):
        ex.stage_backward(run, layout.views(grads), {})
    ex.stage_backward(run, layout.views(grads), {"fc1": np.ones((3, 16))})
    with pytest.raises(GraphError, match="this graph has no loss"):
        ex.forward_backward(layout.views(params), layout.views(grads), {"x": R.standard_normal((3, 20))})
    with pytest.raises(GraphError, match="already ran"):
        ex.stage_backward(run, layout.views(grads), {"fc1": np.ones((3, 16))})


def test_each_stage_initialises_its_parameters_as_the_whole_graph_does():
    from hpc_rlx.graph.partition import load_graph
    g = build_model("transformer_lm", **LM)
    layout = ParamLayout(g)
    whole = layout.views(init_params(g, np.empty(layout.size), seed=4))
    for st in partition(g, 3):
        again = load_graph(st.to_dict())
        assert isinstance(again, StageGraph) and again.predictions_per_sample == 6
        assert again.result_names == ("loss", "correct")
        lay = ParamLayout(again)
        mine = lay.views(init_params(again, np.empty(lay.size), seed=4))
        for p in again.params:
            np.testing.assert_array_equal(mine[p.name], whole[p.name])
    assert not isinstance(load_graph(g.to_dict()), StageGraph)


def test_rank_zero_sizes_a_pipelined_run_by_its_largest_stage():
    from hpc_rlx.config.spec import check_pipeline
    g = build_model("mlp", input_shape=(64,), num_classes=10, hidden=[64, 64, 64, 64])
    cfg = {"parallel": {"pipeline_stages": 2, "cut_points": None, "balance": "params"},
           "policy": {"name": "sync"},
           "device": {"kind": "cpu", "cpu_lanes": 1},
           "checkpoint": {"every_steps": None, "every_epochs": None, "every_minutes": None}}
    replicas, held = check_pipeline(cfg, g, 4)
    assert replicas == 2 and isinstance(held, StageGraph)
    sizes = [ParamLayout(st).size for st in partition(g, 2)]
    assert ParamLayout(held).size == max(sizes) < ParamLayout(g).size
    cfg["parallel"]["pipeline_stages"] = 1
    assert check_pipeline(cfg, g, 4) == (4, g)
