"""Buffers: non-trainable parameters (batch norm's running statistics) in the graph IR.

They are packed after the trainable parameters, never differentiated, and a training forward's
emitted statistic lands in the buffer's slot of the gradient vector scaled like the gradients,
so the runtime's sample-weighted sum gives the mean statistic over lanes and ranks."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor, Graph, GraphBuilder, ParamLayout, build_model, register_op, unregister_op
from hpc_rlx.graph.registry import defvjp


@pytest.fixture
def shift_op():
    """`shift(x, centre)`: x - centre; in training it emits the batch mean for `centre`."""
    def forward(xp, args, attrs, ctx):
        x, centre = args
        if ctx.train:
            ctx.emit(1, x.mean(axis=0))
        return x - centre, None

    register_op("test_shift", forward, infer=lambda types, attrs: types[0], arity=(2, 2),
                attrs={"momentum": 0.1})
    defvjp("test_shift", lambda xp, g, args, ans, s, a, out: g, None, needs_args=())
    yield "test_shift"
    unregister_op("test_shift")


def _graph(op: str, extra_buffer: bool = False) -> Graph:
    b = GraphBuilder("buffers")
    x, y = b.input("x", [None, 3]), b.input("y", [None], "int64")
    centre = b.param("centre", [3], {"scheme": "zeros"}, trainable=False)
    if extra_buffer:
        b.param("idle", [2], {"scheme": "ones"}, trainable=False)
    w = b.param("w", [3, 4], {"scheme": "normal", "std": 0.5})
    h = b.op(op, x, centre, momentum=0.25)
    logits = b.op("linear", h, w)
    b.output("loss", b.op("softmax_cross_entropy", logits, y))
    return b.build()


def test_layout_packs_trainable_parameters_first(shift_op):
    g = _graph(shift_op, extra_buffer=True)
    layout = ParamLayout(g)
    assert layout.names == ["w", "centre", "idle"]
    assert layout.buffer_names == ["centre", "idle"]
    assert layout.trainable_size == 12 and layout.size == 17
    assert g.num_params == 12                       # buffers are state, not parameters
    assert g.buffer_momentum() == {"centre": 0.25, "idle": 0.0}


def test_json_round_trip_keeps_buffers_and_old_graphs_unchanged(shift_op):
    g = _graph(shift_op)
    again = Graph.from_json(g.to_json())
    assert again == g and [p.trainable for p in again.params] == [False, True]
    # a graph without buffers has no "trainable" key: its JSON and fingerprint are as before
    mlp = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[5])
    assert all("trainable" not in p for p in mlp.to_dict()["params"])
    assert ParamLayout(mlp).trainable_size == ParamLayout(mlp).size


def test_trainable_must_be_a_bool(shift_op):
    d = _graph(shift_op).to_dict()
    d["params"][0]["trainable"] = "no"
    with pytest.raises(GraphError, match="trainable must be true or false"):
        Graph.from_dict(d)


def test_emitted_statistic_is_written_scaled_into_the_buffer_slot(shift_op):
    g = _graph(shift_op, extra_buffer=True)
    layout = ParamLayout(g)
    rng = np.random.default_rng(0)
    params = rng.standard_normal(layout.size)
    grads = np.full(layout.size, np.nan)
    x, y = rng.standard_normal((5, 3)), rng.integers(0, 4, 5)
    ex = Executor(g, np, "float64")
    ex.forward_backward(layout.views(params), layout.views(grads), {"x": x, "y": y}, grad_scale=5.0)
    views, gviews = layout.views(params), layout.views(grads)
    np.testing.assert_allclose(gviews["centre"], 5.0 * x.mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(gviews["idle"], 5.0 * views["idle"], rtol=1e-14)   # nobody emitted
    assert np.isfinite(gviews["w"]).all()


def test_buffers_get_no_gradient_and_evaluation_emits_nothing(shift_op):
    g = _graph(shift_op)
    layout = ParamLayout(g)
    params = np.random.default_rng(1).standard_normal(layout.size)
    x, y = np.ones((2, 3)), np.zeros(2, np.int64)
    ex = Executor(g, np, "float64")
    before = params.copy()
    out = ex.evaluate(layout.views(params), {"x": x, "y": y})
    assert np.array_equal(params, before) and np.isfinite(out["loss"])
    # the fetched value uses the buffer as it is
    got = ex.run(layout.views(params), {"x": x}, fetch=[g.nodes[0].name])
    np.testing.assert_allclose(got[g.nodes[0].name], x - layout.views(params)["centre"])


def test_run_fetches_nodes_without_the_labels():
    g = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[5])
    layout = ParamLayout(g)
    params = np.random.default_rng(2).standard_normal(layout.size)
    ex = Executor(g, np, "float64")
    logits = g.node(g.outputs["loss"]).inputs[0]
    x = np.random.default_rng(3).standard_normal((7, 4))
    out = ex.run(layout.views(params), {"x": x}, fetch=[logits])
    assert out[logits].shape == (7, 3)
    with pytest.raises(GraphError, match="not a node"):
        ex.run(layout.views(params), {"x": x}, fetch=["x"])
