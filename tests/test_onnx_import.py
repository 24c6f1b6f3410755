"""ONNX import: the zoo of tests/onnx_zoo.py exported by both PyTorch exporters in both modes
imports to a graph whose forward matches ONNX Runtime and PyTorch, and whose loss gradients
match PyTorch autograd on the original module; plus the import's errors and special forms.

Relative errors are max|ours - reference| / max|reference|: <= 1e-5 in float32, <= 1e-10 in
float64 (a float32 file imported, then run in float64 with the same weights against
module.double()).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hpc_rlx.errors import GraphError
from hpc_rlx.graph import Executor, Graph, ParamLayout

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from hpc_rlx.graph.onnx_import import ONNX_OPS, import_onnx  # noqa: E402

from . import onnx_zoo as zoo  # noqa: E402

F = torch.nn.functional
TOL = {"float32": 1e-5, "float64": 1e-10}
BATCH = 4
CASES = [(m, e, mode) for m in zoo.ZOO for e in ("dynamo", "torchscript") for mode in ("train", "eval")]
# The default suite: every model with the quick TorchScript exporter, and the dynamo exporter on
# the models whose import needs the most (batch-norm metadata, folded transposes, attention).
FAST = {c for c in CASES if c[1] == "torchscript"} | {("mobilenet", "dynamo", "train"), ("vit", "dynamo", "eval"),
                                                       ("gpt", "dynamo", "train")}


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
    gradients with one by one (see test_fused_batch_norm_trains_as_a_fixed_scale_and_shift)."""
    cache = {}

    def get(name, exporter, mode):
        key = (name, exporter, mode)
        if key not in cache:
            module = zoo.make(name)
            path = tmp_path_factory.mktemp("onnx") / f"{name}_{exporter}_{mode}.onnx"
            optimize = not zoo.has_batch_norm(module)
            zoo.export(module, zoo.sample_input(name, 3, seed=1), path, exporter, mode, optimize)
            cache[key] = (module, path, import_onnx(path))
        return cache[key]

    return get


def rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-300))


def without_dropout(g: Graph) -> Graph:
    """The graph with every dropout at p=0: the masks are ours, PyTorch's differ."""
    d = g.to_dict()
    for n in d["nodes"]:
        if n["op"] == "dropout":
            n["attrs"]["p"] = 0.0
    return Graph.from_dict(d)


def param_views(imported, g: Graph, dtype: str):
    layout = ParamLayout(g)
    flat = np.zeros(layout.size, dtype)
    layout.pack({k: v.astype(dtype) for k, v in imported.initial.items()}, flat)
    return layout, flat


def feed(x, dtype):
    return x.numpy() if x.dtype == torch.int64 else x.numpy().astype(dtype)


def ours_forward(imported, x, train: bool, dtype="float32"):
    g = without_dropout(imported.graph)
    layout, flat = param_views(imported, g, dtype)
    node = g.meta["onnx"]["output_node"]
    return Executor(g, np, dtype).run(layout.views(flat), {"x": feed(x, dtype)}, [node], train=train, seed=0)[node]


def torch_module(module, train: bool, dtype=torch.float32):
    """A copy in the given mode, dropout off (its masks are PyTorch's own)."""
    m = copy.deepcopy(module).to(dtype)
    for sub in m.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    return m.train(train)


def trains_like_module_train(imported, mode: str) -> bool:
    """Whether training the import matches module.train(): a training-mode export whose batch
    norm and dropout the import kept in their training form. Otherwise (an eval export, or
    batch norm fused into the convolutions) the import trains like module.eval()."""
    return mode == "train" and imported.graph.meta["onnx"]["form"] == "training"


def ort_batch_stats(path) -> bool:
    """Whether ONNX Runtime normalises with batch statistics: a BatchNormalization node in
    training mode (TorchScript's training-form export)."""
    model = onnx.load(str(path))
    return any(n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in n.attribute)
               for n in model.graph.node)


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


def _match(imported, module) -> dict:
    """IR parameter -> (PyTorch parameter name, transposed?), found by value (the zoo's values
    are distinct)."""
    found = {}
    named = dict(module.named_parameters())
    for ir, value in imported.initial.items():
        v = value.astype(np.float32)
        for tname, p in named.items():
            t = p.detach().numpy()
            if t.shape == v.shape and np.array_equal(t, v):
                found[ir] = (tname, False)
            elif v.ndim == 2 and t.shape == v.shape[::-1] and np.array_equal(t, v.T):
                found[ir] = (tname, True)
    return found


def _buffer_updates(imported, g, layout, gflat, module_before, module_after, tol):
    """The running statistics our batch norm emitted, applied with its momentum, equal the
    buffers PyTorch's training forward left behind."""
    buffers_before = {k: v.detach().numpy() for k, v in module_before.named_buffers() if v.is_floating_point()}
    buffers_after = dict(module_after.named_buffers())
    momentum = g.buffer_momentum()
    grads = layout.views(gflat)
    for b in g.buffers:
        start = imported.initial[b.name]
        tname = next(k for k, v in buffers_before.items() if np.array_equal(v, start.astype(np.float32)))
        updated = start + momentum[b.name] * (grads[b.name] - start)
        assert rel(updated, buffers_after[tname].detach().numpy()) <= tol, b.name


@pytest.mark.parametrize("name, exporter, mode, dtype", _cases(("float32", "float64")))
def test_gradients_match_pytorch(exported, name, exporter, mode, dtype):
    module, path, imported = exported(name, exporter, mode)
    g = without_dropout(imported.graph)
    train = trains_like_module_train(imported, mode)
    x = zoo.sample_input(name, BATCH, seed=3)
    classes = g.types[g.meta["onnx"]["output_node"]].shape[-1]
    y = torch.randint(0, classes, tuple(d or BATCH for d in g.input("y").shape), generator=torch.Generator().manual_seed(4))

    layout, flat = param_views(imported, g, dtype)
    gflat = np.zeros_like(flat)
    out = Executor(g, np, dtype).forward_backward(layout.views(flat), layout.views(gflat),
                                                  {"x": feed(x, dtype), "y": y.numpy()}, train=True, seed=0)
    tm = torch_module(module, train, torch.float64 if dtype == "float64" else torch.float32)
    before = copy.deepcopy(tm)
    xt = x if x.dtype == torch.int64 else x.to(next(tm.parameters()).dtype)
    logits = tm(xt)
    loss = F.cross_entropy(logits.reshape(-1, classes), y.reshape(-1))
    loss.backward()
    tol = TOL[dtype]
    assert out["loss"] == pytest.approx(loss.item(), rel=tol)

    match, grads = _match(imported, module), layout.views(gflat)
    trainable = {p.name for p in g.params if p.trainable}
    assert trainable <= set(match), f"parameters with no PyTorch counterpart: {sorted(trainable - set(match))}"
    summed = {}
    for ir in trainable:
        tname, transposed = match[ir]
        summed[tname] = summed.get(tname, 0) + (grads[ir].T if transposed else grads[ir])
    named = dict(tm.named_parameters())
    total = np.sqrt(sum(np.linalg.norm(p.grad.numpy()) ** 2 for p in named.values()))
    for tname, ours in summed.items():
        ref = named[tname].grad.numpy()
        if np.linalg.norm(ref) < 1e-6 * total:
            # analytically zero (attention's key bias: softmax ignores a shift per query), so
            # both sides are rounding noise and only their size compares
            assert np.linalg.norm(ours) <= tol * total, tname
        else:
            assert rel(ours, ref) <= tol, tname
    missing = sorted(set(named) - set(summed))
    assert not missing, f"PyTorch parameters the import lost: {missing}"
    if train and g.buffers:
        _buffer_updates(imported, g, layout, gflat, before, tm, 1e-5 if dtype == "float32" else 1e-10)
