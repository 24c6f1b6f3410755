"""Export of models that came in as ONNX: the original file with the trained weights, in its
inference form, and the state dict under PyTorch's names, both checked against PyTorch.

The first tests write graph.meta["onnx"] themselves (the importer's map from parameters to the
file's initializers), so they check the exporter alone; the round trips at the end go through
the importer (hpc_rlx.graph.onnx.importer) and compare with hpc_rlx's own forward."""

from __future__ import annotations

import io

import numpy as np
import pytest

from hpc_rlx.export.command import main, state_dict
from hpc_rlx.export.onnx_source import SOURCE_FILE, original_onnx
from hpc_rlx.export.trained import load_trained
from hpc_rlx.graph import GraphBuilder

from tests.mpi.export.test_export import TOL, fake_run, ort_run, rel_err

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
st = pytest.importorskip("safetensors.torch")
nn = torch.nn

# the exporters' deprecation and tracer chatter
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::torch.jit.TracerWarning")


class ConvNet(nn.Module):
    """Convolution, batch norm, dropout, a linear on 2-D and one on 3-D input (a MatMul whose
    weight the exporters transpose)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 4 * 4, 6)
        self.seq = nn.Linear(6, 5)

    def forward(self, x):
        h = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2).flatten(1)
        return self.seq(self.drop(self.fc(h)).unsqueeze(1)).squeeze(1)


class SeqMlp(nn.Module):
    """No batch norm: the eval-mode TorchScript export folds seq.weight into a transposed copy."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 6)
        self.seq = nn.Linear(6, 5)

    def forward(self, x):
        return self.seq(torch.tanh(self.fc(x.flatten(1))).unsqueeze(1)).squeeze(1)


_EXPORTED: dict = {}


def export_torch(module, exporter: str, train: bool) -> bytes:
    """The file (cached per module class, exporter and mode: exports take seconds)."""
    key = (type(module), exporter, train)
    if key not in _EXPORTED:
        _EXPORTED[key] = _export(module, exporter, train)
    return _EXPORTED[key]


def _export(module, exporter: str, train: bool) -> bytes:
    module.train(train)
    x = torch.randn(2, 1, 8, 8)
    if exporter == "dynamo":
        prog = torch.onnx.export(module, (x,), dynamo=True, optimize=False, input_names=["x"],
                                 dynamic_shapes=({0: torch.export.Dim("batch")},))
        return prog.model_proto.SerializeToString()
    f = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(module, (x,), f, dynamo=False, input_names=["x"], training=mode,
                      do_constant_folding=not train, dynamic_axes={"x": {0: "b"}})
    return f.getvalue()


def imported_meta(model_bytes: bytes, module) -> tuple[dict, dict]:
    """What the importer records, worked out from the file and the module: (meta, IR shapes).
    Every float initializer is a parameter under its name; one equal to a state-dict tensor
    transposed is that tensor, kept in PyTorch's layout under its PyTorch name."""
    proto = onnx.load_from_string(model_bytes)
    sd = {k: v.detach().numpy() for k, v in module.state_dict().items() if v.dtype == torch.float32}
    params, transposed, shapes = {}, {}, {}
    for init in proto.graph.initializer:
        value = onnx.numpy_helper.to_array(init)
        if value.dtype != np.float32 or value.ndim == 0:
            continue
        if init.name in sd:
            params[init.name], shapes[init.name] = init.name, value.shape
            continue
        match = next((k for k, v in sd.items() if v.ndim == 2 and v.T.shape == value.shape
                      and np.array_equal(v.T, value)), None)
        if match is not None:
            params[match], transposed[match], shapes[match] = init.name, init.name, sd[match].shape
    meta = {"opset": proto.opset_import[0].version, "params": params, "transposed": transposed,
            "input": proto.graph.input[0].name, "output": proto.graph.output[0].name}
    return meta, shapes


def imported_run(tmp_path, cls, exporter, train, seed=1):
    """A run directory of an imported model whose 'trained' weights are the exported module's
    after a random change; returns (run_dir, the trained PyTorch module)."""
    torch.manual_seed(0)
    module = cls()
    data = export_torch(module, exporter, train)
    meta, shapes = imported_meta(data, module)
    trained = cls()
    trained.load_state_dict(module.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in trained.state_dict().items():
            if t.dtype == torch.float32:
                t.add_(0.1 * torch.randn(t.shape, generator=gen))
                if name.endswith("running_var"):
                    t.abs_().add_(0.5)
    b = GraphBuilder("imported", meta={"onnx": meta})
    x = b.input("x", [None, 1, 8, 8])
    for name, shape in shapes.items():
        b.param(name, list(shape), {"scheme": "zeros"}, trainable="running" not in name)
    b.output("loss", b.op("mean", x))
    graph = b.build()
    values = {k: v.detach().numpy().astype(np.float32) for k, v in trained.state_dict().items()}
    run = tmp_path / "run"
    fake_run(run, graph, {name: values[name] for name in shapes})
    (run / SOURCE_FILE).write_bytes(data)
    return run, trained.eval()


CASES = [(ConvNet, "dynamo", True), (ConvNet, "torchscript", True), (SeqMlp, "torchscript", False),
         (SeqMlp, "dynamo", False)]
IDS = ["convnet-dynamo-train", "convnet-torchscript-train", "mlp-torchscript-eval-folded", "mlp-dynamo-eval"]


@pytest.mark.parametrize("cls,exporter,train", CASES, ids=IDS)
def test_the_original_file_runs_the_trained_weights_like_pytorch(tmp_path, cls, exporter, train):
    run, trained = imported_run(tmp_path, cls, exporter, train)
    model, out_name = original_onnx(onnx, load_trained(run))
    path = tmp_path / "out.onnx"
    onnx.save_model(model, str(path))
    ops = [n.op_type for n in model.graph.node]
    assert "Dropout" not in ops
    for n in model.graph.node:
        if n.op_type == "BatchNormalization":
            assert len(n.output) == 1
            assert all(a.name != "training_mode" or a.i == 0 for a in n.attribute)
    assert [o.name for o in model.graph.output] == [out_name]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 1, 8, 8)).astype(np.float32)
        with torch.no_grad():
            want = trained(torch.from_numpy(x)).numpy()
        assert rel_err(ort_run(path, {model.graph.input[0].name: x}), want) <= TOL


@pytest.mark.parametrize("cls,exporter,train", CASES, ids=IDS)
def test_the_state_dict_loads_into_the_module_and_gives_its_outputs(tmp_path, cls, exporter, train):
    run, trained = imported_run(tmp_path, cls, exporter, train)
    out = tmp_path / "w.safetensors"
    assert main([str(run), "--state-dict", str(out)]) == 0
    fresh = cls()
    result = fresh.load_state_dict(st.load_file(str(out)), strict=False)
    assert result.unexpected_keys == []
    assert all(k.endswith("num_batches_tracked") for k in result.missing_keys), result.missing_keys
    fresh.eval()
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert rel_err(fresh(x).numpy(), trained(x).numpy()) <= TOL


def test_the_state_dict_names_and_layouts_are_pytorch_s(tmp_path):
    run, trained = imported_run(tmp_path, SeqMlp, "torchscript", False)
    tensors = state_dict(load_trained(run))
    assert set(tensors) == {"fc.weight", "fc.bias", "seq.weight", "seq.bias"}
    assert tensors["seq.weight"].shape == (5, 6)                # PyTorch's (out, in), not the file's copy
    np.testing.assert_array_equal(tensors["seq.weight"], trained.seq.weight.detach().numpy())


def test_an_imported_run_without_its_source_file_is_one_error(tmp_path, capsys):
    run, _ = imported_run(tmp_path, SeqMlp, "dynamo", False)
    (run / SOURCE_FILE).unlink()
    assert main([str(run), "--onnx", str(tmp_path / "m.onnx")]) == 2
    assert f"no {SOURCE_FILE}" in capsys.readouterr().err


# ------------------------------------------------------------------ round trips through the importer

class TiedLm(nn.Module):
    """Token ids -> embedding -> layer norm -> MLP -> an output head tied to the embedding."""

    def __init__(self, vocab: int = 11, dim: int = 8, seq: int = 5):
        super().__init__()
        self.seq = seq
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(seq, dim))
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids) + self.pos
        return self.head(h + nn.functional.gelu(self.fc(self.ln(h))))


def _export_any(module, exporter: str, train: bool, optimize: bool) -> bytes:
    key = (type(module), exporter, train, optimize)
    if key not in _EXPORTED:
        _EXPORTED[key] = _export_uncached(module, exporter, train, optimize)
    return _EXPORTED[key]


def _export_uncached(module, exporter: str, train: bool, optimize: bool) -> bytes:
    module.train(train)
    x = torch.randint(0, 11, (2, module.seq)) if isinstance(module, TiedLm) else torch.randn(2, 1, 8, 8)
    if exporter == "dynamo":
        prog = torch.onnx.export(module, (x,), dynamo=True, optimize=optimize, input_names=["x"],
                                 dynamic_shapes=({0: torch.export.Dim("batch")},))
        return prog.model_proto.SerializeToString()
    f = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(module, (x,), f, dynamo=False, input_names=["x"], training=mode,
                      do_constant_folding=optimize, dynamic_axes={"x": {0: "b"}})
    return f.getvalue()


ROUND_TRIPS = [(ConvNet, "dynamo", True, False), (ConvNet, "torchscript", True, False),
               (SeqMlp, "torchscript", False, True), (SeqMlp, "dynamo", False, True),
               (TiedLm, "torchscript", False, True), (TiedLm, "dynamo", True, False)]
ROUND_IDS = ["convnet-dynamo", "convnet-torchscript", "mlp-torchscript-folded", "mlp-dynamo-optimized",
             "tied-lm-torchscript-folded", "tied-lm-dynamo"]
# TorchScript's constant folding turns a Linear on 3-D input into MatMul(x, onnx::MatMul_N), the
# weight's transpose under no PyTorch name: the importer names it after the bias it is added to


def _tied_names(module) -> set:
    """State-dict names whose tensor is shared with another name (tied weights)."""
    by_tensor: dict = {}
    for name, t in module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), []).append(name)
    return {n for names in by_tensor.values() if len(names) > 1 for n in names}


def _trained_import(tmp_path, cls, exporter, train, optimize):
    """import_onnx, 'train' (perturb every parameter and running statistic), export both files.
    Returns (graph, params, module, ONNX path, safetensors path)."""
    onnx_import = pytest.importorskip("hpc_rlx.graph.onnx.importer")
    torch.manual_seed(0)
    module = cls()
    data = _export_any(module, exporter, train, optimize)
    imported = onnx_import.import_onnx(data, label_dtype="int64")
    graph = imported.graph
    rng = np.random.default_rng(3)
    params = {}
    for p in graph.params:
        value = imported.initial[p.name] + 0.1 * rng.standard_normal(p.shape)
        params[p.name] = (np.abs(value) + 0.5 if not p.trainable and "var" in p.name else value).astype(np.float32)
    run = tmp_path / "run"
    fake_run(run, graph, params)
    (run / SOURCE_FILE).write_bytes(data)
    out_onnx, out_sd = tmp_path / "m.onnx", tmp_path / "m.safetensors"
    assert main([str(run), "--onnx", str(out_onnx), "--state-dict", str(out_sd)]) == 0
    return graph, params, module, out_onnx, out_sd


def _inputs(cls, module, batch):
    rng = np.random.default_rng(batch)
    if cls is TiedLm:
        return rng.integers(0, 11, (batch, module.seq)).astype(np.int64)
    return rng.standard_normal((batch, 1, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("cls,exporter,train,optimize", ROUND_TRIPS, ids=ROUND_IDS)
def test_an_imported_model_s_onnx_export_runs_like_hpc_rlx(tmp_path, cls, exporter, train, optimize):
    from hpc_rlx.graph import Executor
    graph, params, module, out_onnx, _ = _trained_import(tmp_path, cls, exporter, train, optimize)
    meta = graph.meta["onnx"]
    ex = Executor(graph, np, "float32")
    for batch in (1, 4):
        x = _inputs(cls, module, batch)
        want = ex.run(params, {"x": x}, [meta["output_node"]])[meta["output_node"]]
        assert rel_err(ort_run(out_onnx, {meta["input"]: x}), want) <= TOL


@pytest.mark.parametrize("cls,exporter,train,optimize", [
    pytest.param(*case, id=name) for case, name in zip(ROUND_TRIPS, ROUND_IDS)])
def test_an_imported_model_s_state_dict_loads_into_pytorch(tmp_path, cls, exporter, train, optimize):
    from hpc_rlx.graph import Executor
    graph, params, module, _, out_sd = _trained_import(tmp_path, cls, exporter, train, optimize)
    node = graph.meta["onnx"]["output_node"]
    fresh = cls()
    result = fresh.load_state_dict(st.load_file(str(out_sd)), strict=False)
    assert result.unexpected_keys == []
    # a tied weight loads through the name the file holds; its other name is reported missing
    tied = _tied_names(fresh)
    assert all(k.endswith("num_batches_tracked") or k in tied for k in result.missing_keys), result.missing_keys
    x = _inputs(cls, module, 3)
    with torch.no_grad():
        got = fresh.eval()(torch.from_numpy(x)).numpy()
    want = Executor(graph, np, "float32").run(params, {"x": x}, [node])[node]
    assert rel_err(got, want) <= TOL


def test_tensors_in_an_external_data_file_are_read_from_the_run_directory(tmp_path, capsys):
    """torch's dynamo exporter keeps large weights in OUT.onnx.data beside the file: the trained
    ones are replaced anyway; the others are read from the run directory, or named in one error."""
    run, trained = imported_run(tmp_path, SeqMlp, "dynamo", False)
    proto = onnx.load(str(run / SOURCE_FILE))
    onnx.save_model(proto, str(run / SOURCE_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.data", size_threshold=0, convert_attribute=True)  # constants too
    out = tmp_path / "m.onnx"
    assert main([str(run), "--onnx", str(out)]) == 0
    x = np.random.default_rng(0).standard_normal((2, 1, 8, 8)).astype(np.float32)
    with torch.no_grad():
        assert rel_err(ort_run(out, {"x": x}), trained(torch.from_numpy(x)).numpy()) <= TOL
    (run / "weights.data").unlink()
    assert main([str(run), "--onnx", str(out)]) == 2
    err = capsys.readouterr().err
    assert "external file 'weights.data'" in err and len(err.strip().splitlines()) == 1


@pytest.mark.mpi
def test_an_onnx_model_trained_under_mpirun_exports_and_loads_back(tmp_path, digits_h5):
    """README's flow: torch.onnx.export, `mpirun -n 2 python -m hpc_rlx model=onnx`, then
    `python -m hpc_rlx.export`: PyTorch loads the state dict and ONNX Runtime runs the file, both
    like the trained model.h5 under hpc_rlx."""
    import subprocess

    from hpc_rlx.graph import Executor

    from tests.support.jobs import PYTHON, REPO, explain, mpi_env, train_job
    pytest.importorskip("hpc_rlx.graph.onnx.importer")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 4 * 4, 10))
    net.train()
    source = tmp_path / "net.onnx"
    torch.onnx.export(net, (torch.randn(2, 1, 8, 8),), str(source), input_names=["x"],
                      dynamic_shapes=({0: torch.export.Dim("batch")},), optimize=False)
    run = tmp_path / "run"
    proc = train_job(2, run, ["model=onnx", f"model.path={source}", "train.epochs=2", f"data.path={digits_h5}",
                              "report.tensorboard=false"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    out_onnx, out_sd = tmp_path / "trained.onnx", tmp_path / "trained.safetensors"
    cli = subprocess.run([PYTHON, "-m", "hpc_rlx.export", str(run), "--onnx", str(out_onnx),
                          "--state-dict", str(out_sd)], cwd=REPO, env=mpi_env(), capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 0, explain(cli)
    assert "checked in ONNX Runtime" in cli.stdout

    model = load_trained(run)
    node = model.graph.meta["onnx"]["output_node"]
    x = np.random.default_rng(0).standard_normal((5, 1, 8, 8)).astype(np.float32)
    want = Executor(model.graph, np, "float32").run(model.params, {"x": x}, [node])[node]
    assert rel_err(ort_run(out_onnx, {"x": x}), want) <= TOL
    result = net.load_state_dict(st.load_file(str(out_sd)), strict=False)
    assert result.unexpected_keys == [] and all(k.endswith("num_batches_tracked") for k in result.missing_keys)
    running = net[1].running_mean.detach().numpy()
    assert np.abs(running).max() > 0       # the trained running statistics came back
    with torch.no_grad():
        assert rel_err(net.eval()(torch.from_numpy(x)).numpy(), want) <= TOL
