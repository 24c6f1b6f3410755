"""Frozen parameters (`graph/frozen.py`, model.freeze / model.train_only): which parameters the
globs select (and the one error when they select nothing, or everything), the third kind of
parameter in the IR and the flat layout (after the buffers, outside the gradient vector), and
the backward pass, which plans no VJP for a frozen argument (a weight's gradient product) while
the gradients of everything else, inputs of the frozen layer included, are bitwise unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import ConfigError, GraphError
from hpc_rlx.graph import Executor, Graph, GraphBuilder, ParamLayout, build_model, init_params
from hpc_rlx.graph.frozen import freeze_params, frozen_by, frozen_user_names

MLP = dict(input_shape=(6,), num_classes=3, hidden=[8, 8])


def _mlp() -> Graph:
    return build_model("mlp", **MLP)      # fc0, fc1, head: .weight and .bias each


def test_globs_select_by_name_and_train_only_freezes_the_rest():
    g = _mlp()
    assert frozen_by(g, ["fc0.*"]) == ["fc0.weight", "fc0.bias"]
    assert frozen_by(g, ["*bias", "fc1.weight"]) == ["fc0.bias", "fc1.weight", "fc1.bias", "head.bias"]
    assert frozen_by(g, train_only=["head.*"]) == ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"]
    assert freeze_params(g) is g                          # unset: the very graph (and fingerprint)
    frozen = freeze_params(g, ["fc1.*"])
    assert [p.name for p in frozen.params if p.frozen] == ["fc1.weight", "fc1.bias"]
    assert frozen.num_params == g.num_params - 8 * 8 - 8
    # train_only may name a parameter the graph itself marks frozen: it trains then
    assert frozen_by(frozen, train_only=["fc1.*"]) == ["fc0.weight", "fc0.bias", "head.weight", "head.bias"]


@pytest.mark.parametrize("freeze, train_only, match", [
    (["fc0.*"], ["head.*"], r"model.freeze=\['fc0.\*'\] and model.train_only=\['head.\*'\] are both set: set one"),
    (["fc0.wieght"], [], r"model.freeze: 'fc0.wieght' matches no trainable parameter; the closest names: "
                         r"'fc0.weight', .* \(6 in all\)"),
    ([], ["haed.*"], r"model.train_only: 'haed.\*' matches no trainable parameter; the closest names: 'head.bias'"),
    (["*"], [], r"model.freeze=\['\*'\] freezes every trainable parameter \(fc0.weight, fc0.bias, fc1.weight, "
                r"fc1.bias, head.weight, head.bias\), which leaves nothing to train"),
    ("fc0.*", [], r"model.freeze must be a list of parameter-name globs"),
])
def test_a_bad_setting_is_one_error_naming_names(freeze, train_only, match):
    with pytest.raises(ConfigError, match=match):
        freeze_params(_mlp(), freeze, train_only)


def _batch_norm_net(frozen_norm: bool = False) -> Graph:
    """linear -> batch norm -> relu -> linear, float64-friendly; the norm's scale and bias
    optionally frozen (its running statistics are buffers)."""
    b = GraphBuilder("bn")
    x, y = b.input("x", [None, 4]), b.input("y", [None], "int64")
    w0 = b.param("fc0.weight", [4, 5], {"scheme": "normal", "std": 0.5})
    scale = b.param("bn.weight", [5], {"scheme": "normal", "std": 0.3, "mean": 1.0})
    shift = b.param("bn.bias", [5], {"scheme": "normal", "std": 0.3})
    mean = b.param("bn.running_mean", [5], {"scheme": "zeros"}, trainable=False)
    var = b.param("bn.running_var", [5], {"scheme": "ones"}, trainable=False)
    w1 = b.param("head.weight", [5, 3], {"scheme": "normal", "std": 0.5})
    h = b.op("relu", b.op("batch_norm", b.op("linear", x, w0), scale, shift, mean, var))
    b.output("loss", b.op("softmax_cross_entropy", b.op("linear", h, w1), y))
    g = b.build()
    return freeze_params(g, ["bn.weight", "bn.bias"]) if frozen_norm else g


def test_a_buffer_is_never_selected_and_the_layout_puts_frozen_parameters_last():
    g = _batch_norm_net()
    with pytest.raises(ConfigError, match=r"'bn.running_\*' matches no trainable parameter"):
        frozen_by(g, ["bn.running_*"])
    f = freeze_params(g, ["bn.*"])          # the norm's scale and bias; its statistics stay buffers
    lay = ParamLayout(f)
    assert lay.names == ["fc0.weight", "head.weight", "bn.running_mean", "bn.running_var", "bn.weight", "bn.bias"]
    assert lay.trainable_names == ["fc0.weight", "head.weight"] and lay.frozen_names == ["bn.weight", "bn.bias"]
    assert (lay.trainable_size, lay.grad_size, lay.size) == (35, 45, 55)
    assert set(lay.grad_views(np.zeros(45))) == set(lay.names) - {"bn.weight", "bn.bias"}
    with pytest.raises(ValueError, match="holds 44 elements, the layout needs 45"):
        lay.grad_views(np.zeros(44))
    assert frozen_user_names(f.to_dict()) == ["bn.weight", "bn.bias"] and frozen_user_names(g.to_dict()) == []


def test_json_marks_frozen_parameters_only_when_there_are_some():
    g = _mlp()
    assert all("frozen" not in p for p in g.to_dict()["params"])
    f = freeze_params(g, ["fc1.weight"])
    assert [p.get("frozen") for p in f.to_dict()["params"]] == [None, None, True, None, None, None]
    assert Graph.from_json(f.to_json()) == f and f.fingerprint() != g.fingerprint()
    bad = f.to_dict()
    bad["params"][0]["frozen"] = "yes"
    with pytest.raises(GraphError, match=r"parameter 'fc0.weight': frozen must be true or false, got 'yes'"):
        Graph.from_dict(bad)
    d = _batch_norm_net().to_dict()
    next(p for p in d["params"] if p["name"] == "bn.running_mean")["frozen"] = True
    with pytest.raises(GraphError, match=r"'bn.running_mean': a buffer \(trainable: false\) cannot be frozen"):
        Graph.from_dict(d)


def _grads(g: Graph, frozen: Graph, params: np.ndarray, feeds: dict):
    """One training pass of each graph on the same parameters: (outputs, grad views) of both;
    the frozen graph's gradient vector holds no place for its frozen parameters."""
    lay, lay_f = ParamLayout(g), ParamLayout(frozen)
    views = lay.views(params)
    flat_f = np.zeros(lay_f.size)
    lay_f.pack(views, flat_f)
    grad, grad_f = np.zeros(lay.size), np.zeros(lay_f.grad_size)
    out = Executor(g, np, "float64").forward_backward(views, lay.views(grad), feeds, seed=3)
    ex_f = Executor(frozen, np, "float64")
    out_f = ex_f.forward_backward(lay_f.views(flat_f), lay_f.grad_views(grad_f), feeds, seed=3)
    return ex_f, out, out_f, lay.views(grad), lay_f.grad_views(grad_f)


def _vjp_args(ex: Executor, name: str) -> int:
    """How many VJPs the backward plan runs for the parameter ``name``'s argument positions."""
    return sum(1 for bs in ex.backward_plan for _, _, pname, _ in bs.grads if pname == name)


@pytest.mark.parametrize("model, freeze", [
    ("mlp", ["fc1.weight"]),                 # a linear layer in the middle: its weight's product skipped
    ("cnn", ["conv1.weight", "conv1.bias"]),  # a convolution in the middle
    ("mlp", ["fc0.*"]),                      # the first layer: nothing of it runs backward at all
])
def test_backward_skips_frozen_weight_gradients_and_leaves_every_other_gradient_bitwise(model, freeze):
    rng = np.random.default_rng(0)
    if model == "mlp":
        g = _mlp()
        feeds = {"x": rng.standard_normal((5, 6)), "y": rng.integers(0, 3, 5)}
    else:
        g = build_model("cnn", input_shape=(1, 6, 6), num_classes=3, channels=[2, 3], hidden=4)
        feeds = {"x": rng.standard_normal((4, 1, 6, 6)), "y": rng.integers(0, 3, 4)}
    frozen = freeze_params(g, freeze)
    params = init_params(g, np.zeros(ParamLayout(g).size), 0)
    ex_f, out, out_f, grads, grads_f = _grads(g, frozen, params, feeds)
    assert out == out_f
    names = [p.name for p in frozen.params if p.frozen]
    assert set(grads_f) == set(grads) - set(names)
    for name in grads_f:            # the layers below a frozen one still get their gradients
        assert np.array_equal(grads[name], grads_f[name]), name
    ex = Executor(g, np, "float64")
    for name in names:
        assert _vjp_args(ex, name) == 1 and _vjp_args(ex_f, name) == 0, name
    planned = sum(len(bs.grads) for bs in ex.backward_plan) - sum(len(bs.grads) for bs in ex_f.backward_plan)
    if freeze == ["fc0.*"]:
        # nothing below fc1 depends on a trained parameter: fc0 and its activation run no
        # backward step (the weight's and bias's VJPs, the activation's), nor does fc1's input VJP
        assert len(ex.backward_plan) - len(ex_f.backward_plan) == 2 and planned == 4, planned
    else:                           # exactly the frozen arguments' VJPs
        assert planned == len(names), planned


def test_batch_norm_statistics_still_update_when_its_scale_and_bias_are_frozen():
    """As PyTorch with requires_grad=False: the running statistics' slots of the gradient vector
    get the batch's statistics, the same as without freezing."""
    g, f = _batch_norm_net(), _batch_norm_net(frozen_norm=True)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((6, 4)), "y": rng.integers(0, 3, 6)}
    params = init_params(g, np.zeros(ParamLayout(g).size), 0)
    _, _, _, grads, grads_f = _grads(g, f, params, feeds)
    for name in ("bn.running_mean", "bn.running_var", "fc0.weight", "head.weight"):
        assert np.array_equal(grads[name], grads_f[name]), name
    assert np.abs(grads_f["bn.running_mean"]).max() > 0 and "bn.weight" not in grads_f


def _two_layer_onnx(path) -> None:
    """x (batch, 3) -> MatMul w1 + b1 -> Relu -> MatMul w2 -> logits (batch, 2), by hand."""
    onnx = pytest.importorskip("onnx")
    h, nh = onnx.helper, onnx.numpy_helper
    inits = [nh.from_array(np.full((3, 4), 0.1, np.float32), "w1"), nh.from_array(np.zeros(4, np.float32), "b1"),
             nh.from_array(np.full((4, 2), 0.2, np.float32), "w2")]
    nodes = [h.make_node("MatMul", ["x", "w1"], ["h0"]), h.make_node("Add", ["h0", "b1"], ["h1"]),
             h.make_node("Relu", ["h1"], ["h2"]), h.make_node("MatMul", ["h2", "w2"], ["logits"])]
    graph = h.make_graph(nodes, "two", [h.make_tensor_value_info("x", 1, ["batch", 3])],
                         [h.make_tensor_value_info("logits", 1, ["batch", 2])], initializer=inits)
    path.write_bytes(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]).SerializeToString())


def test_export_check_lists_what_trains_and_what_the_globs_freeze(tmp_path, capsys):
    from hpc_rlx.export.command import main
    model = tmp_path / "two.onnx"
    _two_layer_onnx(model)
    assert main(["--check", str(model), "--freeze", "w1", "b1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "8 trainable parameters in 1 tensors" in out[1], out
    assert out[-2:] == ["trains: w2 (8)", "frozen: w1 (12), b1 (4)"], out
    assert main(["--check", str(model), "--train-only", "b*"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["trains: b1 (4)", "frozen: w1 (12), w2 (8)"]
    assert main(["--check", str(model), "--freeze", "w3"]) == 2
    assert "model.freeze: 'w3' matches no trainable parameter; the closest names: 'w2', 'w1'" in capsys.readouterr().err
    assert main([str(tmp_path), "--onnx", str(tmp_path / "o.onnx"), "--freeze", "w1"]) == 2
    assert "--freeze, --train-only, --inputs and --lora-* go with --check" in capsys.readouterr().err
