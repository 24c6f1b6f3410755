"""`python -m hpc_rlx.export`: a run's model as an inference ONNX file (ONNX Runtime gives what
hpc_rlx's forward gives) and a safetensors state dict, for builder and hand-written graphs; the
command's errors. Imported ONNX models round-trip in tests/mpi/export/test_export_onnx.py."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpc_rlx.export.command import main
from hpc_rlx.export.safetensors_file import safetensors_bytes, write_safetensors
from hpc_rlx.export.trained import load_trained, model_output
from hpc_rlx.graph import OPS, Executor, GraphBuilder, build_model, init_params, register_op, unregister_op
from hpc_rlx.graph.params import ParamLayout

from tests.support.jobs import PYTHON, REPO, explain, mpi_env, train_job

TOL = 1e-5  # max|ort - hpc_rlx| / max|hpc_rlx|, float32


# ------------------------------------------------------------------ helpers

def random_params(graph, seed=0, dtype="float32") -> dict:
    """The graph's init, then noise on every value (zero-initialised biases would hide a
    wrongly wired bias)."""
    layout = ParamLayout(graph)
    flat = np.empty(layout.size, np.float64)
    init_params(graph, flat, seed=seed)
    flat += 0.05 * np.random.default_rng(seed + 1).standard_normal(layout.size)
    views = layout.views(flat.astype(dtype))
    for p in graph.buffers:  # running variances must stay positive
        views[p.name][...] = np.abs(views[p.name]) + 0.5
    return views


def fake_run(run_dir, graph, params) -> None:
    """A finished run directory as observe/outputs.py leaves it: graph.json and model.h5."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "graph.json").write_text(json.dumps(graph.to_dict(), indent=1))
    with h5py.File(run_dir / "model.h5", "w") as f:
        for name, arr in params.items():
            f.create_dataset(name, data=np.asarray(arr))
        f.attrs["graph_fingerprint"] = graph.fingerprint()
        f.attrs["graph"] = json.dumps(graph.to_dict())


def feeds_for(graph, batch, seed=0, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for s in graph.inputs:
        if s.name == "y":
            continue
        shape = tuple(batch if d is None else d for d in s.shape)
        if s.dtype == "int64":  # token ids
            vocab = graph.meta.get("args", {}).get("vocab_size", 5)
            out[s.name] = rng.integers(0, vocab, shape).astype(np.int64)
        else:
            out[s.name] = rng.standard_normal(shape).astype(dtype)
    return out


def ort_run(path, feeds) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})[0]


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def check_onnx_matches(tmp_path, graph, params=None, batches=(1, 3)):
    """Export ``graph`` with random weights; ORT must give Executor.run's model output."""
    pytest.importorskip("onnx")
    params = random_params(graph) if params is None else params
    run = tmp_path / "run"
    fake_run(run, graph, params)
    out = tmp_path / "model.onnx"
    assert main([str(run), "--onnx", str(out)]) == 0
    node = model_output(graph)
    ex = Executor(graph, np, "float32")
    for batch in batches:  # the batch dimension is dynamic
        feeds = feeds_for(graph, batch, seed=batch)
        want = ex.run(params, feeds, [node])[node]
        got = ort_run(out, feeds)
        assert got.shape == want.shape
        assert rel_err(got, want) <= TOL, (node, batch, rel_err(got, want))
    return out


# ------------------------------------------------------------------ builder models

@pytest.mark.parametrize("kwargs", [
    dict(input_shape=(1, 8, 8), hidden=[16, 12], activation="relu", dropout=0.2),
    dict(input_shape=(10,), hidden=[8], activation="gelu"),
    dict(input_shape=(10,), hidden=[8, 8], activation="tanh"),
    dict(input_shape=(10,), hidden=[], activation="sigmoid"),
    dict(input_shape=(10,), hidden=[8], activation="sigmoid", loss="mse", num_classes=3),
], ids=["relu-dropout", "gelu", "tanh", "linear", "mse"])
def test_mlp_onnx_matches_the_executor(tmp_path, kwargs):
    check_onnx_matches(tmp_path, build_model("mlp", **{"num_classes": 5, **kwargs}))


@pytest.mark.parametrize("kwargs", [
    dict(pool="max", hidden=16, dropout=0.3),
    dict(pool="avg", hidden=0, activation="gelu"),
    dict(pool="none", channels=[3], kernel=5, activation="tanh"),
], ids=["max", "avg", "none"])
def test_cnn_onnx_matches_the_executor(tmp_path, kwargs):
    check_onnx_matches(tmp_path, build_model("cnn", input_shape=(2, 8, 8), num_classes=4,
                                             **{"channels": [4, 6], "kernel": 3, **kwargs}))


@pytest.mark.parametrize("tie", [False, True])
def test_transformer_lm_onnx_matches_the_executor(tmp_path, tie):
    g = build_model("transformer_lm", vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=2,
                    d_ff=16, dropout=0.1, tie_embeddings=tie)
    path = check_onnx_matches(tmp_path, g)
    onnx = pytest.importorskip("onnx")
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["x"]     # the labels are not an input
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == 6
    assert not any(n.op_type == "Dropout" for n in model.graph.node)


def test_the_state_dict_holds_every_parameter_as_float32(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    g = build_model("cnn", input_shape=(1, 6, 6), num_classes=3, channels=[2], hidden=4)
    params = random_params(g, dtype="float64")                 # a float64 run
    fake_run(tmp_path / "run", g, params)
    out = tmp_path / "w.safetensors"
    assert main([str(tmp_path / "run"), "--state-dict", str(out)]) == 0
    loaded = st.load_file(str(out))
    assert set(loaded) == {p.name for p in g.params}
    for p in g.params:
        assert loaded[p.name].dtype == np.float32 and loaded[p.name].shape == tuple(p.shape)
        np.testing.assert_array_equal(loaded[p.name], params[p.name].astype(np.float32))
    raw = out.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0                                    # data starts aligned
    assert json.loads(raw[8:8 + n])["__metadata__"]["format"] == "pt"


def test_a_float64_run_exports_float32_that_matches_its_forward(tmp_path):
    pytest.importorskip("onnx")
    g = build_model("transformer_lm", vocab_size=7, seq_len=4, d_model=8, n_heads=2, n_layers=1, d_ff=8)
    params = random_params(g, dtype="float64")
    fake_run(tmp_path / "run", g, params)
    out = tmp_path / "m.onnx"
    assert main([str(tmp_path / "run"), "--onnx", str(out)]) == 0
    feeds = feeds_for(g, 2)
    want = Executor(g, np, "float64").run(params, feeds, ["logits"])["logits"]
    got = ort_run(out, feeds)
    assert got.dtype == np.float32 and rel_err(got, want) <= TOL


def test_safetensors_writer_is_read_by_the_reference_reader(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"scalar": np.float32(2.5), "empty": np.zeros((0, 3), np.float32),
               "ids": np.arange(6, dtype=np.int64).reshape(2, 3), "flags": np.array([True, False]),
               "wide": np.linspace(0, 1, 7), "big_endian": np.arange(4, dtype=">f4"),
               "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, {"k": 1})
    loaded = st.load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], np.asarray(value))
        assert loaded[name].shape == np.asarray(value).shape
    head, _ = safetensors_bytes({"a": np.ones(3, np.float16)})
    assert len(head) % 8 == 0


# ------------------------------------------------------------------ every op of the table

def _unary(op, **attrs):
    return lambda b, x: b.op(op, x, **attrs)


def _positive(op):
    return lambda b, x: b.op(op, b.op("exp", x))


def _with_param(op, shape, **attrs):
    def build(b, x):
        return b.op(op, x, b.param(f"{op}_p", shape, {"scheme": "uniform", "bound": 1.0}), **attrs)
    return build


def _const(values, dtype="float"):
    arr = np.asarray(values)
    return dict(value=arr.tolist(), dtype=dtype, shape=list(arr.shape))


OP_CASES = {
    "add": _with_param("add", [4]), "sub": _with_param("sub", [3, 1]), "mul": _with_param("mul", [4]),
    "div": lambda b, x: b.op("div", x, b.op("exp", b.param("d", [4], {"scheme": "uniform", "bound": 1.0}))),
    "matmul": _with_param("matmul", [4, 5]), "bias_add": _with_param("bias_add", [3], axis=1),
    "linear": lambda b, x: b.op("linear", x, b.param("w", [4, 2], {"scheme": "normal", "std": 1.0})),
    "scale": _unary("scale", value=-1.5), "relu": _unary("relu"), "tanh": _unary("tanh"),
    "sigmoid": _unary("sigmoid"), "gelu": _unary("gelu"), "gelu_none": _unary("gelu", approximate="none"),
    "dropout": _unary("dropout", p=0.5), "flatten": _unary("flatten"),
    "reshape": _unary("reshape", shape=[None, 2, -1]), "transpose": _unary("transpose", axes=[0, 2, 1]),
    "sum": _unary("sum", axes=[2]), "mean": _unary("mean", axes=[1], keepdims=True),
    "mean_all_but_batch": _unary("mean", axes=[1, 2]),
    "softmax": _unary("softmax", axis=1), "log_softmax": _unary("log_softmax", axis=-1),
    "layer_norm": lambda b, x: b.op("layer_norm", x, b.param("g", [4], {"scheme": "normal", "std": 1.0}),
                                    b.param("be", [4], {"scheme": "normal", "std": 1.0}), eps=1e-3),
    "causal_mask": lambda b, x: b.op("causal_mask", b.op("matmul", x, b.op("transpose", x, axes=[0, 2, 1])), fill=-50.0),
    "erf": _unary("erf"), "leaky_relu": _unary("leaky_relu", alpha=0.2), "neg": _unary("neg"),
    "sqrt": _positive("sqrt"), "exp": _unary("exp"), "log": _positive("log"), "reciprocal": _positive("reciprocal"),
    "pow": lambda b, x: b.op("pow", b.op("exp", x), b.param("e", [4], {"scheme": "uniform", "bound": 2.0})),
    "clip": _unary("clip", min=-0.5, max=0.7), "clip_min": _unary("clip", min=0.1),
    "where": lambda b, x: b.op("where", b.op("constant", **_const([1.0, 0.0, 0.0, 2.0])), x, b.op("neg", x)),
    "cast": lambda b, x: b.op("cast", b.op("cast", b.op("scale", x, value=3.0), to="int64"), to="float"),
    "constant": lambda b, x: b.op("add", x, b.op("constant", **_const([[0.5], [1.0], [-2.0]]))),
    "concat": lambda b, x: b.op("concat", x, b.op("neg", x), axis=-1),
    "slice": _unary("slice", starts=[2, 0], ends=[-1, 1000], axes=[2, 1], steps=[1, 2]),
    "gather": lambda b, x: b.op("gather", x, b.op("constant", **_const([[3, -1], [0, 0]], "int64")), axis=2),
    "expand": lambda b, x: b.op("expand", b.op("sum", x, axes=[2], keepdims=True), shape=[None, 3, 5]),
    "batch_norm": lambda b, x: b.op(
        "batch_norm", x, *[b.param(f"bn.{n}", [3], {"scheme": "normal", "std": 1.0}, trainable=n in ("w", "b"))
                           for n in ("w", "b", "mean", "var")], eps=1e-3),
    "linear_out_in": lambda b, x: b.op("linear", x, b.param("w", [5, 4], {"scheme": "normal", "std": 1.0}),
                                       b.param("bias", [5], {"scheme": "normal", "std": 1.0}), weight_layout="out_in"),
}
# cases on images (B, 4, 7, 7)
IMAGE_CASES = {
    "conv2d": lambda b, x: b.op("conv2d", x, b.param("k", [6, 2, 3, 3], {"scheme": "normal", "std": 0.3}),
                                b.param("kb", [6], {"scheme": "normal", "std": 1.0}), stride=2, padding=1,
                                dilation=2, groups=2),
    "conv2d_plain": lambda b, x: b.op("conv2d", x, b.param("k", [3, 4, 2, 3], {"scheme": "normal", "std": 0.3}),
                                      stride=[1, 2], padding=[0, 1]),
    "max_pool2d": lambda b, x: b.op("max_pool2d", x, kernel=2, stride=1, padding=1, dilation=2),
    "avg_pool2d": lambda b, x: b.op("avg_pool2d", x, kernel=3, stride=2, padding=1, count_include_pad=False),
    "avg_pool2d_pad": lambda b, x: b.op("avg_pool2d", x, kernel=3, stride=2, padding=1),
    "batch_norm_2d": lambda b, x: b.op(
        "batch_norm", x, *[b.param(f"bn.{n}", [4], {"scheme": "normal", "std": 1.0}, trainable=n in ("w", "b"))
                           for n in ("w", "b", "mean", "var")]),
}
OP_CASES.update(IMAGE_CASES)
_OP_OF = {"gelu_none": "gelu", "clip_min": "clip", "mean_all_but_batch": "mean", "linear_out_in": "linear",
          "conv2d_plain": "conv2d", "avg_pool2d_pad": "avg_pool2d", "batch_norm_2d": "batch_norm"}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_op_onnx_matches_the_executor(tmp_path, case):
    op = _OP_OF.get(case, case)
    if op not in OPS:
        pytest.skip(f"op {op!r} is not registered in this checkout")
    b = GraphBuilder(f"op_{case}")
    x = b.input("x", [None, 4, 7, 7] if case in IMAGE_CASES else [None, 3, 4])
    out = OP_CASES[case](b, x)
    b.output("loss", b.op("mean", out, name="loss_node"))
    try:
        g = b.build()
    except Exception as e:  # an op whose attributes this checkout does not know yet
        pytest.skip(f"{case}: {e}")
    check_onnx_matches(tmp_path, g)


# ------------------------------------------------------------------ the command's errors

def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m hpc_rlx.export: error: "), err
    return err[0]


@pytest.fixture
def mlp_run(tmp_path):
    g = build_model("mlp", input_shape=(6,), num_classes=3, hidden=[5])
    fake_run(tmp_path / "run", g, random_params(g))
    return tmp_path / "run"


def test_errors_are_one_line_and_exit_2(tmp_path, capsys, mlp_run):
    assert "nothing to write" in _error(capsys, [str(mlp_run)])
    assert "does not exist" in _error(capsys, [str(tmp_path / "nope"), "--state-dict", "a.st"])
    (tmp_path / "empty").mkdir()
    assert "no model.h5" in _error(capsys, [str(tmp_path / "empty"), "--state-dict", "a.st"])
    assert "unknown checkpoint 'newest'" in _error(
        capsys, [str(mlp_run), "--state-dict", "a.st", "--checkpoint", "newest"])
    assert "no valid checkpoint" in _error(capsys, [str(mlp_run), "--state-dict", "a.st", "--checkpoint", "latest"])
    assert "no best checkpoint" in _error(capsys, [str(mlp_run), "--state-dict", "a.st", "--checkpoint", "best"])
    assert "not a node" in _error(capsys, [str(mlp_run), "--onnx", str(tmp_path / "m.onnx"), "--output", "zz"])
    with pytest.raises(SystemExit) as info:                     # argparse's own usage errors
        main([str(mlp_run), "--bogus"])
    assert info.value.code == 2


def test_onnx_not_installed_is_one_clear_error(capsys, mlp_run, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx", None)              # import onnx raises ImportError
    assert "pip install onnx" in _error(capsys, [str(mlp_run), "--onnx", str(tmp_path / "m.onnx")])
    # the state dict needs no onnx
    assert main([str(mlp_run), "--state-dict", str(tmp_path / "w.safetensors")]) == 0


def test_an_op_without_translation_names_it(tmp_path, capsys):
    pytest.importorskip("onnx")
    register_op("cube_for_export_test", lambda xp, args, a, ctx: (args[0] ** 3, None),
                infer=lambda types, a: types[0], arity=(1, 1))
    try:
        b = GraphBuilder("custom")
        x = b.input("x", [None, 4])
        b.output("loss", b.op("mean", b.op("cube_for_export_test", x, name="cubed")))
        fake_run(tmp_path / "run", b.build(), {})
        msg = _error(capsys, [str(tmp_path / "run"), "--onnx", str(tmp_path / "m.onnx")])
        assert "cube_for_export_test" in msg and "no ONNX translation" in msg
    finally:
        unregister_op("cube_for_export_test")


def test_a_wrong_translation_is_caught_before_the_file_is_written(tmp_path, capsys, mlp_run, monkeypatch):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from hpc_rlx.export import onnx_ops
    monkeypatch.setitem(onnx_ops.TABLE, "relu", onnx_ops.TABLE["sigmoid"])
    out = tmp_path / "m.onnx"
    assert "differs from hpc_rlx's forward" in _error(capsys, [str(mlp_run), "--onnx", str(out)])
    assert not out.exists()
    assert main([str(mlp_run), "--onnx", str(out), "--no-check"]) == 0 and out.exists()


# ------------------------------------------------------------------ a real run

@pytest.mark.mpi
def test_a_trained_run_exports_its_model_and_its_checkpoints(tmp_path, digits_h5):
    """`mpirun -n 1 python -m hpc_rlx` (CNN on digits, a checkpoint every epoch), then the
    command as users run it: model.h5 by default, --checkpoint latest / best / a path."""
    pytest.importorskip("onnx")
    st = pytest.importorskip("safetensors.numpy")
    run = tmp_path / "run"
    proc = train_job(1, run, ["model=cnn", "model.channels=[4]", "model.hidden=8", "train.epochs=3",
                              "checkpoint.every_epochs=1", "checkpoint.keep_last=3", "report.tensorboard=false",
                              f"data.path={digits_h5}"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    cli = subprocess.run([PYTHON, "-m", "hpc_rlx.export", str(run), "--onnx", str(tmp_path / "m.onnx"),
                          "--state-dict", str(tmp_path / "m.safetensors")], cwd=REPO, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, explain(cli)
    final = load_trained(run)
    assert final.source == run / "model.h5"
    weights = st.load_file(str(tmp_path / "m.safetensors"))
    for name, value in final.params.items():
        np.testing.assert_array_equal(weights[name], value.astype(np.float32))
    ex = Executor(final.graph, np, "float32")
    feeds = feeds_for(final.graph, 7)
    want = ex.run(final.params, feeds, ["logits"])["logits"]
    assert rel_err(ort_run(tmp_path / "m.onnx", feeds), want) <= TOL

    ckpts = sorted((run / "checkpoints").glob("ckpt-*.h5"))
    assert len(ckpts) == 3, ckpts
    latest = load_trained(run, "latest")
    assert latest.source == ckpts[-1]
    for name, value in final.params.items():                  # the final save is the final model
        np.testing.assert_array_equal(latest.params[name], value)
    best_name = (run / "checkpoints" / "best").read_text().strip()
    assert load_trained(run, "best").source.name == best_name
    first = load_trained(run, ckpts[0].name)                   # a bare file name ...
    assert first.source == ckpts[0] and load_trained(run, str(ckpts[0])).source == ckpts[0]  # ... or a path
    assert any(not np.array_equal(first.params[n], final.params[n]) for n in final.params)
    out = tmp_path / "first.safetensors"
    assert main([str(run), "--checkpoint", str(ckpts[0]), "--state-dict", str(out)]) == 0
    np.testing.assert_array_equal(st.load_file(str(out))["conv0.weight"], first.params["conv0.weight"])
