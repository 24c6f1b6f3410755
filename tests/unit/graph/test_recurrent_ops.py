"""The recurrent ops ``lstm``, ``gru`` and ``rnn`` (hpc_rlx/graph/ops/recurrent.py) and the
import of ONNX's LSTM, GRU and RNN: VJPs against finite differences in every direction with
lengths and initial states; forward and gradients against torch.nn.LSTM / GRU / RNN (float64
<= 1e-10, float32 <= 1e-5 relative to the largest value); forward against ONNX Runtime on
hand-built files for what PyTorch does not export (sequence_lens, reverse, layout=1,
linear_before_reset=0, other activations); PyTorch's exports of nn.LSTM / GRU / RNN with both
exporters. The zoo's LSTM and GRU text classifiers run in tests/unit/graph/test_onnx_import.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import OPS, Executor, ParamLayout
from hpc_rlx.graph.gradcheck import check_grads, check_op
from hpc_rlx.graph.shapes import ShapeError, TensorType

from tests.unit.graph.test_onnx_ops import rel, run_op

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support.onnx_checks import TOL, check_gradients  # noqa: E402

GATES = {"lstm": 4, "gru": 3, "rnn": 1}
STATES = {"lstm": 2, "gru": 1, "rnn": 1}
# PyTorch's gate blocks, as indices of ONNX's (LSTM i o f c -> i f g o, GRU z r h -> r z n)
TORCH_GATES = {"lstm": [0, 2, 3, 1], "gru": [1, 0, 2], "rnn": [0]}


def weights(kind, d, hidden, features, seed=0, scale=0.6):
    rng = np.random.default_rng(seed)
    g = GATES[kind] * hidden
    return (scale * rng.standard_normal((d, g, features)), scale * rng.standard_normal((d, g, hidden)),
            0.3 * rng.standard_normal((d, 2 * g)))


def args_for(kind, d=1, batch=3, steps=4, features=3, hidden=2, initial=False, lens=None, seed=0):
    rng = np.random.default_rng(seed + 100)
    args = [rng.standard_normal((batch, steps, features)), *weights(kind, d, hidden, features, seed)]
    if initial or lens is not None:
        args.append(0.5 * rng.standard_normal((batch, d, hidden)))
        if kind == "lstm":
            args.append(0.5 * rng.standard_normal((batch, d, hidden)))
    if lens is not None:
        args.append(np.asarray(lens, np.int64))
    return args


# ---------------------------------------------------------------- finite differences

FD_CASES = []
for _kind in ("lstm", "gru", "rnn"):
    for _direction, _d in (("forward", 1), ("reverse", 1), ("bidirectional", 2)):
        FD_CASES.append((_kind, {"direction": _direction}, dict(d=_d)))
        FD_CASES.append((_kind, {"direction": _direction}, dict(d=_d, lens=[4, 1, 3])))
    FD_CASES.append((_kind, {}, dict(initial=True)))
    FD_CASES.append((_kind, {}, dict(batch=2, steps=3)))  # no bias argument: args cut below
FD_CASES += [
    ("gru", {"linear_before_reset": True, "direction": "bidirectional"}, dict(d=2, lens=[2, 4, 3])),
    ("gru", {"linear_before_reset": True}, dict(initial=True)),
    ("rnn", {"activations": ["relu"]}, dict(initial=True)),
    ("rnn", {"activations": ["sigmoid", "relu"], "direction": "bidirectional"}, dict(d=2)),
    ("lstm", {"activations": ["tanh", "sigmoid", "relu"]}, dict(initial=True)),
    ("gru", {"activations": ["tanh", "sigmoid"]}, dict(lens=[3, 0, 4])),  # a row of length 0
]


@pytest.mark.parametrize("kind, attrs, shape", FD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FD_CASES)])
def test_vjp_matches_finite_differences(kind, attrs, shape):
    args = args_for(kind, **shape)
    if shape.get("steps") == 3:
        args = args[:3]  # x, w, r only
    report = check_op(kind, args, attrs)
    assert len(report) == sum(1 for a in args if np.asarray(a).dtype.kind == "f")


# ---------------------------------------------------------------- against PyTorch


def torch_packed(kind, nonlinearity="tanh", before_reset=True):
    """PyTorch's layer on ONNX-layout weights, its outputs packed as the IR op packs them."""
    nn = torch.nn

    def run(x, w, r, b, h0=None, c0=None):
        d, gh, features = w.shape
        hidden = r.shape[2]
        opts = dict(batch_first=True, bidirectional=d == 2, dtype=x.dtype)
        if kind == "rnn":
            module = nn.RNN(features, hidden, nonlinearity=nonlinearity, **opts)
        else:
            module = (nn.LSTM if kind == "lstm" else nn.GRU)(features, hidden, **opts)

        def to_torch(v):  # gate blocks along the first axis, PyTorch's order
            return torch.cat([v[j * hidden:(j + 1) * hidden] for j in TORCH_GATES[kind]])

        params = {}
        for k in range(d):
            sfx = "_reverse" if k else ""
            params[f"weight_ih_l0{sfx}"], params[f"weight_hh_l0{sfx}"] = to_torch(w[k]), to_torch(r[k])
            params[f"bias_ih_l0{sfx}"], params[f"bias_hh_l0{sfx}"] = to_torch(b[k, :gh]), to_torch(b[k, gh:])
        state = None
        if h0 is not None:
            h = h0.transpose(0, 1).contiguous()
            state = (h, c0.transpose(0, 1).contiguous()) if kind == "lstm" else h
        y, final = torch.func.functional_call(module, params, (x, state))
        finals = final if kind == "lstm" else (final,)
        n, steps = x.shape[:2]
        parts = [y.reshape(n, steps, d, hidden)] + [f.transpose(0, 1).unsqueeze(1) for f in finals]
        return torch.cat(parts, dim=1)

    return run


TORCH_CASES = [(kind, direction, initial, nl) for kind in ("lstm", "gru", "rnn")
               for direction in ("forward", "bidirectional") for initial in (False, True)
               for nl in (("tanh", "relu") if kind == "rnn" else ("tanh",))]


def _torch_case(kind, direction, initial, nl):
    d = 2 if direction == "bidirectional" else 1
    args = args_for(kind, d=d, batch=3, steps=5, features=4, hidden=3, initial=initial, seed=7)
    attrs = {"direction": direction}
    if kind == "gru":
        attrs["linear_before_reset"] = True
    if nl == "relu":
        attrs["activations"] = ["relu"] * d
    return args, attrs, torch_packed(kind, nl)


@pytest.mark.parametrize("kind, direction, initial, nl", TORCH_CASES)
def test_forward_and_gradients_match_torch_in_float64(kind, direction, initial, nl):
    args, attrs, fn = _torch_case(kind, direction, initial, nl)
    value, _, grads, w = run_op(kind, args, attrs)
    ts = [torch.tensor(a, requires_grad=True) for a in args]
    ref = fn(*ts)
    assert rel(value, ref.detach().numpy()) <= TOL["float64"]
    (ref * torch.from_numpy(w)).sum().backward()
    for i, t in enumerate(ts):
        assert rel(grads[i], t.grad.numpy()) <= TOL["float64"], (i, rel(grads[i], t.grad.numpy()))


def largest_rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("kind, direction, initial, nl", [c for c in TORCH_CASES if c[2]])
def test_forward_and_gradients_match_torch_in_float32(kind, direction, initial, nl):
    args, attrs, fn = _torch_case(kind, direction, initial, nl)
    value, _, grads, w = run_op(kind, args, attrs, dtype="float32")
    assert value.dtype == np.float32
    ts = [torch.tensor(a, dtype=torch.float32, requires_grad=True) for a in args]
    ref = fn(*ts)
    assert largest_rel(value, ref.detach().numpy()) <= 1e-5
    (ref * torch.from_numpy(w.astype(np.float32))).sum().backward()
    for i, t in enumerate(ts):
        assert largest_rel(grads[i], t.grad.numpy()) <= 1e-5, i


# ---------------------------------------------------------------- sequence lengths


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_a_row_with_a_length_is_that_row_cut_to_its_length(kind, direction):
    """Outputs past a row's length are zero, and everything else (outputs, final states, a
    reverse direction started at the row's last valid step) is the op on the row cut short."""
    d = 2 if direction == "bidirectional" else 1
    lens = [5, 2, 3]
    args = args_for(kind, d=d, batch=3, steps=5, lens=lens, seed=3)
    value = run_op(kind, args, {"direction": direction})[0]
    k = len(args) - 1
    for row, length in enumerate(lens):
        alone = [a[row:row + 1, :length] if i == 0 else (a[row:row + 1] if i in (4, 5) and i < k else a)
                 for i, a in enumerate(args[:k])]
        cut = run_op(kind, alone, {"direction": direction})[0][0]
        np.testing.assert_allclose(value[row, :length], cut[:length], rtol=0, atol=1e-13)
        np.testing.assert_array_equal(value[row, length:5], 0.0)
        np.testing.assert_allclose(value[row, 5:], cut[length:], rtol=0, atol=1e-13)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_lengths_above_the_sequence_count_as_full_and_a_zero_length_ends_in_zeros(direction):
    """ONNX Runtime's rule for a row of length 0: zero outputs and zero final states (not the
    initial ones), also in its float32 kernels."""
    args = args_for("lstm", batch=3, steps=3, lens=[7, 0, 2], seed=4)
    attrs = {"direction": direction}
    value = run_op("lstm", args, attrs)[0]
    full = run_op("lstm", args[:-1], attrs)[0]
    np.testing.assert_allclose(value[0], full[0], rtol=0, atol=1e-14)
    np.testing.assert_array_equal(value[1], 0.0)
    model, (w, r, b) = onnx_file("lstm", direction, 0, 3, 3, 3, 2, True, True)
    x, h0, c0 = (a.astype(np.float32) for a in (args[0], args[4], args[5]))
    feeds = {"X": x.transpose(1, 0, 2), "lens": np.array([3, 0, 2], np.int32), "h0": h0.transpose(1, 0, 2),
             "c0": c0.transpose(1, 0, 2)}
    refs = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    ours = run_op("lstm", [x, w, r, b, h0, c0, args[6]], attrs, dtype="float32")[0]
    assert largest_rel(ours[:, :3].transpose(1, 2, 0, 3), refs[0]) <= 1e-5
    assert largest_rel(ours[:, 3].transpose(1, 0, 2), refs[1]) <= 1e-5
    assert largest_rel(ours[:, 4].transpose(1, 0, 2), refs[2]) <= 1e-5


# ---------------------------------------------------------------- against ONNX Runtime


ONNX_NAME = {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN"}


def onnx_file(kind, direction, layout, batch, steps, features, hidden, with_lens, with_initial, attrs=None):
    """One ONNX recurrent node; X, sequence_lens, initial_h (and initial_c) are graph inputs."""
    d = 2 if direction == "bidirectional" else 1
    w, r, b = weights(kind, d, hidden, features, seed=9)
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for v, n in ((w, "W"), (r, "R"), (b, "B"))]
    x_shape = [batch, steps, features] if layout else [steps, batch, features]
    s_shape = [batch, d, hidden] if layout else [d, batch, hidden]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    names = ["X", "W", "R", "B", "", "", ""][:7 if kind == "lstm" else 6]
    if with_lens:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [batch]))
        names[4] = "lens"
    if with_initial:
        for k, n in ((5, "h0"), (6, "c0"))[:2 if kind == "lstm" else 1]:
            inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, s_shape))
            names[k] = n
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:STATES[kind] + 1]
    extra = {"layout": 1} if layout else {}  # layout came in opset 14; 0 is its default
    node = helper.make_node(ONNX_NAME[kind], names, outs, hidden_size=hidden, direction=direction,
                            **extra, **(attrs or {}))
    y_shape = [batch, steps, d, hidden] if layout else [steps, d, batch, hidden]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else s_shape) for o in outs]
    graph = helper.make_graph([node], "rec", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    onnx.checker.check_model(model)
    return model, (w, r, b)


ORT_CASES = [
    ("lstm", "forward", 0, True, True, {}),
    ("lstm", "reverse", 0, True, True, {}),
    ("lstm", "bidirectional", 1, True, False, {}),
    ("lstm", "bidirectional", 1, False, False, {}),
    ("lstm", "reverse", 1, False, True, {"activations": ["Tanh", "Sigmoid", "Relu"]}),
    ("gru", "forward", 0, True, True, {}),  # linear_before_reset=0, ONNX's default
    ("gru", "bidirectional", 0, True, True, {"linear_before_reset": 1}),
    ("gru", "reverse", 1, True, False, {"linear_before_reset": 0}),
    ("rnn", "bidirectional", 0, True, True, {"activations": ["Relu", "Tanh"]}),
    ("rnn", "reverse", 1, True, True, {}),
    ("rnn", "forward", 0, False, False, {"activations": ["Sigmoid"]}),
]


@pytest.mark.parametrize("kind, direction, layout, with_lens, with_initial, attrs", ORT_CASES)
def test_forward_matches_onnxruntime_on_hand_built_files(kind, direction, layout, with_lens, with_initial, attrs):
    """ONNX Runtime's CPU kernels take layout 0 only: a layout-1 case compares the import of its
    layout-1 file with ONNX Runtime on the layout-0 twin."""
    batch, steps, features, hidden = 4, 5, 3, 4
    d = 2 if direction == "bidirectional" else 1
    model, (w, r, b) = onnx_file(kind, direction, 0, batch, steps, features, hidden, with_lens,
                                 with_initial, attrs)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch, steps, features)).astype(np.float32)
    lens = np.array([5, 2, 4, 1], np.int32)
    h0, c0 = (0.5 * rng.standard_normal((batch, d, hidden)).astype(np.float32) for _ in range(2))
    feeds = {"X": x.transpose(1, 0, 2)}
    args = [x, w, r, b]
    if with_lens or with_initial:
        args.append(h0 if with_initial else np.zeros_like(h0))
        if kind == "lstm":
            args.append(c0 if with_initial else np.zeros_like(c0))
    if with_lens:
        feeds["lens"] = lens
        args.append(lens.astype(np.int64))
    if with_initial:
        feeds["h0"] = h0.transpose(1, 0, 2)
        if kind == "lstm":
            feeds["c0"] = c0.transpose(1, 0, 2)
    refs = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    ir_attrs = {"direction": direction}
    if "activations" in attrs:
        ir_attrs["activations"] = [a.lower() for a in attrs["activations"]]
    if kind == "gru":
        ir_attrs["linear_before_reset"] = bool(attrs.get("linear_before_reset", 0))
    packed = run_op(kind, [a.astype(np.float64) if a.dtype.kind == "f" else a for a in args], ir_attrs)[0]
    assert largest_rel(packed[:, :steps].transpose(1, 2, 0, 3), refs[0]) <= 1e-5
    for k, ref in enumerate(refs[1:]):
        assert largest_rel(packed[:, steps + k].transpose(1, 0, 2), ref) <= 1e-5

    if layout == 1 and not (with_lens or with_initial):  # X is then the file's only data input
        batch_first, _ = onnx_file(kind, direction, 1, batch, steps, features, hidden, False, False, attrs)
        ours = _run_imported(import_onnx(batch_first.SerializeToString()), x)
        assert largest_rel(ours, refs[0].transpose(2, 0, 1, 3)) <= 1e-5


def _run_imported(imported, x, dtype="float64"):
    g = imported.graph
    layout = ParamLayout(g)
    flat = np.zeros(layout.size, dtype)
    layout.pack(imported.initial, flat)
    node = g.meta["onnx"]["output_node"]
    return Executor(g, np, dtype).run(layout.views(flat), {"x": x.astype(dtype)}, [node])[node]


def padded_file(kind, direction):
    """Tokens padded with zeros, as a text model feeds an LSTM: x (B, T, I) with the rows' lengths
    read from the data (features all zero = padding), the layer in layout 0 between transposes,
    and every output in one (B, ...) tensor."""
    batch, steps, features, hidden = "batch", 5, 3, 2
    d = 2 if direction == "bidirectional" else 1
    w, r, b = weights(kind, d, hidden, features, seed=5)
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for v, n in ((w, "W"), (r, "R"), (b, "B"))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for v, n in (([2], "axis2"), ([1], "axis1"))]
    inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    outs = ["Y", "Y_h", "Y_c"][:STATES[kind] + 1]
    names = ["xt", "W", "R", "B", "lens"]
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["ax"]),
        helper.make_node("ReduceSum", ["ax", "axis2"], ["mass"], keepdims=0),
        helper.make_node("Greater", ["mass", "zero"], ["real"]),
        helper.make_node("Cast", ["real"], ["realf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["realf", "axis1"], ["count"], keepdims=0),
        helper.make_node("Cast", ["count"], ["lens"], to=TensorProto.INT32),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
        helper.make_node(ONNX_NAME[kind], names, outs, hidden_size=hidden, direction=direction),
        helper.make_node("Transpose", ["Y"], ["Yb"], perm=[2, 0, 1, 3]),
        helper.make_node("Flatten", ["Yb"], ["Yf"], axis=1),
    ]
    flat = ["Yf"]
    for o in outs[1:]:
        nodes += [helper.make_node("Transpose", [o], [o + "b"], perm=[1, 0, 2]),
                  helper.make_node("Flatten", [o + "b"], [o + "f"], axis=1)]
        flat.append(o + "f")
    nodes.append(helper.make_node("Concat", flat, ["out"], axis=1))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, steps, features])]
    width = (steps + STATES[kind]) * d * hidden
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, width])]
    model = helper.make_model(helper.make_graph(nodes, "padded", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 14)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


def padded_batch(batch=4, steps=5, features=3, lengths=(5, 2, 4, 1)):
    x = np.random.default_rng(6).standard_normal((batch, steps, features)).astype(np.float32)
    for row, length in enumerate(lengths):
        x[row, length:] = 0.0
    return x


@pytest.mark.parametrize("kind, direction", [("lstm", "reverse"), ("gru", "bidirectional"), ("rnn", "forward")])
def test_an_import_with_lengths_from_the_data_matches_onnxruntime_and_finite_differences(kind, direction):
    data = padded_file(kind, direction)
    imported = import_onnx(data, loss="mse", label_dtype="float")
    x = padded_batch()
    ref = ort.InferenceSession(data).run(None, {"x": x})[0]
    assert largest_rel(_run_imported(imported, x, "float32"), ref) <= 1e-5
    g = imported.graph
    y = np.random.default_rng(1).standard_normal((x.shape[0], *g.input("y").shape[1:]))
    report = check_grads(g, imported.initial, {"x": x.astype(np.float64), "y": y})
    assert set(report) == {p.name for p in g.params if p.trainable} and len(report) == 3


# ---------------------------------------------------------------- PyTorch's exports


class Recurrent(torch.nn.Module):
    """x (B, T, I) through nn.LSTM / GRU / RNN; time-first layers get the transposed sequence;
    initial states, when passed, are computed from the data (so gradients reach them)."""

    def __init__(self, kind, layers, bidirectional, batch_first, initial):
        super().__init__()
        nn = torch.nn
        opts = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        if kind.startswith("rnn"):
            self.rnn = nn.RNN(3, 4, nonlinearity="relu" if kind == "rnn_relu" else "tanh", **opts)
        else:
            self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(3, 4, **opts)
        self.states = layers * (2 if bidirectional else 1)
        self.init = nn.Linear(3, self.states * 4) if initial else None
        self.lstm, self.batch_first = kind == "lstm", batch_first

    def forward(self, x):
        state = None
        if self.init is not None:
            h = torch.tanh(self.init(x.mean(1))).reshape(x.shape[0], self.states, 4).transpose(0, 1).contiguous()
            state = (h, 0.5 * h) if self.lstm else h
        y, _ = self.rnn(x if self.batch_first else x.transpose(0, 1), state)
        y = y if self.batch_first else y.transpose(0, 1)
        return y.reshape(x.shape[0], -1)


EXPORT_CASES = [(kind, layers, bidir, bf, init, exporter)
                for kind in ("lstm", "gru", "rnn", "rnn_relu")
                for (layers, bidir, bf, init) in ((1, False, True, False), (2, True, False, True))
                for exporter in ("torchscript", "dynamo")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tests.support import onnx_zoo as zoo

    cache, files = {}, tmp_path_factory.mktemp("recurrent")

    def get(case):
        if case not in cache:
            module = zoo.randomize(Recurrent(*case[:5]), seed=2)
            path = files / ("-".join(map(str, case)) + ".onnx")
            x = torch.randn(3, 6, 3, generator=torch.Generator().manual_seed(1))
            zoo.export(module, x, path, case[5], "train")
            cache[case] = (module, path, import_onnx(path))
        return cache[case]

    return get


@pytest.mark.parametrize("case", EXPORT_CASES, ids=["-".join(map(str, c)) for c in EXPORT_CASES])
def test_exported_layers_match_onnxruntime_pytorch_and_its_gradients(exported, case, monkeypatch):
    from tests.support import onnx_zoo as zoo
    from tests.support.onnx_checks import ours_forward, torch_module

    module, path, imported = exported(case)
    ops = {n.op for n in imported.graph.nodes}
    name = {"rnn_relu": "rnn"}.get(case[0], case[0])
    # dynamo writes RNN as its steps (MatMul, Add, Tanh/Relu); LSTM and GRU as ONNX's ops
    assert (name in ops) == (case[5] == "torchscript" or name != "rnn")
    x = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(2))
    ours = ours_forward(imported, x, train=False)
    assert largest_rel(ours, ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})[0]) <= TOL["float32"]
    with torch.no_grad():
        assert largest_rel(ours, torch_module(module, False)(x).numpy()) <= TOL["float32"]
    # check_gradients draws its batch from a zoo entry: this module's
    monkeypatch.setitem(zoo.ZOO, "recurrent_case", (lambda: module, (6, 3), None))
    for dtype in ("float32", "float64"):
        check_gradients(module, imported, "recurrent_case", True, dtype)


# ---------------------------------------------------------------- refusals and type rules


def test_attributes_the_ir_lacks_are_refused_with_the_node_named():
    base = dict(kind="lstm", direction="forward", layout=0, batch=2, steps=3, features=2, hidden=2,
                with_lens=False, with_initial=False)
    for attrs, message in (({"clip": 3.0}, "clip"), ({"input_forget": 1}, "input_forget"),
                           ({"activations": ["HardSigmoid", "Tanh", "Tanh"]}, "hardsigmoid"),
                           ({"activation_alpha": [0.5]}, "activation_alpha")):
        model, _ = onnx_file(**base, attrs=attrs)
        with pytest.raises(GraphError, match=f"(?i)LSTM.*{message}"):
            import_onnx(_batch_first_input(model))
    model, _ = onnx_file(**base)
    p = numpy_helper.from_array(np.ones((1, 6), np.float32), "P")
    model.graph.initializer.append(p)
    model.graph.node[0].input.extend(["", "", "", "P"][len(model.graph.node[0].input) - 4:])
    with pytest.raises(GraphError, match="peepholes"):
        import_onnx(_batch_first_input(model))


def _batch_first_input(model):
    """The file with a batch-first data input x transposed into its layout-0 X."""
    graph = model.graph
    x = graph.input[0]
    dims = [d.dim_value for d in x.type.tensor_type.shape.dim]
    new_x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dims[0], dims[2]])
    del graph.input[:]
    graph.input.append(new_x)
    graph.node.insert(0, helper.make_node("Transpose", ["x"], ["X"], perm=[1, 0, 2]))
    return model.SerializeToString()


def test_type_rules_name_what_is_wrong():
    lstm = OPS["lstm"]
    a = lstm.normalise({"direction": "bidirectional"})
    x = TensorType((None, 5, 3), "float")
    w, r = TensorType((2, 8, 3), "float"), TensorType((2, 8, 2), "float")
    assert lstm.infer([x, w, r], a).shape == (None, 7, 2, 2)
    assert lstm.infer([x, w, r, TensorType((2, 16), "float"), TensorType((None, 2, 2), "float"),
                       TensorType((None, 2, 2), "float"), TensorType((None,), "int64")], a).shape == (None, 7, 2, 2)
    with pytest.raises(ShapeError, match="r must be"):
        lstm.infer([x, w, TensorType((1, 8, 2), "float")], a)
    with pytest.raises(ShapeError, match="w must be"):
        lstm.infer([x, TensorType((2, 8, 4), "float"), r], a)
    with pytest.raises(ShapeError, match="h0 must be"):
        lstm.infer([x, w, r, TensorType((2, 16), "float"), TensorType((None, 1, 2), "float")], a)
    with pytest.raises(ShapeError, match="lens must be int64"):
        lstm.infer([x, w, r, TensorType((2, 16), "float"), TensorType((None, 2, 2), "float"),
                    TensorType((None, 2, 2), "float"), TensorType((None,), "float")], a)
    with pytest.raises(ShapeError, match="direction"):
        lstm.normalise({"direction": "both"})
    with pytest.raises(ShapeError, match="activations"):
        OPS["gru"].normalise({"activations": ["sigmoid"]})
    assert OPS["rnn"].normalise({"direction": "bidirectional"})["activations"] == ["tanh", "tanh"]
