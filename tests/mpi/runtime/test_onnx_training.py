"""Training an ONNX file under real mpirun: a PyTorch model exported with both exporters trains
on ranks that have no PyTorch, 2 ranks equal 1 rank in float64, batch-norm running statistics
are averaged over ranks and lanes, and a bad file fails the same way on every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, mpirun, read_metrics, train_job

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
nn = torch.nn

pytestmark = pytest.mark.mpi

EQUIV = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
         "optim.lr=0.05", "checkpoint=off", "data.shuffle=false"]


class SmallBatchNormNet(nn.Module):
    """Convolution, batch norm, dropout and a linear head on 1x8x8 digits."""

    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


class SmallMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(torch.flatten(x, 1))))


def export(module: nn.Module, path: Path, exporter: str = "dynamo", train: bool = True) -> Path:
    """A digits-shaped (B, 1, 8, 8) export with a dynamic batch (tests/onnx_zoo.export)."""
    from tests.support import onnx_zoo
    torch.manual_seed(0)
    return onnx_zoo.export(module, torch.randn(2, 1, 8, 8), path, exporter, "train" if train else "eval",
                           optimize=False)


def small_mlp_job_files(tmp_path: Path, samples: int) -> tuple:
    """(module, its ONNX file, x, y, an HDF5 file of them): the seeded SmallMlp and digits-shaped
    float64 samples that the equivalence tests against torch.optim train on."""
    torch.manual_seed(0)
    module = SmallMlp()
    onnx_file = export(module, tmp_path / "mlp.onnx")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((samples, 1, 8, 8)), rng.integers(0, 10, samples)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, y
    return module, onnx_file, x, y, tmp_path / "d.h5"


def full_batch_steps(module, opt, x: np.ndarray, y: np.ndarray, steps: int) -> dict:
    """`steps` full-batch cross-entropy steps of `opt` on `module`; its parameters after them."""
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(xt), yt).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in module.named_parameters()}


def params_of(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(a[k]).max(), 1e-300)) for k in a)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_pytorch_model_with_batch_norm_trains_on_two_ranks(tmp_path, digits_h5, exporter):
    onnx_file = export(SmallBatchNormNet(), tmp_path / "net.onnx", exporter)
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}", "model=onnx", f"model.path={onnx_file}",
                              "train.epochs=4", "optim.lr=0.1"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(run)
    assert metrics[-1]["val_accuracy"] >= 0.85, metrics[-1]
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    # the source file rides along for the exporter, self-contained (dynamo keeps the weights in
    # a net.onnx.data beside the file); the running statistics trained and are saved
    import onnx
    from onnx import numpy_helper
    kept = onnx.load(str(run / "model.source.onnx"), load_external_data=False).graph.initializer
    assert not any(t.external_data for t in kept)
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(onnx_file)).graph.initializer}
    assert {t.name: numpy_helper.to_array(t).tolist() for t in kept} == \
        {k: v.tolist() for k, v in original.items()}
    params = params_of(run)
    assert {"bn.running_mean", "bn.running_var", "bn.weight", "conv.weight"} <= set(params)
    assert np.abs(params["bn.running_mean"]).max() > 0.01            # moved from its initial zeros
    assert not np.allclose(params["bn.running_var"], 1.0)


class StochasticDepthMlp(nn.Module):
    """A residual MLP whose residual branch is dropped per sample in training, as torchvision's
    StochasticDepth and timm's DropPath write it (exported as a uniform draw below keep)."""

    def __init__(self, p: float = 0.3):
        super().__init__()
        self.p = p
        self.fc1, self.branch, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(torch.flatten(x, 1)))
        y = torch.relu(self.branch(h))
        if self.training:
            keep = 1 - self.p
            y = y * torch.empty([h.shape[0], 1], dtype=h.dtype).bernoulli_(keep).div_(keep)
        return self.fc2(h + y)


def test_a_model_with_stochastic_depth_trains_on_two_ranks(tmp_path, digits_h5):
    onnx_file = export(StochasticDepthMlp(), tmp_path / "net.onnx")
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}", "model=onnx", f"model.path={onnx_file}",
                              "train.epochs=3", "optim.lr=0.1"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(run)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    assert metrics[-1]["val_accuracy"] >= 0.85, metrics[-1]


def test_two_ranks_equal_one_rank_in_float64(tmp_path, digits_h5):
    onnx_file = export(SmallMlp(), tmp_path / "mlp.onnx")
    base = EQUIV + [f"data.path={digits_h5}", "model=onnx", f"model.path={onnx_file}"]
    for name, n in (("w1", 1), ("w2", 2)):
        proc = train_job(n, tmp_path / name, base)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
    assert max_rel_diff(params_of(tmp_path / "w1"), params_of(tmp_path / "w2")) <= 1e-10


def test_batch_norm_statistics_of_two_ranks_equal_two_lanes_of_one_rank(tmp_path, digits_h5):
    """Each lane normalises with its own batch statistics (as DDP without SyncBN); the running
    statistics are the sample-weighted mean over lanes and ranks, so 2 ranks x 1 lane equal
    1 rank x 2 lanes that see the same micro-batches (a fixed split: comm.deterministic)."""
    onnx_file = export(SmallBatchNormNet(dropout=0.0), tmp_path / "bn.onnx", "torchscript")
    # leftover=drop: a partial last step would be split 10/10 over lanes but 12/8 over ranks
    base = EQUIV + [f"data.path={digits_h5}", "model=onnx", f"model.path={onnx_file}",
                    "comm.deterministic=true", "data.leftover=drop"]
    runs = {"w2": (2, []), "w1_lanes2": (1, ["device.cpu_lanes=2"])}
    for name, (n, extra) in runs.items():
        proc = train_job(n, tmp_path / name, base + extra)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
    a, b = params_of(tmp_path / "w2"), params_of(tmp_path / "w1_lanes2")
    assert max_rel_diff(a, b) <= 1e-10
    # and they differ from one lane of one rank: the statistics really are per lane
    proc = train_job(1, tmp_path / "w1", base)
    assert proc.returncode == 0, explain(proc)
    assert max_rel_diff(a, params_of(tmp_path / "w1")) > 1e-6


def test_an_unsupported_op_is_one_error_on_every_rank(tmp_path, digits_h5):
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 8, 8])
    node = helper.make_node("Hardmax", ["x"], ["y"], name="the_hardmax")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "model=onnx", f"model.path={path}"],
                     timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Hardmax" in out and "the_hardmax" in out, explain(proc)
    assert "Gemm" in out          # the list of supported ops
    assert "Traceback" not in out, explain(proc)


def test_a_malformed_file_is_one_clear_error(tmp_path, digits_h5):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"this is not a protobuf" * 10)
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "model=onnx", f"model.path={path}"],
                     timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "junk.onnx" in out and "Traceback" not in out, explain(proc)
    assert not (tmp_path / "run" / "model.h5").exists()


def test_summary_and_graph_name_the_onnx_parameters(tmp_path, digits_h5):
    onnx_file = export(SmallMlp(), tmp_path / "mlp.onnx", "torchscript", train=False)
    run = tmp_path / "run"
    proc = train_job(1, run, [f"data.path={digits_h5}", "model=onnx", f"model.path={onnx_file}",
                              "train.epochs=1"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    graph = json.loads((run / "graph.json").read_text())
    names = {p["name"] for p in graph["params"]}
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= names
    assert graph["meta"]["onnx"]["params"]


# ---------------------------------------------------------------------------- the model zoo

def _zoo_data(path: Path, name: str, rows: int = 96, classes: int | None = None) -> Path:
    """A learnable dataset shaped for zoo model `name`: image classes from a fixed random linear
    map of the pixels; for the language models, the next token is the current one plus 1; for
    a token classifier (`classes`), the last token's id modulo `classes`."""
    from tests.support.onnx_zoo import ZOO
    _, shape, vocab = ZOO[name]
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        if vocab and classes:
            x = rng.integers(0, vocab, (rows, *shape)).astype(np.int64)
            f["x"], f["y"] = x, (x[:, -1] % classes).astype(np.int64)
        elif vocab:
            x = rng.integers(0, vocab, (rows, *shape)).astype(np.int64)
            f["x"], f["y"] = x, (x + 1) % vocab
            f.attrs["num_classes"] = vocab
        else:
            x = rng.standard_normal((rows, *shape)).astype(np.float32)
            w = rng.standard_normal((int(np.prod(shape)), 10))
            f["x"], f["y"] = x, np.argmax(x.reshape(rows, -1) @ w, axis=1).astype(np.int64)
            f.attrs["num_classes"] = 10
    return path


def _zoo_file(tmp_path: Path, name: str, exporter: str = "dynamo") -> Path:
    from tests.support import onnx_zoo
    module = onnx_zoo.make(name)
    for m in module.modules():          # dropout off: ranks and lanes draw different masks
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return onnx_zoo.export(module, onnx_zoo.sample_input(name, 2), tmp_path / f"{name}.onnx", exporter,
                           "train", optimize=False)


# gpt_untied is left to the import and export tests: it trains the same ops as gpt but for the
# tied embedding, and untied linear layers train in vit and mixer
ZOO_NAMES = ["lenet", "resnet", "mobilenet", "vit", "gpt", "mixer"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_model_trains_on_two_ranks_and_batch_norm_equals_one_rank_in_float64(tmp_path, name):
    from tests.support import onnx_zoo
    onnx_file = _zoo_file(tmp_path, name)
    data = _zoo_data(tmp_path / "data.h5", name)
    common = [f"data.path={data}", "model=onnx", f"model.path={onnx_file}", "data.val_fraction=0.25",
              "train.batch_size=8", "data.leftover=drop", "checkpoint=off"]
    run = tmp_path / "train"
    proc = train_job(2, run, common + ["train.epochs=2", "optim=adamw", "optim.lr=0.003"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(run)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"], metrics

    # float64, with batch norm: 2 ranks equal 1 rank with 2 lanes that see the same micro-batches
    # (each lane normalises with its own statistics). A model whose samples never meet in the
    # forward pass reduces its gradients as any other graph does, which
    # test_two_ranks_equal_one_rank_in_float64 checks once.
    if not onnx_zoo.has_batch_norm(onnx_zoo.make(name)):
        return
    exact = common + ["train.dtype=float64", "train.epochs=1", "optim.lr=0.05", "data.shuffle=false",
                      "comm.deterministic=true"]
    for tag, n, extra in (("w2", 2, []), ("w1", 1, ["device.cpu_lanes=2"])):
        proc = train_job(n, tmp_path / tag, exact + extra, timeout=300)
        assert proc.returncode == 0, f"{tag}: " + explain(proc)
    assert max_rel_diff(params_of(tmp_path / "w2"), params_of(tmp_path / "w1")) <= 1e-10


# A sweep job trains a dozen files one after another and its test may export them first: on 2
# cores beside the other CI worker that is 3-5 minutes, past the suite's 300 s per test.
SWEEP_TEST_TIMEOUT = 900


def train_sweep(tmp_path: Path, files: list, overrides: list, timeout: float = 600) -> dict:
    """Every ONNX file of `files` trained in one `mpirun -n 2` job, a Hydra sweep over
    model.path (one point after another: one launch and one import of hpc_rlx for them all).
    Returns {file: its epoch metrics}; fails unless every point completed."""
    sweep = tmp_path / "sweep"
    proc = mpirun(2, ["-m", "hpc_rlx", "-m", "model=onnx", f"model.path={','.join(str(f) for f in files)}",
                      f"hydra.sweep.dir={sweep}", "report.plots=false", "checkpoint=off"] + overrides,
                  timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    out = {}
    for point in range(len(files)):
        given = (sweep / str(point) / "overrides.txt").read_text().split()
        path = next(o.split("=", 1)[1] for o in given if o.startswith("model.path="))
        out[path] = read_metrics(sweep / str(point))
    assert sorted(out) == sorted(str(f) for f in files), (sorted(out), files)
    return out


def assert_losses_fall(metrics: dict) -> None:
    for path, rows in metrics.items():
        assert rows and rows[-1]["train_loss"] < rows[0]["train_loss"], (Path(path).name, rows)


@pytest.mark.slow
@pytest.mark.timeout(SWEEP_TEST_TIMEOUT)
@pytest.mark.parametrize("names", [("lstm_text", "gru_text"), ("unet_transposed", "unet_interpolate")],
                         ids=["recurrent", "unet"])
def test_recurrent_and_unet_models_of_both_exporters_train_in_one_job(tmp_path, tmp_path_factory, names):
    """An LSTM and a bidirectional 2-layer GRU text classifier (backpropagation through time), or
    U-Nets upsampling by transposed convolutions and by Resize (bilinear, nearest) with F.pad:
    the dynamo files with the exporter's defaults and with optimize=False and the TorchScript
    training-form file of each (the files tests/unit/graph/test_onnx_import.py checks) train on
    two ranks, the loss falling, and the files of one model train alike (same weights, the same
    math)."""
    from tests.support import onnx_zoo
    from tests.support.shared import run_dir
    cache = run_dir(tmp_path_factory, "onnx-zoo")
    files = {(name, exporter, optimize): onnx_zoo.export_zoo_model(name, cache, exporter, "train",
                                                                   optimize=optimize)[1]
             for name in names for exporter, optimize in (("dynamo", True), ("dynamo", False), ("torchscript", True))}
    text = onnx_zoo.ZOO[names[0]][2] is not None
    data = _zoo_data(tmp_path / "data.h5", names[0], classes=10 if text else None)
    metrics = train_sweep(tmp_path, list(files.values()),
                          [f"data.path={data}", "data.val_fraction=0.25", "train.batch_size=8", "train.epochs=3",
                           "optim=adamw", f"optim.lr={0.01 if text else 0.003}"])
    assert_losses_fall(metrics)
    for name in names:
        dynamo, plain, torchscript = (metrics[str(files[name, e, o])][-1]["train_loss"]
                                      for e, o in (("dynamo", True), ("dynamo", False), ("torchscript", True)))
        assert dynamo == pytest.approx(torchscript, rel=1e-4) and plain == pytest.approx(torchscript, rel=1e-4), name


def test_running_statistics_resume_exactly_and_on_another_world_size(tmp_path, digits_h5):
    """Buffers ride in the checkpoint's parameter vector: a run stopped mid-epoch and resumed
    ends bitwise where the straight run ends, running statistics included; resuming on another
    world size continues from them (float64 sums in another order: equal to 1e-10)."""
    onnx_file = export(SmallBatchNormNet(dropout=0.0), tmp_path / "bn.onnx", "torchscript")
    base = [f"data.path={digits_h5}", "model=onnx", f"model.path={onnx_file}", "train.dtype=float64",
            "comm.deterministic=true", "train.epochs=2", "train.batch_size=32", "checkpoint.every_epochs=1"]
    straight = tmp_path / "straight"
    proc = train_job(2, straight, base)
    assert proc.returncode == 0, explain(proc)
    steps = int(re.search(r"(\d+) steps/epoch", proc.stdout).group(1))

    split = tmp_path / "split"
    proc = train_job(2, split, base + [f"train.max_steps={steps + steps // 2}"])
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, split, base)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, explain(proc)
    a, b = params_of(straight), params_of(split)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert not np.allclose(a["bn.running_mean"], 0.0)

    # 1 rank x 2 lanes resumes the 2-rank checkpoint: the same micro-batches, the same statistics
    other = tmp_path / "other"
    proc = train_job(2, other, base + [f"train.max_steps={steps + steps // 2}"])
    assert proc.returncode == 0, explain(proc)
    proc = train_job(1, other, base + ["device.cpu_lanes=2"])
    assert proc.returncode == 0 and "resumed from" in proc.stdout, explain(proc)
    assert max_rel_diff(a, params_of(other)) <= 1e-10


class TokenClassifier(nn.Module):
    """A 1,000-token embedding, mean-pooled, and a 10-class head: the vocabulary is not the classes."""

    def __init__(self):
        super().__init__()
        self.tokens, self.head = nn.Embedding(1000, 16), nn.Linear(16, 10)

    def forward(self, ids):
        return self.head(self.tokens(ids).mean(dim=1))


def test_a_token_classifier_takes_ids_up_to_its_embedding_size(tmp_path):
    """The ids are checked against the embedding's rows (1,000), not against the 10 classes; an
    id past the embedding is one error naming the embedding table."""
    from tests.support import onnx_zoo
    torch.manual_seed(0)
    onnx_file = onnx_zoo.export(TokenClassifier(), torch.randint(0, 1000, (2, 12)), tmp_path / "tok.onnx",
                                "dynamo", "train", optimize=False)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, (160, 12)).astype(np.int64)
    data = tmp_path / "tokens.h5"
    with h5py.File(data, "w") as f:
        f["x"], f["y"] = x, (x[:, 0] % 10).astype(np.int64)      # the class is in the first token
    common = [f"data.path={data}", "model=onnx", f"model.path={onnx_file}", "train.batch_size=16",
              "checkpoint=off", "optim=adamw", "optim.lr=0.01"]
    proc = train_job(2, tmp_path / "run", common + ["train.epochs=3"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"], metrics

    with h5py.File(data, "a") as f:
        f["x"][5, 3] = 1000
    proc = train_job(2, tmp_path / "bad", common + ["train.epochs=1"], timeout=180)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
    assert re.search(r"input token id 1000 at row 5 is outside the vocabulary \[0, 1000\) of the "
                     r"embedding '[^']*tokens[^']*'", proc.stderr), explain(proc)


# The Hugging Face models' files, each exported once per test run (tests/support/onnx_zoo.py's
# cache, shared with tests/unit/graph/test_hf_models.py): (exporter, optimize, weights). Dynamo
# with optimize=False keeps every parameter as PyTorch has it; TorchScript's training form; and
# dynamo's defaults on a fresh model (optimize=True merges its equal layer-norm initializers,
# which the import unties). PyTorch's exporters cannot write Llama with TorchScript nor T5 with
# dynamo.
HF_FORMS = {"dynamo": ("dynamo", False, "random"), "torchscript": ("torchscript", False, "random"),
            "dynamo-defaults": ("dynamo", True, "fresh")}
HF_CANNOT_EXPORT = {("llama", "torchscript"), ("t5", "dynamo"), ("t5", "dynamo-defaults"),
                    ("qwen2_cls", "torchscript"), ("mistral_cls", "torchscript")}
HF_HEADS = {"classifier": ["bert", "distilbert", "roberta", "bart", "t5", "qwen2_cls", "llama_cls", "mistral_cls",
                           "deberta"],
            "language_model": ["gpt2", "llama"]}
# the decoder classifiers and DeBERTa train here from their dynamo file only (CI time); every
# form of theirs is imported and checked against PyTorch and ONNX Runtime in tests/unit/graph
HF_ONE_FORM = {"qwen2_cls", "llama_cls", "mistral_cls", "deberta"}


@pytest.mark.slow
@pytest.mark.timeout(SWEEP_TEST_TIMEOUT)
@pytest.mark.parametrize("head", HF_HEADS)
def test_hugging_face_models_of_every_exporter_train_on_two_ranks(tmp_path, tmp_path_factory, head):
    """Built from their config classes (tests/support/hf_zoo.py), exported by each exporter that
    can write them (HF_FORMS), trained in one job per head on token ids from the whole
    1,000-token vocabulary (for BART and T5 each row ended by the end-of-sequence token, as a
    tokenizer writes it): a sequence classifier learns the class in the first token, a language
    model the next token; the loss falls for every file."""
    pytest.importorskip("transformers")
    from tests.support import onnx_zoo
    from tests.support.hf_zoo import END_OF_SEQUENCE, SEQ, VOCAB
    from tests.support.shared import run_dir
    cache = run_dir(tmp_path_factory, "onnx-zoo")
    files = [onnx_zoo.export_zoo_model(name, cache, exporter, "train", optimize=optimize, weights=weights)[1]
             for name in HF_HEADS[head] for form, (exporter, optimize, weights) in HF_FORMS.items()
             if (name, form) not in HF_CANNOT_EXPORT and (name not in HF_ONE_FORM or form == "dynamo")]
    # once in every row, as a tokenizer writes them: BART's end-of-sequence token (2) next to
    # last and T5's (1) last, neither anywhere else
    eos = sorted(END_OF_SEQUENCE.values())
    x = np.random.default_rng(0).integers(max(eos) + 1, VOCAB, (128, SEQ)).astype(np.int64)
    x[:, -len(eos):] = eos[::-1]
    data = tmp_path / "tokens.h5"
    with h5py.File(data, "w") as f:
        f["x"] = x
        f["y"] = (x + 1) % VOCAB if head == "language_model" else (x[:, 0] % 10).astype(np.int64)
    metrics = train_sweep(tmp_path, files, [f"data.path={data}", "train.batch_size=16", "train.epochs=3",
                                            "optim=adamw", "optim.lr=0.003"])
    assert_losses_fall(metrics)
