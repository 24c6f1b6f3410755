"""Checks of an imported ONNX model against ONNX Runtime and PyTorch, shared by the import tests
of the project's zoo (tests/support/onnx_zoo.py) and of real libraries' models
(tests/support/hf_zoo.py).

Relative errors are max|ours - reference| / max|reference|.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hpc_rlx.graph import Executor, Graph, ParamLayout
from tests.support import onnx_zoo as zoo

F = torch.nn.functional
# float64 checks the math; float32 only that nothing is lost beyond rounding, which depends on the
# CPU's BLAS kernels (MobileNet's stem gradient, the sum over every layer below the loss, was
# 1.2e-5 from PyTorch's on an AMD EPYC against under 1e-5 on an Intel Xeon)
TOL = {"float32": 3e-5, "float64": 1e-10}
BATCH = 4


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


def ours_forward(imported, x, train: bool, dtype="float32", seed: int = 0):
    g = without_dropout(imported.graph)
    layout, flat = param_views(imported, g, dtype)
    node = g.meta["onnx"]["output_node"]
    return Executor(g, np, dtype).run(layout.views(flat), {"x": feed(x, dtype)}, [node], train=train, seed=seed)[node]


def trains_like_module_train(imported, mode: str) -> bool:
    """Whether training the import matches module.train(): a training-mode export whose batch
    norm and dropout the import kept in their training form. Otherwise (an eval export, or
    batch norm fused into the convolutions) the import trains like module.eval()."""
    return mode == "train" and imported.graph.meta["onnx"]["form"] == "training"


def ort_batch_stats(path) -> bool:
    """Whether ONNX Runtime normalises with batch statistics: a BatchNormalization node in
    training mode (TorchScript's training-form export)."""
    import onnx

    model = onnx.load(str(path))
    return any(n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in n.attribute)
               for n in model.graph.node)


def torch_module(module, train: bool, dtype=torch.float32):
    """A copy in the given mode, dropout off (its masks are PyTorch's own)."""
    m = copy.deepcopy(module).to(dtype)
    for sub in m.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    return m.train(train)


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


def _gate_blocks(imported, module, found: dict) -> dict:
    """IR parameter -> [(its block, PyTorch parameter name, that one's block)] for the weights
    and biases an ONNX LSTM, GRU or RNN reads: ONNX stacks a layer's directions and orders the
    gates its own way (LSTM i o f c, PyTorch i f g o), so they are found by value one block of
    ``hidden_size`` rows at a time (``found``: the parameters already matched whole)."""
    blocks = []
    for mname, sub in module.named_modules():
        if isinstance(sub, torch.nn.RNNBase):
            h = sub.hidden_size
            for pname, p in sub.named_parameters():
                t = p.detach().numpy()
                blocks += [(h, f"{mname}.{pname}".lstrip("."), np.s_[j * h:(j + 1) * h], t[j * h:(j + 1) * h])
                           for j in range(t.shape[0] // h)]

    def pieces(v, h):
        out = []
        for d in range(v.shape[0]):
            for j in range(v.shape[1] // h):
                at = np.s_[d, j * h:(j + 1) * h]
                hit = next(((name, rows) for hb, name, rows, t in blocks
                            if hb == h and t.shape == v[at].shape and np.array_equal(t, v[at])), None)
                if hit is None:
                    return None
                out.append((at, *hit))
        return out

    found_blocks = {}
    for ir, value in imported.initial.items():
        if ir in found or value.ndim not in (2, 3):
            continue
        for h in sorted({b[0] for b in blocks}):
            got = pieces(value.astype(np.float32), h) if value.shape[1] % h == 0 else None
            if got:
                found_blocks[ir] = got
                break
    return found_blocks


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


def _batch(g: Graph, name: str):
    x = zoo.sample_input(name, BATCH, seed=3)
    classes = g.types[g.meta["onnx"]["output_node"]].shape[-1]
    y_shape = tuple(d or BATCH for d in g.input("y").shape)
    return x, torch.randint(0, classes, y_shape, generator=torch.Generator().manual_seed(4)), classes


def torch_float32_error(module, imported, name: str) -> tuple[float, float]:
    """How far PyTorch's own float32 training forward and gradients lie from its float64 ones on
    the batch that ``check_gradients`` uses: (relative error of the logits, the largest relative
    error over the parameters whose gradient is not negligible). Batch norm over a few values
    (4 samples on the 1x1 maps at the end of an image network fed 32x32 pixels) amplifies
    float32 rounding to 1e-4..1e-3, so two float32 implementations can differ by that much
    while both are right."""
    x, y, classes = _batch(imported.graph, name)
    grads, logits = {}, {}
    for dtype in (torch.float32, torch.float64):
        tm = torch_module(module, True, dtype)
        out = tm(x if x.dtype == torch.int64 else x.to(dtype))
        logits[dtype] = out.detach().double().numpy()
        F.cross_entropy(out.reshape(-1, classes), y.reshape(-1)).backward()
        grads[dtype] = {k: p.grad.double().numpy() for k, p in tm.named_parameters()}
    exact = grads[torch.float64]
    total = np.sqrt(sum(np.linalg.norm(v) ** 2 for v in exact.values()))
    return (rel(logits[torch.float32], logits[torch.float64]),
            max(rel(grads[torch.float32][k], v) for k, v in exact.items() if np.linalg.norm(v) >= 1e-6 * total))


def check_gradients(module, imported, name: str, train: bool, dtype: str, tol: float | None = None) -> None:
    """The import's loss and gradients against PyTorch autograd on ``module`` with the same
    weights and batch (module.train() when ``train``, else module.eval(); dropout off), and
    in training the batch-norm statistics it emits against PyTorch's running-buffer update;
    ``tol``: the relative tolerance (TOL[dtype] if None)."""
    g = without_dropout(imported.graph)
    x, y, classes = _batch(g, name)

    layout, flat = param_views(imported, g, dtype)
    gflat = np.zeros_like(flat)
    out = Executor(g, np, dtype).forward_backward(layout.views(flat), layout.views(gflat),
                                                  {"x": feed(x, dtype), "y": y.numpy()}, train=True, seed=0)
    tm = torch_module(module, train, torch.float64 if dtype == "float64" else torch.float32)
    before = copy.deepcopy(tm)
    logits = tm(x if x.dtype == torch.int64 else x.to(next(tm.parameters()).dtype))
    loss = F.cross_entropy(logits.reshape(-1, classes), y.reshape(-1))
    loss.backward()
    tol = TOL[dtype] if tol is None else tol
    assert out["loss"] == pytest.approx(loss.item(), rel=tol)

    match, grads = _match(imported, module), layout.views(gflat)
    gate_blocks = _gate_blocks(imported, module, match)
    trainable = {p.name for p in g.params if p.trainable}
    unmatched = sorted(trainable - set(match) - set(gate_blocks))
    assert not unmatched, f"parameters with no PyTorch counterpart: {unmatched}"
    named = dict(tm.named_parameters())
    summed = {}
    for ir in trainable:
        if ir in gate_blocks:
            for at, tname, rows in gate_blocks[ir]:
                summed.setdefault(tname, np.zeros(named[tname].shape))[rows] += grads[ir][at]
            continue
        tname, transposed = match[ir]
        summed[tname] = summed.get(tname, 0) + (grads[ir].T if transposed else grads[ir])
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
        _buffer_updates(imported, g, layout, gflat, before, tm, tol)
