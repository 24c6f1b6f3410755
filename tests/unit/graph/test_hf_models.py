"""Models from Hugging Face transformers (tests/support/hf_zoo.py), exported by PyTorch's
exporters as a user would, import to graphs whose forward matches ONNX Runtime and PyTorch and
whose loss gradients match PyTorch autograd: BERT, DistilBERT, GPT-2 and Llama with their
default attention (the mask built at run time), rotary position embeddings and token types;
RoBERTa (position ids from the token ids at run time), and the encoder-decoders BART and T5
(decoder ids shifted right by scatters at run time, pooling at the end-of-sequence token);
the decoder-only sequence classifiers on Qwen2, Llama and Mistral (pooling at each row's last
non-padding token: an ArgMax at run time, then one entry picked per row) and DeBERTa-v2
(relative positions by Sign, their keys repeated per sample by Tile); and the audio encoder
wav2vec 2.0 (GroupNorm in its feature extractor).

TorchScript cannot export Llama's grouped-query attention, and dynamo cannot export T5 (its
decomposition fails to view the attention output, in PyTorch's own step): those are PyTorch
limits, so Llama runs with the dynamo exporter only and T5 with TorchScript only.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

import onnxruntime as ort  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.hf_zoo import HF_ZOO  # noqa: E402
from tests.support.onnx_checks import BATCH, TOL, check_gradients, ours_forward, rel, torch_module  # noqa: E402
from tests.support.shared import run_dir  # noqa: E402

# PyTorch's exporter fails (TorchScript on grouped-query attention)
CANNOT_EXPORT = {("llama", "torchscript"), ("t5", "dynamo"), ("qwen2_cls", "torchscript"),
                 ("mistral_cls", "torchscript")}
# the models people fine-tune that came later (decoder-only classifiers, DeBERTa-v2): the quick
# TorchScript export in the default suite, the dynamo ones (seconds each) in the slow one
LATER = {"qwen2_cls": None, "mistral_cls": None, "llama_cls": "torchscript", "deberta": "torchscript",
         "wav2vec2": "torchscript"}
CASES = [pytest.param(name, exporter, id=f"{name}-{exporter}",
                      marks=[pytest.mark.slow] if LATER.get(name, exporter) != exporter else [])
         for name in HF_ZOO for exporter in ("dynamo", "torchscript") if (name, exporter) not in CANNOT_EXPORT]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(module, path, ImportedModel) per case, exported once per test run (the file cache of
    tests/support/onnx_zoo.py, shared with the training tests)."""
    cache, files = {}, run_dir(tmp_path_factory, "onnx-zoo")

    def get(name, exporter):
        if (name, exporter) not in cache:
            module, path = zoo.export_zoo_model(name, files, exporter, "train", optimize=False)
            cache[name, exporter] = (module, path, import_onnx(path))
        return cache[name, exporter]

    return get


@pytest.mark.parametrize("name, exporter", CASES)
def test_forward_matches_onnxruntime_and_pytorch(exported, name, exporter):
    module, path, imported = exported(name, exporter)
    x = zoo.sample_input(name, BATCH, seed=2)
    ours = ours_forward(imported, x, train=False)
    assert rel(ours, ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]) <= TOL["float32"]
    with torch.no_grad():
        assert rel(ours, torch_module(module, False)(x).numpy()) <= TOL["float32"]


@pytest.mark.parametrize("name, exporter", CASES)
def test_gradients_match_pytorch_in_float32(exported, name, exporter):
    module, path, imported = exported(name, exporter)
    check_gradients(module, imported, name, True, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter", [c.values for c in CASES
                                           if c.values[0] not in ("llama", "t5", "qwen2_cls", "llama_cls", "mistral_cls",
                                                                  "deberta")])
def test_gradients_match_pytorch_in_float64(exported, name, exporter):
    """Llama (and the classifiers on Llama and Qwen2), T5 and DeBERTa are left out: Llama's
    rotary embedding casts positions and frequencies to float32 in any model dtype
    (transformers' LlamaRotaryEmbedding), T5's layer norm its variance (T5LayerNorm), DeBERTa
    its attention scale (a float32 tensor), so PyTorch's float64 run is not all float64 (the
    float32 check covers them)."""
    module, path, imported = exported(name, exporter)
    check_gradients(module, imported, name, True, "float64")


DEFAULTS = [pytest.param(n, marks=[] if n == "bert" else [pytest.mark.slow])
            for n in HF_ZOO if (n, "dynamo") not in CANNOT_EXPORT]


@pytest.mark.parametrize("name", DEFAULTS)
def test_dynamo_defaults_match_onnxruntime_and_train_every_parameter_apart(tmp_path_factory, name):
    """`torch.onnx.export(..., dynamo=True)` as is (optimize=True) on a freshly initialised model:
    the optimizer merges the equal layer-norm weights and biases; the import gives each module
    its own parameter back under its PyTorch name, keeps a real tie (GPT-2's head reads the token
    embedding) tied; the forward equals ONNX Runtime and PyTorch, and the gradient of every
    PyTorch parameter equals PyTorch's by name, in float32 and float64. What the optimizer did
    for good (a zero bias dropped, a position table it gathered into a new initializer) is named
    in a warning."""
    import numpy as np
    import torch.nn.functional as F

    from hpc_rlx.graph import Executor

    from tests.support.onnx_checks import feed, param_views

    module, path = zoo.export_zoo_model(name, run_dir(tmp_path_factory, "onnx-zoo"), "dynamo", "train",
                                        optimize=True, weights="fresh")
    imported = import_onnx(path)
    assert any("train separately again" in w for w in imported.warnings), imported.warnings
    g, meta = imported.graph, imported.graph.meta["onnx"]
    x = zoo.sample_input(name, BATCH, seed=2)
    ours = ours_forward(imported, x, train=False)
    assert rel(ours, ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]) <= TOL["float32"]
    with torch.no_grad():
        assert rel(ours, torch_module(module, False)(x).numpy()) <= TOL["float32"]

    by_torch = {t: ir for ir, t in meta["torch_names"].items()}
    names_of: dict = {}      # a tied tensor's names: the file holds it under one of them
    for tname, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(tname)
    ir_of = {names[0]: next((by_torch[n] for n in names if n in by_torch), None) for names in names_of.values()}
    warned = " ".join(imported.warnings)
    unexplained = sorted(k for k, ir in ir_of.items() if ir is None and f"'{k}'" not in warned)
    assert not unexplained, (unexplained, imported.warnings)
    norms = [k for k in ir_of if "norm" in k.lower() or ".ln_" in k]
    assert norms and all(ir_of[k] is not None for k in norms), norms

    _, shape, vocab = HF_ZOO[name]
    classes = g.types[meta["output_node"]].shape[-1]
    y_shape = (BATCH,) if g.input("y").shape == (None,) else (BATCH, *shape)
    y = torch.randint(0, classes, y_shape, generator=torch.Generator().manual_seed(4))
    # float64 too where PyTorch runs the model in float64 (not Llama and the classifiers on
    # rotary embeddings, nor DeBERTa: see test_gradients_match_pytorch_in_float64), and where the
    # optimizer computed no weight in float32 (wav2vec 2.0's weight-normed position convolution
    # is folded into one initializer, named in a warning: 3e-8 from PyTorch's float64 forward)
    for dtype in ("float32",) if name in ("llama", "qwen2_cls", "llama_cls", "mistral_cls", "deberta", "wav2vec2") \
            else ("float32", "float64"):
        layout, flat = param_views(imported, g, dtype)
        grad = np.zeros_like(flat)
        out = Executor(g, np, dtype).forward_backward(layout.views(flat), layout.views(grad),
                                                      {"x": feed(x, dtype), "y": y.numpy()}, train=True, seed=0)
        tm = torch_module(module, True, getattr(torch, dtype))
        logits = tm(x if x.dtype == torch.int64 else x.to(getattr(torch, dtype)))   # token ids or audio
        loss = F.cross_entropy(logits.reshape(-1, classes), y.reshape(-1))
        loss.backward()
        assert out["loss"] == pytest.approx(loss.item(), rel=TOL[dtype])
        grads, named = layout.views(grad), dict(tm.named_parameters())
        total = np.sqrt(sum(np.linalg.norm(p.grad.numpy()) ** 2 for p in named.values()))
        for tname, ir in ir_of.items():
            if ir is None:
                continue
            ref = named[tname].grad.numpy()
            if np.linalg.norm(ref) < 1e-6 * total:
                # (near) zero, as attention's key bias (softmax ignores a shift per query): in
                # float32 both sides are rounding noise, so only the difference's size compares
                assert np.linalg.norm(grads[ir] - ref) <= TOL[dtype] * total, (dtype, tname)
            else:
                assert rel(grads[ir], ref) <= TOL[dtype], (dtype, tname)
    if name == "gpt2":          # the tied head stays one parameter: the embedding's
        assert "model.lm_head.weight" not in by_torch or "model.transformer.wte.weight" not in by_torch
