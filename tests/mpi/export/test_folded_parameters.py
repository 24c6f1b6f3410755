"""Every PyTorch parameter comes back from a file dynamo's optimizer (optimize=True, its
default) rewrote: a part of a parameter folded into a new initializer (a position table read as
``pos[:, :t]``) trains as that part and goes back into the whole parameter with `export --base`;
the names of a tied parameter that the file holds once come back, each one."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpc_rlx.export.command import main
from hpc_rlx.export.trained import load_trained
from hpc_rlx.graph import Executor
from hpc_rlx.graph.onnx.importer import import_onnx

from tests.mpi.export.test_export import TOL, rel_err
from tests.support.jobs import explain, train_job

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
st = pytest.importorskip("safetensors.torch")
nn = torch.nn

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

VOCAB, SEQ, MAX_POS, CLASSES = 20, 6, 16, 4


class PositionTable(nn.Module):
    """Token embedding plus a learned position table read as ``pos[:, :t]``: with a static
    sequence length, dynamo's optimizer folds that slice into its own initializer."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 8)
        self.pos = nn.Parameter(torch.randn(1, MAX_POS, 8))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids):
        return self.head(torch.tanh(self.tokens(ids) + self.pos[:, :ids.shape[1]]).mean(dim=1))


class SharedEmbedding(nn.Module):
    """One embedding module under three paths, as BART holds its token embedding (``shared``,
    ``encoder.embed_tokens``, ``decoder.embed_tokens``); the forward never reads ``shared``."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, 8)
        self.encoder, self.decoder = nn.Module(), nn.Module()
        self.encoder.embed_tokens = self.decoder.embed_tokens = self.shared
        self.encoder.proj, self.head = nn.Linear(8, 8), nn.Linear(8, CLASSES)

    def forward(self, ids):
        memory = torch.tanh(self.encoder.proj(self.encoder.embed_tokens(ids))).mean(dim=1, keepdim=True)
        return self.head((self.decoder.embed_tokens(ids.flip(1)) + memory).mean(dim=1))


def _export(module, path):
    ids = torch.randint(0, VOCAB, (2, SEQ))
    torch.onnx.export(module, (ids,), str(path), input_names=["x"], dynamic_shapes=({0: torch.export.Dim("batch")},),
                      dynamo=True)  # optimize=True: the exporter's default
    return path


def _tokens(path):
    x = np.random.default_rng(0).integers(0, VOCAB, (32, SEQ)).astype(np.int64)
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, (x[:, 0] % CLASSES).astype(np.int64)
    return path


def _original(module, path):
    """The module's weights as a user keeps them (each tensor stored once, as save_file asks)."""
    st.save_file({k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}, str(path))
    return path


@pytest.mark.mpi
def test_a_sliced_position_table_trains_and_comes_back_whole(tmp_path, capsys):
    torch.manual_seed(0)
    module = PositionTable()
    source = _export(module, tmp_path / "pos.onnx")
    imported = import_onnx(source)
    slices = imported.graph.meta["onnx"]["slices"]
    assert list(slices.values()) == ["pos"], imported.graph.meta["onnx"]
    (part,) = slices
    assert any(f"'{part}' was computed from PyTorch parameter 'pos'" in w for w in imported.warnings), imported.warnings

    run = tmp_path / "run"
    proc = train_job(1, run, ["model=onnx", f"model.path={source}", f"data.path={_tokens(tmp_path / 't.h5')}",
                              "train.epochs=1", "train.batch_size=16", "checkpoint=off", "optim=adamw",
                              "optim.lr=0.05", "report.tensorboard=false"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    trained = load_trained(run)
    original = module.pos.detach().numpy()
    moved = trained.params[part].reshape(1, SEQ, 8)
    assert np.abs(moved - original[:, :SEQ]).max() > 1e-3  # the two steps changed the slice

    out, base = tmp_path / "w.safetensors", _original(module, tmp_path / "orig.safetensors")
    assert main([str(run), "--state-dict", str(out)]) == 0  # without --base: the part under the file's name
    assert part in st.load_file(str(out)) and "pos" not in st.load_file(str(out))
    assert main([str(run), "--state-dict", str(out), "--base", str(base)]) == 0
    state = st.load_file(str(out))
    fresh = PositionTable()
    fresh.load_state_dict(state, strict=True)  # every key, nothing unexpected
    pos = state["pos"].numpy()
    np.testing.assert_array_equal(pos[:, :SEQ], moved.astype(np.float32))   # the trained part, in place
    np.testing.assert_array_equal(pos[:, SEQ:], original[:, SEQ:])           # the rest as it was
    x = np.random.default_rng(1).integers(0, VOCAB, (5, SEQ)).astype(np.int64)
    node = trained.graph.meta["onnx"]["output_node"]
    want = Executor(trained.graph, np, "float32").run(trained.params, {"x": x}, [node])[node]
    with torch.no_grad():
        assert rel_err(fresh.eval()(torch.from_numpy(x)).numpy(), want) <= TOL

    # weights the file was not exported from: one error naming the parameter
    other = PositionTable()
    capsys.readouterr()
    assert main([str(run), "--state-dict", str(out), "--base", str(_original(other, tmp_path / "o.st"))]) == 2
    err = capsys.readouterr().err
    assert f"'{part}' are no part of --base's 'pos'" in err and len(err.strip().splitlines()) == 1


def test_every_name_of_a_tied_embedding_comes_back(tmp_path):
    """The exporter keeps one name of the shared embedding; the state dict holds all three, so
    `load_state_dict(strict=True)` takes it, with the trained values under each name."""
    from tests.mpi.export.test_export import fake_run
    from hpc_rlx.export.onnx_source import SOURCE_FILE

    torch.manual_seed(0)
    module = SharedEmbedding()
    source = _export(module, tmp_path / "tied.onnx")
    imported = import_onnx(source)
    aliases = imported.graph.meta["onnx"].get("aliases") or {}
    names = {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    assert len(aliases) == 2 and set(aliases) < names, imported.graph.meta["onnx"]
    assert not any("not in the file" in w for w in imported.warnings), imported.warnings
    rng = np.random.default_rng(3)
    params = {p.name: (imported.initial[p.name] + 0.1 * rng.standard_normal(p.shape)).astype(np.float32)
              for p in imported.graph.params}
    fake_run(tmp_path / "run", imported.graph, params)
    (tmp_path / "run" / SOURCE_FILE).write_bytes(source.read_bytes())
    out = tmp_path / "w.safetensors"
    assert main([str(tmp_path / "run"), "--state-dict", str(out)]) == 0
    state = st.load_file(str(out))
    assert names <= set(state)
    fresh = SharedEmbedding()
    fresh.load_state_dict(state, strict=True)
    held = next(iter(set(aliases.values())))
    for name in names:
        np.testing.assert_array_equal(state[name].numpy(), params[held])
