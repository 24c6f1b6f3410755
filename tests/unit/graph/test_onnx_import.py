"""ONNX import: the zoo of tests/support/onnx_zoo.py exported by both PyTorch exporters in both modes
imports to a graph whose forward matches ONNX Runtime and PyTorch, and whose loss gradients
match PyTorch autograd on the original module; plus the import's errors and special forms.

Relative errors are max|ours - reference| / max|reference|: <= 1e-5 in float32, <= 1e-10 in
float64 (a float32 file imported, then run in float64 with the same weights against
module.double()).
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.onnx_checks import (  # noqa: E402
    BATCH,
    TOL,
    check_gradients,
    feed,
    ort_batch_stats,
    ours_forward,
    param_views,
    rel,
    torch_module,
    trains_like_module_train,
)
from tests.support.shared import run_dir  # noqa: E402

F = torch.nn.functional
# A model without mode-dependent layers exports one dynamo file for both modes
# (onnx_zoo.exports_by_mode) and trains and evaluates alike: its eval case would check a subset
# of its train case on the same file, so only models whose modes differ have one.
CASES = [(m, e, mode) for m in zoo.ZOO for e in ("dynamo", "torchscript") for mode in ("train", "eval")
         if not (e == "dynamo" and mode == "eval" and not zoo.exports_by_mode(zoo.make(m)))]
# The default suite: every model with the quick TorchScript exporter, and the dynamo exporter on
# the models whose import needs the most (batch-norm metadata, folded transposes, attention).
FAST = {c for c in CASES if c[1] == "torchscript"} | {("mobilenet", "dynamo", "train"), ("vit", "dynamo", "eval"),
                                                       ("gpt", "dynamo", "train"), ("last_token", "dynamo", "train"),
                                                       ("relative", "dynamo", "train")}


def _cases(dtypes=(None,)):
    out = []
    for c in CASES:
        for dt in dtypes:
            slow = c not in FAST or dt == "float64" and c[0] not in ("resnet", "gpt")
            out.append(pytest.param(*c, *([dt] if dt else []), marks=[pytest.mark.slow] if slow else [],
                                    id="-".join(c + ((dt,) if dt else ()))))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(module, path, ImportedModel) per case, exported once. Batch norm stays apart from the
    convolutions only without the exporters' graph optimisations (dynamo's optimize, TorchScript's
    constant folding in eval mode): a fused batch norm has no PyTorch parameters to compare
    gradients with one by one (see test_fused_batch_norm_trains_as_a_fixed_scale_and_shift), and
    GroupNorm's affine keeps its PyTorch parameters only without dynamo's optimizer."""
    cache, files = {}, run_dir(tmp_path_factory, "onnx-zoo")

    def get(name, exporter, mode):
        key = (name, exporter, mode)
        if key not in cache:
            module = zoo.make(name)
            optimize = not (zoo.has_batch_norm(module) or zoo.has_group_norm(module))
            module, path = zoo.export_zoo_model(name, files, exporter, mode, optimize)
            cache[key] = (module, path, import_onnx(path))
        return cache[key]

    return get


@pytest.mark.parametrize("name, exporter, mode", _cases())
def test_forward_matches_onnxruntime_and_pytorch(exported, name, exporter, mode):
    module, path, imported = exported(name, exporter, mode)
    x = zoo.sample_input(name, BATCH, seed=2)
    ours_eval = ours_forward(imported, x, train=False)
    ours_train = ours_forward(imported, x, train=True)
    ref_ort = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    # ONNX Runtime runs the file as written. A TorchScript training-form file marks batch norm
    # training_mode=1: ORT normalises with the batch statistics, as our training forward does.
    # The dynamo exporter writes a training batch norm as an inference node: ORT uses the
    # running statistics, as our evaluation forward does. ORT's Dropout leaves the values as
    # they are, which is our forward with dropout off.
    assert rel(ours_train if ort_batch_stats(path) else ours_eval, ref_ort) <= TOL["float32"]
    with torch.no_grad():
        assert rel(ours_eval, torch_module(module, False)(x).numpy()) <= TOL["float32"]
        if trains_like_module_train(imported, mode):
            assert rel(ours_train, torch_module(module, True)(x).numpy()) <= TOL["float32"]


@pytest.mark.parametrize("name, exporter, mode, dtype", _cases(("float32", "float64")))
def test_gradients_match_pytorch(exported, name, exporter, mode, dtype):
    module, path, imported = exported(name, exporter, mode)
    check_gradients(module, imported, name, trains_like_module_train(imported, mode), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lstm_text", "gru_text", "unet_transposed", "unet_interpolate"])
def test_dynamo_files_without_the_optimizer_match_for_recurrent_models_and_unets(tmp_path_factory, name):
    """The cases above export these models with dynamo's optimizer (they have no batch norm);
    with optimize=False (the file the export round trip and the README's advice use) the
    forward equals ONNX Runtime and PyTorch and the gradients PyTorch's in float32 and float64."""
    module, path = zoo.export_zoo_model(name, run_dir(tmp_path_factory, "onnx-zoo"), "dynamo", "train",
                                        optimize=False)
    imported = import_onnx(path)
    x = zoo.sample_input(name, BATCH, seed=2)
    ours = ours_forward(imported, x, train=False)
    assert rel(ours, ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]) <= TOL["float32"]
    with torch.no_grad():
        assert rel(ours, torch_module(module, False)(x).numpy()) <= TOL["float32"]
    for dtype in ("float32", "float64"):
        check_gradients(module, imported, name, True, dtype)


# ---------------------------------------------------------------- special forms and metadata


@pytest.mark.parametrize("name", ["mobilenet", "gpt"])
def test_opset_13_files_import(tmp_path, name):
    """Opset 13: layer norm decomposed into primitives, training batch norm marked by its
    statistics outputs (training_mode came in opset 14)."""
    module = zoo.make(name)
    path = zoo.export(module, zoo.sample_input(name, 3, seed=1), tmp_path / "m.onnx", "torchscript", "train", opset=13)
    imported = import_onnx(path)
    assert imported.graph.meta["onnx"]["opset"] == 13 and imported.graph.meta["onnx"]["form"] == "training"
    xb = zoo.sample_input(name, BATCH, seed=2)
    ref = ort.InferenceSession(str(path)).run(None, {"x": xb.numpy()})[0]
    assert rel(ours_forward(imported, xb, train=True), ref) <= TOL["float32"]
    with torch.no_grad():
        assert rel(ours_forward(imported, xb, train=True), torch_module(module, True)(xb).numpy()) <= TOL["float32"]
    check_gradients(module, imported, name, True, "float64")


def test_dynamo_folded_transposes_keep_the_pytorch_names_and_layouts(exported):
    module, path, imported = exported("gpt", "dynamo", "train")
    meta, g = imported.graph.meta["onnx"], imported.graph
    assert meta["exporter"] == "dynamo"
    shapes = {p.name: p.shape for p in g.params}
    for name, p in module.named_parameters():
        if name.endswith(("qkv.weight", "fc1.weight", "fc2.weight", "proj.weight")):
            assert meta["params"][name].startswith("val_") and name in meta["transposed"]
            assert shapes[name] == tuple(p.shape) and meta["torch_names"][name] == name
    # the tied head: the optimizer stored tok.weight.t() as its own initializer
    assert list(meta["tied"].values()) == ["tok.weight"]
    assert sum(1 for p in g.params if p.shape == (32, 32) and p.name.startswith("tok")) == 1


def test_torchscript_folded_weights_are_traced_to_their_modules(exported):
    module, path, imported = exported("gpt", "torchscript", "eval")
    meta = imported.graph.meta["onnx"]
    assert meta["params"]["blocks.0.qkv.weight"].startswith("onnx::MatMul_")
    assert "blocks.0.qkv.weight" in meta["transposed"]
    assert list(meta["tied"].values()) == ["tok.weight"]  # x @ tok.weight.t(), found by value
    assert all(p.name.replace("_", "").replace(".", "").replace("-", "").isalnum() for p in imported.graph.params)


def test_an_inference_export_trains_frozen_with_one_warning(exported):
    module, path, imported = exported("mobilenet", "torchscript", "eval")
    g = imported.graph
    assert g.meta["onnx"]["form"] == "inference"
    assert [n.attrs["training"] for n in g.nodes if n.op == "batch_norm"] == [False] * 3
    assert not any(n.op == "dropout" for n in g.nodes)
    (warning,) = imported.warnings
    assert "running statistics" in warning and "dropout" in warning and "bn1" in warning
    stats = {f"{m}.running_{s}" for m in ("stem.1", "bn1", "bn2") for s in ("mean", "var")}
    assert {p.name for p in g.buffers} == stats


def test_training_batch_norm_from_dynamo_metadata(exported):
    module, path, imported = exported("mobilenet", "dynamo", "train")
    bns = [n for n in imported.graph.nodes if n.op == "batch_norm"]
    assert [(n.attrs["training"], n.attrs["momentum"], n.attrs["eps"]) for n in bns] == [(True, 0.1, 1e-5)] * 3
    assert [n.attrs["p"] for n in imported.graph.nodes if n.op == "dropout"] == [0.1]
    assert imported.graph.buffer_momentum() == {b.name: 0.1 for b in imported.graph.buffers}


def test_initializers_merged_by_the_dynamo_optimizer_are_untied_by_module(tmp_path):
    """Freshly initialised layer norms have equal weights (ones) and biases (zeros): optimize=True
    keeps one of each; the import gives layer 3 its own again, under its PyTorch names."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                                 torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    imported = import_onnx(zoo.export(module, torch.randn(3, 4), tmp_path / "m.onnx", "dynamo", "train"))
    (warning,) = [w for w in imported.warnings if "merged" in w]
    assert "['3.bias', '3.weight']" in warning and "train separately again" in warning, warning
    names = set(imported.graph.meta["onnx"]["torch_names"].values())
    assert {"1.weight", "1.bias", "3.weight", "3.bias"} <= names, names
    layer_norms = [n for n in imported.graph.nodes if n.op == "layer_norm"]
    assert len(layer_norms) == 2 and layer_norms[0].inputs[1:] != layer_norms[1].inputs[1:]


def _conv_bn_pairs(module):
    mods = dict(module.named_modules())
    names = list(mods)
    return [(mods[a], mods[b]) for a, b in zip(names, names[1:])
            if isinstance(mods[a], torch.nn.Conv2d) and isinstance(mods[b], torch.nn.BatchNorm2d)]


def _close(value, fused) -> bool:
    return value.shape == fused.shape and np.allclose(value, fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exporter, mode", [("dynamo", "train"), ("dynamo", "eval"), ("torchscript", "eval")])
def test_fused_batch_norm_trains_as_a_fixed_scale_and_shift(tmp_path, exporter, mode):
    """The exporters' optimisations fold batch norm into the convolution before it: the
    import warns, trains it like module.eval(), and the fused weight W*s and shift b - mean*s
    (s = gamma / sqrt(var + eps)) get the gradients PyTorch gives W / s and the bias."""
    module = zoo.make("resnet")
    path = zoo.export(module, zoo.sample_input("resnet", 3, seed=1), tmp_path / "r.onnx", exporter, mode)
    imported = import_onnx(path)
    assert imported.graph.meta["onnx"]["form"] == "inference"
    assert any("fused" in w and "=False" in w for w in imported.warnings)
    x = zoo.sample_input("resnet", BATCH, seed=2)
    ref = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    assert rel(ours_forward(imported, x, train=False), ref) <= TOL["float32"]

    g = imported.graph
    y = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(4))
    layout, flat = param_views(imported, g, "float64")
    gflat = np.zeros_like(flat)
    Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(gflat),
                                                {"x": x.numpy().astype(np.float64), "y": y.numpy()}, seed=0)
    grads = layout.views(gflat)
    tm = torch_module(module, False, torch.float64)
    F.cross_entropy(tm(x.double()), y).backward()
    # the file holds the fused values rounded to float32: a float32-sized tolerance
    for conv, bn in _conv_bn_pairs(tm):
        s = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach()
        fused_w = (conv.weight * s[:, None, None, None]).detach().numpy()
        fused_b = (bn.bias - bn.running_mean * s).detach().numpy()
        (w_ir,) = [k for k, v in imported.initial.items() if _close(v, fused_w)]
        (b_ir,) = [k for k, v in imported.initial.items() if _close(v, fused_b)]
        assert rel(grads[w_ir], (conv.weight.grad / s[:, None, None, None]).numpy()) <= 1e-5
        assert rel(grads[b_ir], bn.bias.grad.numpy()) <= 1e-5


# ---------------------------------------------------------------- loss heads


def _tiny(nodes, inputs, outputs, inits=(), opset=17) -> bytes:
    """A hand-written ONNX model's bytes."""
    from onnx import helper

    graph = helper.make_graph(nodes, "tiny", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _info(name, shape, elem=1):
    return onnx.helper.make_tensor_value_info(name, elem, shape)


def _linear_model(opset=17) -> bytes:
    """logits = x @ W with x (batch, 3), W (3, 2)."""
    w = onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 7, "w")
    return _tiny([onnx.helper.make_node("MatMul", ["x", "w"], ["logits"], name="mm")],
                 [_info("x", ["batch", 3])], [_info("logits", ["batch", 2])], [w], opset)


def test_loss_heads_follow_the_labels():
    g = import_onnx(_linear_model()).graph
    assert g.input("y").shape == (None,) and g.input("y").dtype == "int64" and set(g.outputs) == {"loss", "correct"}
    for kwargs in ({"loss": "mse"}, {"label_dtype": "float"}):
        g = import_onnx(_linear_model(), **kwargs).graph
        assert g.input("y").shape == (None, 2) and g.input("y").dtype == "float" and set(g.outputs) == {"loss"}
        assert g.node(g.outputs["loss"]).op == "mse"
    with pytest.raises(GraphError, match="integer class labels"):
        import_onnx(_linear_model(), loss="cross_entropy", label_dtype="float")
    with pytest.raises(GraphError, match=r"labels are \(3,\) per sample"):
        import_onnx(_linear_model(), label_shape=[3])


def test_a_graph_with_its_own_loss_trains_as_it_is():
    """Two inputs (x, y) and a float scalar output: that output is the loss."""
    h = onnx.helper
    w_value = np.arange(6, dtype=np.float32).reshape(3, 2) / 7
    nodes = [h.make_node("MatMul", ["x", "w"], ["pred"]), h.make_node("Sub", ["pred", "target"], ["d"]),
             h.make_node("Mul", ["d", "d"], ["sq"]), h.make_node("ReduceMean", ["sq"], ["mse"], keepdims=0)]
    model = _tiny(nodes, [_info("x", ["batch", 3]), _info("target", ["batch", 2])],
                  [_info("mse", []), _info("pred", ["batch", 2])], [onnx.numpy_helper.from_array(w_value, "w")])
    imported = import_onnx(model)
    g = imported.graph
    assert set(g.outputs) == {"loss"} and g.input("y").shape == (None, 2) and g.meta["onnx"]["output"] == "pred"
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    layout, flat = param_views(imported, g, "float64")
    gflat = np.zeros_like(flat)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(gflat), {"x": x, "y": y})
    d = x @ w_value - y
    assert out["loss"] == pytest.approx((d * d).mean(), rel=1e-12)
    assert rel(layout.views(gflat)["w"], 2 * x.T @ d / d.size) <= 1e-12


# ---------------------------------------------------------------- errors


def test_every_node_the_import_cannot_take_is_in_one_error_grouped_by_op():
    """Ops hpc_rlx lacks and ops it takes only on constants are listed at once, by op type with
    counts, each node with the PyTorch module it came from where the file records it; nodes
    downstream of them are passed over, not reported as new errors."""
    h = onnx.helper
    scoped = h.make_node("Hardmax", ["r"], ["a"], name="node_Hardmax_3")
    scoped.metadata_props.add(key="pkg.torch.onnx.name_scopes",
                              value="['', 'features', 'features.2.act', 'hardmax']")
    nodes = [h.make_node("Relu", ["x"], ["r"]), scoped,
             h.make_node("Hardmax", ["r"], ["b"], name="second"),
             h.make_node("Foo", ["r"], ["c"], name="custom", domain="com.example"),
             h.make_node("Mod", ["r", "r"], ["d"], name="mod_on_data", fmod=1),
             h.make_node("Add", ["a", "b"], ["ab"]), h.make_node("Add", ["c", "d"], ["cd"]),
             h.make_node("Add", ["ab", "cd"], ["out"])]
    model = onnx.load_from_string(_tiny(nodes, [_info("x", ["batch", 3])], [_info("out", ["batch", 3])]))
    model.opset_import.append(h.make_opsetid("com.example", 1))
    with pytest.raises(GraphError) as err:
        import_onnx(model.SerializeToString())
    text = str(err.value)
    lines = text.splitlines()
    assert lines[0] == "the ONNX file has 4 node(s) hpc_rlx cannot import:", text
    assert lines[1] == "  Hardmax x2: not supported; 'node_Hardmax_3' (in features.2.act), 'second'", text
    assert lines[2] == "  com.example::Foo x1: not supported; 'custom'", text
    assert lines[3] == ("  Mod x1: supported only on constants and shapes, but here an input depends on "
                        "the data; 'mod_on_data'"), text
    assert lines[4].startswith("ops that train: ") and "Relu" in lines[4] and "Mod" not in lines[4]
    assert lines[5].startswith("ops on constants and shapes only: ") and "Mod" in lines[5]
    assert len(lines) == 6, text


def test_nodes_of_supported_ops_in_forms_the_import_lacks_are_in_the_same_one_error():
    """A 3-D ConvTranspose and two cubic Resizes (ops the import has, in forms it has not) are
    listed with a missing op in one error, grouped by op type and reason with counts, so that
    `--check` names them all at once; a node refused alone keeps its own message."""
    h = onnx.helper
    scales = onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    axes = onnx.numpy_helper.from_array(np.array([2], np.int64), "axes")
    w = onnx.numpy_helper.from_array(np.ones((2, 2, 1, 1, 1), np.float32), "w")
    cubic = [h.make_node("Resize", ["x", "", "scales"], [f"up{k}"], name=f"cubic{k}", mode="cubic")
             for k in (1, 2)]
    nodes = cubic + [h.make_node("Unsqueeze", ["x", "axes"], ["x5"]),
                     h.make_node("ConvTranspose", ["x5", "w"], ["t5"], name="deconv3d"),
                     h.make_node("Hardmax", ["x"], ["hm"], name="hm"),
                     h.make_node("Add", ["up1", "up2"], ["out"])]
    inits = [scales, axes, w]
    model = _tiny(nodes, [_info("x", ["batch", 2, 4, 4])], [_info("out", ["batch", 2, 8, 8])], inits)
    with pytest.raises(GraphError) as err:
        import_onnx(model)
    lines = str(err.value).splitlines()
    assert lines[0] == "the ONNX file has 4 node(s) hpc_rlx cannot import:", lines
    assert lines[1] == "  Hardmax x1: not supported; 'hm'", lines
    assert lines[2].startswith("  ConvTranspose x1: input must be (batch, C, L) or (batch, C, H, W), got ONNX "
                               "rank 5; 'deconv3d'"), lines
    assert lines[3] == "  Resize x2: Resize mode 'cubic' is not supported (nearest and linear are); 'cubic1', " \
                       "'cubic2'", lines
    assert lines[4].startswith("ops that train: ") and len(lines) == 6, lines
    alone = _tiny(cubic[:1], [_info("x", ["batch", 2, 4, 4])], [_info("up1", ["batch", 2, 8, 8])], [scales])
    with pytest.raises(GraphError, match=r"^ONNX node 'cubic1' \(Resize\): Resize mode 'cubic' is not supported"):
        import_onnx(alone)


class _Unsupported(torch.nn.Module):
    """What docs/pytorch.md lists as not supported yet, in one module: a 3-D transposed
    convolution, bicubic and antialiased resampling, a random draw of a fixed shape and NonZero
    other than as pooling at a token."""

    def __init__(self, part: str):
        super().__init__()
        self.part, self.deconv, self.fc = part, torch.nn.ConvTranspose3d(2, 2, 2, stride=2), torch.nn.Linear(2, 2)

    def forward(self, x):                        # x: (batch, 2, 4, 4, 4)
        if self.part == "conv_transpose_3d":
            h = self.deconv(x).mean((2, 3, 4))
        elif self.part == "cubic":
            h = F.interpolate(x[:, :, 0], scale_factor=2, mode="bicubic").mean((2, 3))
        elif self.part == "antialias":
            h = F.interpolate(x[:, :, 0], size=(2, 2), mode="bilinear", antialias=True).mean((2, 3))
        elif self.part == "random_fixed_shape":
            h = x.mean((2, 3, 4)) + torch.rand(2)
        else:                                    # a count of nonzero entries
            h = x.mean((2, 3, 4)) * torch.nonzero(x[:, 0, 0] > 0).shape[0]
        return self.fc(h)


@pytest.mark.parametrize("part, exporter, message", [
    ("conv_transpose_3d", "torchscript", r"\(ConvTranspose\): input must be \(batch, C, L\) or \(batch, C, H, W\), "
                                          r"got ONNX rank 5"),
    ("cubic", "torchscript", r"\(Resize\): Resize mode 'cubic' is not supported"),
    ("antialias", "dynamo", r"\(Resize\): Resize with antialias=1 is not supported"),   # TorchScript cannot export it
    ("random_fixed_shape", "torchscript", r"RandomUniform x1: not supported \[a random tensor of a fixed shape"),
    ("nonzero", "torchscript", r"NonZero.* only a \(batch, sequence\) mask pooled per row")])
def test_what_the_docs_list_as_not_supported_is_refused(tmp_path, part, exporter, message):
    """docs/pytorch.md's "Not supported yet" list, each entry as PyTorch exports it."""
    path = zoo.export(_Unsupported(part), torch.randn(2, 2, 4, 4, 4), tmp_path / "m.onnx", exporter, "train",
                      optimize=False)
    with pytest.raises(GraphError, match=message):
        import_onnx(path)


def test_malformed_files_and_unsupported_opsets_fail_clearly(tmp_path):
    with pytest.raises(GraphError, match="ONNX bytes is not a valid ONNX model"):
        import_onnx(b"\x08\x07garbage that is no protobuf \xff\xff")
    with pytest.raises(GraphError, match="no such file"):
        import_onnx(tmp_path / "missing.onnx")
    with pytest.raises(GraphError, match="opset 12; hpc_rlx imports opsets 13 to"):
        import_onnx(_linear_model(opset=12))
    newest = onnx.defs.onnx_opset_version()
    assert import_onnx(_linear_model(opset=newest)).graph.meta["onnx"]["opset"] == newest
    with pytest.raises(GraphError, match=f"opset {newest + 1}"):
        import_onnx(_linear_model(opset=newest + 1))


def test_shapes_that_cannot_be_made_static_fail_clearly():
    h = onnx.helper
    two_rows = onnx.numpy_helper.from_array(np.array([2, -1], np.int64), "two_rows")
    mixes = _tiny([h.make_node("Reshape", ["x", "two_rows"], ["out"], name="rows")],
                  [_info("x", ["batch", 4])], [_info("out", [2, "n"])], [two_rows])
    with pytest.raises(GraphError, match=r"ONNX node 'rows' \(Reshape\): .*mixes samples.*cannot be made static"):
        import_onnx(mixes)
    zero, one = (onnx.numpy_helper.from_array(np.array(v, np.int64), n) for v, n in ((0, "zero"), (1, "one")))
    axes = onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")
    counts = _tiny([h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "zero"], ["b"]),
                    h.make_node("Range", ["zero", "b", "one"], ["r"]), h.make_node("Cast", ["r"], ["rf"], to=1),
                    h.make_node("Unsqueeze", ["rf", "axes"], ["col"]),
                    h.make_node("Add", ["x", "col"], ["out"], name="add")],
                   [_info("x", ["batch", 4])], [_info("out", ["batch", 4])], [zero, one, axes])
    with pytest.raises(GraphError, match=r"ONNX node 'add' \(Add\): dynamic shape .* cannot be made static"):
        import_onnx(counts)
    seq = _tiny([h.make_node("Relu", ["x"], ["out"])], [_info("x", ["batch", "seq"])], [_info("out", ["batch", "seq"])])
    with pytest.raises(GraphError, match="dim 1 is 'seq': only the batch dim"):
        import_onnx(seq)


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_dynamo_files_without_its_optimizer_import(tmp_path, name):
    """dynamo with optimize=False writes torch.split as SplitToSequence + SequenceAt and x[:, 0]
    as a whole-batch Slice followed by a Gather: both import, and match ONNX Runtime."""
    module = zoo.make(name)
    path = zoo.export(module, zoo.sample_input(name, 2), tmp_path / f"{name}.onnx", "dynamo", "eval",
                      optimize=False)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ("SplitToSequence" in ops) if name == "gpt" else ("Slice" in ops)
    imported = import_onnx(path)
    x = zoo.sample_input(name, 3, seed=4)
    session = ort.InferenceSession(str(path))
    ref = session.run(None, {session.get_inputs()[0].name: feed(x, "float32")})[0]
    assert rel(ours_forward(imported, x, train=False), ref) <= 1e-5


def test_export_check_says_what_a_file_holds_or_every_node_it_cannot_take(tmp_path, capsys):
    """`python -m hpc_rlx.export --check FILE.onnx`: exit 0 and a summary, or exit 2 and the one
    error of the import; no run directory needed."""
    from hpc_rlx.export.command import main

    good = tmp_path / "linear.onnx"
    good.write_bytes(_linear_model())
    assert main(["--check", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{good}: imports for training") and "6 trainable parameters" in out[1], out
    assert out[2].startswith("ops: ") and "linear x1" in out[2], out
    assert out[-1] == "trains: w (6)", out       # every parameter the import will train

    h = onnx.helper
    bad = tmp_path / "hardmax.onnx"
    bad.write_bytes(_tiny([h.make_node("Hardmax", ["x"], ["out"], name="hm")], [_info("x", ["batch", 3])],
                          [_info("out", ["batch", 3])]))
    assert main(["--check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m hpc_rlx.export: error: the ONNX file has 1 node(s) hpc_rlx cannot import:\n"
                          "  Hardmax x1: not supported; 'hm'"), err
    assert main(["--check", str(good), "--onnx", str(tmp_path / "out.onnx")]) == 2
    assert "--check takes the ONNX file alone" in capsys.readouterr().err


def test_a_dropout_the_exporter_left_without_its_flag_in_a_training_export_is_named_as_such():
    """One Dropout with training_mode, one without (as dynamo writes attention dropout): the
    warning says the exporter did it and that module.train() does not help; the form stays
    training and the other dropout trains."""
    h = onnx.helper
    ratio = onnx.numpy_helper.from_array(np.array(0.25, np.float32), "ratio")
    on = onnx.numpy_helper.from_array(np.array(True), "on")
    w = onnx.numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 7, "w")
    nodes = [h.make_node("Dropout", ["x", "ratio", "on"], ["xd"], name="drop_on"),
             h.make_node("MatMul", ["xd", "w"], ["h"], name="mm"),
             h.make_node("Dropout", ["h", "ratio"], ["logits"], name="attn_drop")]
    imported = import_onnx(_tiny(nodes, [_info("x", ["batch", 3])], [_info("logits", ["batch", 2])], [ratio, on, w]))
    (warning,) = imported.warnings
    assert "attn_drop" in warning and "without its training flag" in warning and "does not change" in warning
    assert "Export from module.train()" not in warning
    assert imported.graph.meta["onnx"]["form"] == "training"
    assert [n.op for n in imported.graph.nodes].count("dropout") == 1


def test_attentions_split_scale_folds_to_the_head_dims_fourth_root_in_float64():
    """Dynamo writes scaled dot-product attention's scale as Sqrt(1/sqrt(head dim)) on the query
    and on the key. Folded in float32 that is 0.59460354 for a head dim of 8; a float64 run sees
    8 ** -0.25 itself, as PyTorch's float64 module does (the short decimal was 6e-8 off)."""
    h = onnx.helper
    scale = onnx.numpy_helper.from_array(np.array(1 / np.sqrt(8), dtype=np.float32), "inv_sqrt_d")
    w = onnx.numpy_helper.from_array(np.eye(3, 2, dtype=np.float32), "w")
    nodes = [h.make_node("Sqrt", ["inv_sqrt_d"], ["s"]), h.make_node("Mul", ["x", "s"], ["xs"]),
             h.make_node("MatMul", ["xs", "w"], ["logits"])]
    g = import_onnx(_tiny(nodes, [_info("x", ["batch", 3])], [_info("logits", ["batch", 2])], [scale, w])).graph
    (constant,) = [n for n in g.nodes if n.op == "constant"]
    assert constant.attrs["value"] == 8 ** -0.25
