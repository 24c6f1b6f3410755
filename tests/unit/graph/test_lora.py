"""LoRA adapters (`graph/lora.py`, model.lora.*), in one process: the rewrite of an imported
PyTorch model computes PEFT's forward and PEFT's gradients for a Linear (PyTorch's (out, in))
and a GPT-2 Conv1D ((in, out), PEFT's fan_in_fan_out) alike, the base weights get no gradient,
the merge for the exports equals the adapted forward, the rewrite undoes exactly, and every
bad setting is one error naming the key."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph import Executor, ParamLayout, build_model, freeze_params, init_params
from hpc_rlx.graph.lora import (add_adapters, adapter_ir_names, initial_adapters, lora_settings, merged,
                                without_adapters)
from hpc_rlx.graph.param_names import user_names

torch = pytest.importorskip("torch")          # the oracle: absent from the Open MPI pass's environment
peft = pytest.importorskip("peft")
pytest.importorskip("onnx")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402


class Net(torch.nn.Module):
    """An embedding, a Linear, a GPT-2 Conv1D and a head: every kind LoRA meets."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 8)
        self.c_fc = Conv1D(5, 8)               # GPT-2's: weight stored (in=8, out=5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, ids):
        h = torch.tanh(self.proj(self.emb(ids).mean(1)))
        return self.head(torch.tanh(self.c_fc(h)))


def _settings(rank=2, alpha=3.0, targets=("proj", "*c_fc")):
    return lora_settings({"rank": rank, "alpha": alpha, "dropout": 0.0, "targets": list(targets)})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    net = Net().double()
    path = tmp_path_factory.mktemp("lora") / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.float(), (torch.zeros(2, 4, dtype=torch.long),), str(path), dynamo=False,
                          input_names=["ids"], output_names=["logits"],
                          dynamic_axes={"ids": {0: "batch"}, "logits": {0: "batch"}})
    return net.double(), import_onnx(str(path))


def _values(g, imported, seed=5):
    """The imported weights, the adapters at their initial values with B made non-zero (a
    zero B would hide a wrong orientation), float64."""
    layout = ParamLayout(g)
    flat = np.zeros(layout.size)
    init = initial_adapters(g, seed)
    rng = np.random.default_rng(seed)
    init = {k: (rng.normal(0, 0.5, v.shape) if k.endswith("lora_B") else v) for k, v in init.items()}
    layout.pack({**imported.initial, **init}, flat)
    return layout, flat


def test_the_rewrite_computes_peft_forward_and_gradients_for_linear_and_conv1d(exported):
    net, imported = exported
    g = freeze_params(add_adapters(imported.graph, _settings()))
    layout, flat = _values(g, imported)
    names = user_names(g)
    assert sorted(names[n] for n in adapter_ir_names(g.meta)) == [
        "c_fc.lora_A.weight", "c_fc.lora_B.weight", "proj.lora_A.weight", "proj.lora_B.weight"]
    assert [names[p.name] for p in g.params if not p.frozen] == [names[n] for n in adapter_ir_names(g.meta)]
    views = layout.views(flat)
    assert views[[n for n in names if names[n] == "c_fc.lora_A.weight"][0]].shape == (2, 8)   # (r, in)
    ids = np.random.default_rng(1).integers(0, 11, (4, 4))
    y = np.array([0, 2, 1, 2])
    grads = np.zeros(layout.size)
    out = Executor(g, np, "float64").forward_backward(views, layout.grad_views(grads), {"x": ids, "y": y}, seed=0)

    config = peft.LoraConfig(r=2, lora_alpha=3.0, lora_dropout=0.0, target_modules=["proj", "c_fc"])
    peft_net = peft.get_peft_model(net, config).double()       # PEFT sets fan_in_fan_out for the Conv1D
    by_name = {names[n]: torch.tensor(np.array(views[n])) for n in adapter_ir_names(g.meta)}
    with torch.no_grad():
        for key, p in peft_net.named_parameters():
            if "lora_" in key:
                p.copy_(by_name[key.replace("base_model.model.", "").replace(".default", "")])
    loss = torch.nn.functional.cross_entropy(peft_net(torch.tensor(ids)), torch.tensor(y))
    loss.backward()
    assert abs(out["loss"] - loss.item()) <= 1e-12
    gviews = layout.grad_views(grads)
    for key, p in peft_net.named_parameters():
        if "lora_" in key:
            ir = next(n for n in names if names[n] == key.replace("base_model.model.", "").replace(".default", ""))
            np.testing.assert_allclose(gviews[ir], p.grad.numpy(), rtol=0, atol=1e-12, err_msg=key)
    assert set(gviews) == set(adapter_ir_names(g.meta))          # the base weights have no gradient


def test_the_merge_equals_the_adapted_forward_and_the_rewrite_undoes_exactly(exported):
    _, imported = exported
    g = add_adapters(imported.graph, _settings())
    layout, flat = _values(g, imported)
    ids, y = np.random.default_rng(2).integers(0, 11, (3, 4)), np.array([1, 0, 2])
    adapted = Executor(g, np, "float64").forward(layout.views(flat), {"x": ids, "y": y}, train=False)
    base = without_adapters(g)
    assert base.to_dict() == imported.graph.to_dict()
    values = merged(g.meta, {k: np.array(v) for k, v in layout.views(flat).items()})
    assert set(values) == {p.name for p in base.params}
    flat2 = ParamLayout(base).pack(values, np.zeros(ParamLayout(base).size))
    plain = Executor(base, np, "float64").forward(ParamLayout(base).views(flat2), {"x": ids, "y": y}, train=False)
    assert abs(adapted["loss"] - plain["loss"]) <= 1e-12
    assert adapted["loss"] != Executor(base, np, "float64").forward(
        ParamLayout(base).views(ParamLayout(base).pack(dict(imported.initial), np.zeros(ParamLayout(base).size))),
        {"x": ids, "y": y}, train=False)["loss"]              # the adapters do change the model


def test_the_initial_adapters_are_peft_s_and_drawn_as_every_parameter_is():
    g = add_adapters(build_model("mlp", input_shape=(6,), num_classes=3, hidden=[8, 8]), _settings(targets=["fc1"]))
    flat = init_params(g, np.zeros(ParamLayout(g).size), 7)
    views, init = ParamLayout(g).views(flat), initial_adapters(g, 7)
    assert set(init) == {"fc1.weight.lora_A", "fc1.weight.lora_B"}
    for name, value in init.items():
        np.testing.assert_array_equal(views[name], value)
    a = init["fc1.weight.lora_A"]
    assert a.shape == (2, 8) and 0.3 < np.abs(a).max() <= 1 / np.sqrt(8)       # kaiming_uniform_(a=sqrt(5))
    assert not init["fc1.weight.lora_B"].any()


@pytest.mark.parametrize("lora, freeze, match", [
    ({"rank": 2, "targets": []}, [], r"model.lora.rank=2 needs model.lora.targets=\[globs\]"),
    ({"rank": 2, "targets": ["*query"]}, [], r"model.lora.targets: '\*query' matches no trainable parameter"),
    ({"rank": 2, "targets": ["*bias"]}, [], r"model.lora.targets: '\*bias' matches only 1-D parameters"),
    ({"rank": 2, "targets": ["emb"]}, [], r"model.lora.targets=\['emb'\]: 'emb.weight' is read by the embedding node"),
    ({"rank": 7, "targets": ["proj"]}, [], r"model.lora.rank=7 is above the smaller dimension of 'proj.weight' "
                                           r"\(8 x 6\): choose a rank of at most 6"),
    ({"rank": 2, "targets": ["proj"]}, ["head.*"], r"model.freeze=\['head.\*'\] with model.lora.rank > 0"),
])
def test_a_bad_lora_setting_is_one_error_naming_the_key(exported, lora, freeze, match):
    _, imported = exported
    with pytest.raises(ConfigError, match=match):
        freeze_params(add_adapters(imported.graph, lora_settings({"alpha": 8, "dropout": 0.0, **lora})), freeze)


def test_lora_dropout_drops_the_adapters_input_only():
    """model.lora.dropout: a dropout on the adapters' side path only. With B at zero the adapted
    layer's output is the base's whatever the mask (the base path is never dropped), while A's
    gradient sees the dropped input; in eval mode nothing is dropped; the merge undoes it too."""
    g0 = build_model("mlp", input_shape=(6,), num_classes=3, hidden=[8])
    g = add_adapters(g0, lora_settings({"rank": 2, "alpha": 2, "dropout": 0.5, "targets": ["fc0"]}))
    assert [n.op for n in g.nodes if n.name.startswith("fc0.")] == ["linear", "dropout", "linear", "linear", "scale"]
    layout = ParamLayout(g)
    flat = init_params(g, np.zeros(layout.size), 1)
    x, y = np.random.default_rng(0).normal(size=(16, 6)), np.arange(16) % 3
    plain = ParamLayout(g0)
    base_flat = plain.pack({k: v for k, v in layout.views(flat).items() if "lora" not in k}, np.zeros(plain.size))
    want = Executor(g0, np, "float64").forward(plain.views(base_flat), {"x": x, "y": y}, train=True, seed=3)
    ex = Executor(g, np, "float64")
    assert ex.forward(layout.views(flat), {"x": x, "y": y}, train=True, seed=3)["loss"] == want["loss"]
    grads = {}
    for p in (0.5, 0.0):
        gp = add_adapters(g0, lora_settings({"rank": 2, "alpha": 2, "dropout": p, "targets": ["fc0"]}))
        gv = np.zeros(layout.size)
        b = layout.views(flat)["fc0.weight.lora_B"]
        b[...] = 0.3                                   # a non-zero B: A gets a gradient
        Executor(gp, np, "float64").forward_backward(layout.views(flat), layout.grad_views(gv), {"x": x, "y": y}, seed=3)
        grads[p] = layout.grad_views(gv)["fc0.weight.lora_A"].copy()
    assert not np.allclose(grads[0.5], grads[0.0])
    assert without_adapters(g).to_dict() == g0.to_dict()


def test_a_checkpoint_with_other_adapters_is_refused_naming_both():
    from hpc_rlx.base.errors import CheckpointError
    from hpc_rlx.checkpoint.graph_match import check_frozen, frozen_record
    g0 = build_model("mlp", input_shape=(6,), num_classes=3, hidden=[8])
    mine = frozen_record(freeze_params(add_adapters(g0, _settings(targets=["fc0"]))).to_dict())
    assert mine["lora"] == {"rank": 2, "alpha": 3.0, "adapted": ["fc0.weight"]}
    check_frozen("c.h5", mine, mine)
    with pytest.raises(CheckpointError, match=r"checkpoint c.h5 was trained with other LoRA adapters \(model.lora.\*\): "
                                              r"the checkpoint's rank 2, alpha 3.0 on fc0.weight; this run's none"):
        check_frozen("c.h5", mine, frozen_record(g0.to_dict()))
    assert frozen_record(g0.to_dict()) == {}            # without LoRA or a frozen set: the meta as before
