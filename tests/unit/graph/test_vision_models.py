"""Image models from torchvision and timm (tests/support/vision_zoo.py), built from the
libraries' own classes and exported by both of PyTorch's exporters as a user would: the import's
forward matches ONNX Runtime and PyTorch, its loss gradients match PyTorch autograd, and the
dynamo exporter's defaults (optimize=True, stochastic depth and dropout on) import with every
PyTorch parameter under its own name.

The comparisons use each model with dropout and stochastic depth at p = 0 (vision_zoo's
``_p0`` entries): the random masks are each side's own. The models cover what the import had to
learn for them: HardSwish and HardSigmoid (MobileNetV3), stochastic depth (EfficientNet-B0,
ConvNeXt, Swin), dynamo's ``as_strided`` after adaptive pooling (ConvNeXt, Swin), shifted
windows and a relative position bias gathered by constant index (Swin), F.normalize's ReduceL2
over merged batch dims (Swin V2), stochastic depth drawn per token row of a merged batch
(MobileViT) and batch norm over (B*tokens, C) rows (LeViT).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchvision")
pytest.importorskip("timm")
pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

import onnxruntime as ort  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.onnx_checks import (  # noqa: E402
    BATCH,
    TOL,
    check_gradients,
    ort_batch_stats,
    ours_forward,
    rel,
    torch_float32_error,
    torch_module,
)
from tests.support.shared import run_dir  # noqa: E402
from tests.support.vision_zoo import NO_DROP  # noqa: E402

MODELS = ["tv_mobilenet_v3", "tv_efficientnet_b0", "tv_convnext", "tv_swin", "tv_swin_v2", "timm_mobilevit",
          "timm_levit", "timm_mixer"]
# the default suite: one exporter per model, each exporter on half of them; the rest is slow
# TorchScript's file does not tell a module's buffers from its parameters, and Swin V2 computes
# with one (its relative_coords_table feeds the position-bias MLP): the import trains it, so
# that file is not PyTorch's model; the dynamo exporter's graph signature says what is a buffer
TORCHSCRIPT_BUFFERS = {"tv_swin_v2"}
CASES = [pytest.param(m, e, marks=[] if (i % 2 == 0) == (e == "dynamo") else [pytest.mark.slow])
         for i, m in enumerate(MODELS) for e in ("dynamo", "torchscript")
         if not (e == "torchscript" and m in TORCHSCRIPT_BUFFERS)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(module, path, ImportedModel) per case, exported once per run (onnx_zoo's file cache,
    shared with the training tests)."""
    cache, files = {}, run_dir(tmp_path_factory, "onnx-zoo")

    def get(name, exporter, optimize=False):
        key = (name, exporter, optimize)
        if key not in cache:
            module, path = zoo.export_zoo_model(name, files, exporter, "train", optimize=optimize)
            cache[key] = (module, path, import_onnx(path))
        return cache[key]

    return get


@pytest.mark.parametrize("name, exporter", CASES)
def test_forward_and_gradients_match_onnxruntime_and_pytorch(exported, name, exporter):
    module, path, imported = exported(name + NO_DROP, exporter)
    x = zoo.sample_input(name + NO_DROP, BATCH, seed=2)
    ours_eval = ours_forward(imported, x, train=False)
    with torch.no_grad():
        assert rel(ours_eval, torch_module(module, False)(x).numpy()) <= TOL["float32"]
    # float32 to float32: within TOL, or where batch norm over a few statistics rows amplifies
    # the rounding, within 4x PyTorch's own float32 error (torch_float32_error); the float64
    # test below checks the math itself
    forward_error, gradient_error = torch_float32_error(module, imported, name + NO_DROP)
    ort_out = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]
    if ort_batch_stats(path):
        # a TorchScript training-form file: ONNX Runtime normalises with the batch's statistics,
        # as our training forward does (dynamo writes inference nodes: running statistics)
        assert rel(ours_forward(imported, x, train=True), ort_out) <= max(TOL["float32"], 4 * forward_error)
    else:
        assert rel(ours_eval, ort_out) <= TOL["float32"]
    check_gradients(module, imported, name + NO_DROP, True, "float32", tol=max(TOL["float32"], 4 * gradient_error))


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter", [(m, e) for m in MODELS if m != "tv_mobilenet_v3"
                                            for e in ("dynamo", "torchscript")
                                            if not (e == "torchscript" and m in TORCHSCRIPT_BUFFERS)])
def test_gradients_match_pytorch_in_float64(exported, name, exporter):
    """MobileNetV3 is left out: PyTorch's float64 hardsigmoid backward multiplies by float32's
    1/6 (0.1666666716, ATen's CPU kernel), 3e-8 from the exact slope the import takes."""
    module, path, imported = exported(name + NO_DROP, exporter)
    check_gradients(module, imported, name + NO_DROP, True, "float64")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tv_mobilenet_v3", "tv_efficientnet_b0", "tv_convnext", "tv_swin"])
def test_dynamo_defaults_at_p0_match_onnxruntime_and_pytorch(exported, name):
    """The dynamo exporter's defaults (optimize=True) on the model with dropout and stochastic
    depth at p = 0: the forward equals ONNX Runtime and PyTorch, and the gradients PyTorch's
    (ConvNeXt). What the optimizer changed for good is in the import's warning instead: batch
    norm fused into the convolutions (MobileNetV3, EfficientNet-B0: training like module.eval(),
    tests/unit/graph/test_onnx_import.py), Swin's relative position bias table gathered by its
    constant index into new initializers, which train as parameters of their own."""
    module, path, imported = exported(name + NO_DROP, "dynamo", optimize=True)
    x = zoo.sample_input(name + NO_DROP, BATCH, seed=2)
    ours = ours_forward(imported, x, train=False)
    assert rel(ours, ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]) <= TOL["float32"]
    with torch.no_grad():
        assert rel(ours, torch_module(module, False)(x).numpy()) <= TOL["float32"]
    if imported.graph.meta["onnx"]["form"] != "training":
        assert any("fused" in w for w in imported.warnings), imported.warnings
    elif name == "tv_swin":
        assert any("relative_position_bias_table" in w and "computed from" in w for w in imported.warnings), \
            imported.warnings
    else:
        check_gradients(module, imported, name + NO_DROP, True, "float32")


@pytest.mark.parametrize("name", [pytest.param(m, marks=[] if m in ("tv_efficientnet_b0", "tv_swin") else
                                               [pytest.mark.slow]) for m in MODELS])
def test_dynamo_defaults_import_every_parameter_by_name(exported, name):
    """`torch.onnx.export(model, x, dynamo=True)` as is (its graph optimizer on) on the library's
    model with its defaults (stochastic depth and dropout on): every PyTorch parameter comes
    back under its own name, or one of the import's warnings names it (what the optimizer did
    that cannot be undone: batch norm fused into a convolution, a parameter it computed a new
    constant from, such as Swin's position-bias table gathered by its index), and the
    evaluation forward (random masks at their expectation) equals PyTorch's eval mode."""
    module, path, imported = exported(name, "dynamo", optimize=True)
    torch_names = set(imported.graph.meta["onnx"]["torch_names"].values())
    warned = " ".join(imported.warnings)
    unexplained = sorted(k for k in set(dict(module.named_parameters())) - torch_names if f"'{k}'" not in warned)
    assert not unexplained, (unexplained, imported.warnings)
    x = zoo.sample_input(name, BATCH, seed=2)
    with torch.no_grad():
        ref = module.eval()(x).numpy()
    assert rel(ours_forward(imported, x, train=False), ref) <= TOL["float32"]
    # stochastic depth and dropout are masks drawn in training (dynamo writes both as Bernoulli
    # draws): training forwards with other seeds differ (Swin's early blocks drop with a
    # probability near 0, so one pair of seeds may keep every block)
    assert "bernoulli" in {n.op for n in imported.graph.nodes}
    first = ours_forward(imported, x, train=True, seed=0)
    assert any(rel(ours_forward(imported, x, train=True, seed=s), first) > 1e-3 for s in range(1, 6))
