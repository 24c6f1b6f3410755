"""Export round trips over the model zoo (tests/support/onnx_zoo.py): each model exported by PyTorch,
imported, 'trained' (every parameter and running statistic moved), then exported by
`python -m hpc_rlx.export`: ONNX Runtime on the written file and PyTorch on the loaded state
dict both give hpc_rlx's inference forward."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.export.command import main
from hpc_rlx.export.onnx_source import SOURCE_FILE
from hpc_rlx.graph import Executor

from tests.mpi.export.test_export import TOL, fake_run, ort_run, rel_err

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
st = pytest.importorskip("safetensors.torch")
onnx_import = pytest.importorskip("hpc_rlx.graph.onnx.importer")

from tests.support import onnx_zoo as zoo  # noqa: E402
from tests.support.shared import run_dir  # noqa: E402

# A model without mode-dependent layers exports one dynamo file for both modes
# (onnx_zoo.exports_by_mode), and this test reads nothing else of the mode: its eval case would
# repeat the train case exactly, so only models whose modes differ have one.
CASES = [(m, e, mode) for m in zoo.ZOO for e in ("dynamo", "torchscript") for mode in ("train", "eval")
         if not (e == "dynamo" and mode == "eval" and not zoo.exports_by_mode(zoo.make(m)))]
# the default suite: batch norm (both exporters), a tied head and attention, folded weights; the rest is slow
FAST = {("resnet", "dynamo", "train", "plain"), ("mobilenet", "torchscript", "train", "plain"),
        ("gpt", "torchscript", "train", "plain"), ("gpt", "dynamo", "train", "optimized")}
PARAMS = [pytest.param(*c, form, id="-".join(c + (form,)),
                       marks=[] if c + (form,) in FAST else [pytest.mark.slow])
          for c in CASES for form in ("plain", "optimized")]
# torchvision's and timm's models (tests/support/vision_zoo.py, dropout and stochastic depth off):
# hard swish and squeeze-and-excitation, Swin's index tables and V2's coordinate buffer, LeViT's
# batch norm over token rows
VISION = [("tv_mobilenet_v3_p0", "dynamo"), ("tv_swin_p0", "torchscript"), ("tv_swin_v2_p0", "dynamo"),
          ("timm_levit_p0", "dynamo")]
if importlib.util.find_spec("torchvision") and importlib.util.find_spec("timm"):
    # and the issue's other image models, each exporter; "optimized" with the libraries' defaults
    # (stochastic depth and dropout on, dynamo's optimize=True)
    VISION += [("tv_mobilenet_v3_p0", "torchscript"), ("tv_swin_p0", "dynamo")] + [
        (m, e) for m in ("tv_efficientnet_b0_p0", "tv_convnext_p0") for e in ("dynamo", "torchscript")]
    PARAMS += [pytest.param(m, e, "train", "plain", id=f"{m}-{e}-train-plain", marks=[pytest.mark.slow])
               for m, e in VISION]
    PARAMS += [pytest.param(m, "dynamo", "train", "optimized", id=f"{m}-dynamo-train-optimized",
                            marks=[pytest.mark.slow])
               for m in ("tv_mobilenet_v3", "tv_efficientnet_b0", "tv_convnext", "tv_swin")]
# Hugging Face's models (tests/support/hf_zoo.py): each exporter that writes them, and "defaults":
# dynamo's optimize=True on freshly initialised weights (merged layer-norm initializers untied)
HF_CANNOT_EXPORT = {("llama", "torchscript"), ("t5", "dynamo"), ("qwen2_cls", "torchscript"),
                    ("mistral_cls", "torchscript")}
if importlib.util.find_spec("transformers"):
    from tests.support.hf_zoo import HF_ZOO  # noqa: E402
    PARAMS += [pytest.param(m, e, "train", form, id=f"{m}-{e}-train-{form}",
                            marks=[] if (m, e, form) == ("bert", "dynamo", "plain") else [pytest.mark.slow])
               for m in HF_ZOO for e, form in (("dynamo", "plain"), ("torchscript", "plain"), ("dynamo", "defaults"))
               if (m, e) not in HF_CANNOT_EXPORT]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(module constructor, source file bytes, ImportedModel) per case, made once. "plain": no
    graph optimisation (dynamo optimize=False, no TorchScript constant folding), as the README
    asks for; "optimized": the exporters' defaults (folded weights, batch norm fused);
    "defaults": dynamo's defaults on a freshly initialised model (onnx_zoo.fresh)."""
    cache, files = {}, run_dir(tmp_path_factory, "onnx-zoo")

    def get(name, exporter, mode, form):
        key = (name, exporter, mode, form)
        if key not in cache:
            _, path = zoo.export_zoo_model(name, files, exporter, mode, optimize=form != "plain",
                                           weights="fresh" if form == "defaults" else "random")
            try:
                imported = onnx_import.import_onnx(path)
            except GraphError as e:  # which files import is tests/unit/graph/test_onnx_import.py's subject
                imported = e
            # the run directory holds one self-contained file (external data read back in)
            # the module the state dict loads into holds the file's other tensors: randomize
            # also drew the buffers that a state dict leaves out (Llama's rotary inv_freq)
            make = functools.partial(zoo.fresh if form == "defaults" else zoo.make, name)
            cache[key] = (make, onnx.load(str(path)).SerializeToString(), imported)
        if isinstance(cache[key][2], GraphError):
            pytest.skip(f"import_onnx refuses this file: {str(cache[key][2])[:200]}")
        return cache[key]

    return get


def _trained_run(tmp_path, imported, source: bytes):
    graph = imported.graph
    rng = np.random.default_rng(7)
    params = {}
    for p in graph.params:
        value = imported.initial[p.name] * (1 + 0.1 * rng.standard_normal(p.shape)) + 0.02 * rng.standard_normal(p.shape)
        if not p.trainable and "var" in p.name:
            value = np.abs(value) + 0.1
        params[p.name] = value.astype(np.float32)
    run = tmp_path / "run"
    fake_run(run, graph, params)
    (run / SOURCE_FILE).write_bytes(source)
    return run, params


def _tied_names(module) -> set:
    by_tensor: dict = {}
    for name, t in module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), []).append(name)
    return {n for names in by_tensor.values() if len(names) > 1 for n in names}


@pytest.mark.parametrize("name, exporter, mode, form", PARAMS)
def test_zoo_model_round_trips_through_export(tmp_path, capsys, exported, name, exporter, mode, form):
    make, source, imported = exported(name, exporter, mode, form)
    run, params = _trained_run(tmp_path, imported, source)
    out_onnx, out_sd = tmp_path / "m.onnx", tmp_path / "m.safetensors"
    base = []
    if form == "defaults":  # the module's original weights complete what dynamo's optimizer folded or dropped
        st.save_file({k: v.detach().clone().contiguous() for k, v in make().state_dict().items()
                      if v.is_floating_point()}, str(tmp_path / "original.safetensors"))
        base = ["--base", str(tmp_path / "original.safetensors")]
    capsys.readouterr()
    assert main([str(run), "--onnx", str(out_onnx), "--state-dict", str(out_sd)] + base) == 0
    noted = capsys.readouterr().err  # parts that cannot go back (rows gathered out of order or repeated)
    graph, meta = imported.graph, imported.graph.meta["onnx"]
    node = meta["output_node"]
    ex = Executor(graph, np, "float32")

    def ours(x):
        x = x.numpy()
        return ex.run(params, {"x": x if x.dtype == np.int64 else x.astype(np.float32)}, [node])[node]

    for batch in (1, 4):
        x = zoo.sample_input(name, batch, seed=batch)
        got = ort_run(out_onnx, {meta["input"]: x.numpy() if x.dtype == torch.int64 else x.numpy().astype(np.float32)})
        assert rel_err(got, ours(x)) <= TOL, "ONNX Runtime"
    if form == "optimized":
        return  # weights the exporter folded or fused have no PyTorch name to load under (README)

    fresh = make()
    result = fresh.load_state_dict(st.load_file(str(out_sd)), strict=False)
    # with dynamo's defaults and --base, a table the optimizer computed from a parameter goes back
    # into it (a position table sliced to the traced length); rows gathered out of order or
    # repeated (BERT's token types) stay their own parameter under the file's name, as noted
    # and one computed from several parameters stays under its own name, as the import warned
    mixed = " ".join(w for w in imported.warnings if "cannot be written back" in w)
    unexpected = [k for k in result.unexpected_keys if f"'{k}'" not in noted and f"'{k}'" not in mixed]
    assert unexpected == [], f"import warnings: {imported.warnings}"
    float_state = {k for k, v in fresh.state_dict().items() if v.dtype.is_floating_point}
    # a tied weight's other names: the dynamo exporter's records name them all, TorchScript's do not
    tied = _tied_names(fresh) if exporter == "torchscript" else set()
    allowed = tied | {k for k in fresh.state_dict() if k not in float_state}  # e.g. a bool mask
    allowed |= {k for k in result.missing_keys if f"'{k}'" in noted or f"'{k}'" in mixed}  # what those came from
    missing = [k for k in result.missing_keys if k not in allowed and not k.endswith("num_batches_tracked")]
    assert missing == [], f"the state dict lacks {missing} (import warnings: {imported.warnings})"
    if form == "defaults" and (result.missing_keys or result.unexpected_keys):
        return  # the module keeps its own values of what the file lacks, the import trained others
    x = zoo.sample_input(name, 4, seed=4)
    with torch.no_grad():
        got = fresh.eval()(x).numpy()
    assert rel_err(got, ours(x)) <= TOL, "PyTorch with the loaded state dict"
