"""Graph engine vs PyTorch CPU: forward + backward + SGD step, one BLAS thread, one process.

    .venv/bin/python bench/bench_engine.py [--repeats 7] [--steps 10] [--only mlp,cnn,lm]
    .venv/bin/python bench/bench_engine.py --only zoo      # the ONNX model zoo of the tests
    .venv/bin/python bench/bench_engine.py --only vision,hf --repeats 3 --steps 3   # torchvision, timm, HF
    .venv/bin/python bench/bench_engine.py --only hf --models gpt2,bert --profile      # + where the time goes

Prints per-step times and the ratio engine / PyTorch for the MLP 784-1024-1024-10 at batch
128 (the target is <= 1.0), a small CNN and the transformer LM, all float32. A hand-written
NumPy step of the same MLP is printed as a reference point for this machine, and the step's
matrix products alone, on NumPy's BLAS (`gemm-floor`) and on PyTorch's (`torch-gemms`);
`engine-mkl` is the engine with `device.cpu_blas=mkl` (where the mkl wheel is installed). The engines take
turns inside every repeat so a noisy, shared machine slows both alike. Reported per step: the
best and median wall-clock repeat, and the best process-CPU-time repeat (which time spent
waiting for a core on a busy machine does not inflate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpc_rlx.device.host_blas import host_array_module  # noqa: E402
from hpc_rlx.base.errors import ConfigError  # noqa: E402
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params  # noqa: E402


def with_mkl(contenders: dict, graph, feeds) -> dict:
    """Adds `engine-mkl` (the engine with device.cpu_blas=mkl's GEMMs) where MKL loads."""
    try:
        contenders["engine-mkl"] = engine_step_fn(graph, feeds, xp=host_array_module("mkl", 1))
    except ConfigError as exc:
        print(f"  (no engine-mkl: {exc})")
    return contenders

LR = 1e-3


def engine_step_fn(graph, feeds, seed=0, initial=None, xp=np):
    layout = ParamLayout(graph)
    params = np.empty(layout.size, np.float32)
    grads = np.empty(layout.size, np.float32)
    if initial is None:
        init_params(graph, params, seed)
    else:
        layout.pack(initial, params)
    pv, gv = layout.views(params), layout.views(grads)
    ex = Executor(graph, xp, "float32")
    scratch = np.empty_like(grads)

    def step(i):
        ex.forward_backward(pv, gv, feeds, train=True, seed=i)
        np.multiply(grads, -LR, out=scratch)
        np.add(params, scratch, out=params)

    return step


def torch_step_fn(model, x, y):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lossf = torch.nn.CrossEntropyLoss()

    def step(i):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = lossf(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()

    return step


def numpy_mlp_step_fn(sizes, x, y):
    """The same MLP step written by hand in NumPy: the reference the issue quotes."""
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32) for a, b in zip(sizes, sizes[1:])]
    bs = [np.zeros(b, np.float32) for b in sizes[1:]]
    n = x.shape[0]

    def step(i):
        acts, h = [x], x
        for k, (w, b) in enumerate(zip(ws, bs)):
            h = h @ w + b
            if k < len(ws) - 1:
                np.maximum(h, 0, out=h)
            acts.append(h)
        z = h - h.max(1, keepdims=True)
        e = np.exp(z)
        p = e / e.sum(1, keepdims=True)
        p[np.arange(n), y] -= 1
        g = p / n
        for k in range(len(ws) - 1, -1, -1):
            gw, gb = acts[k].T @ g, g.sum(0)
            if k:
                g = (g @ ws[k].T) * (acts[k] > 0)
            ws[k] -= LR * gw
            bs[k] -= LR * gb

    return step


def gemm_floor_step_fn(sizes, x, torch=None):
    """Only the matrix products of the MLP step (forward, weight and input gradients), in
    NumPy: no bias, activation, loss or update. No engine's step can take less time than this
    on this BLAS, so it bounds how far ahead of PyTorch any CPU engine can be. With ``torch``
    (the module), the same products in PyTorch, on its own BLAS (MKL in the x86 wheels)."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((a, b)).astype(np.float32) for a, b in zip(sizes, sizes[1:])]
    if torch is None:
        empty, matmul = (lambda shape: np.empty(shape, np.float32)), np.matmul
    else:
        x, ws = torch.from_numpy(x), [torch.from_numpy(w) for w in ws]
        empty, matmul = torch.empty, torch.matmul
    outs = [empty((x.shape[0], b)) for b in sizes[1:]]
    gws = [empty(tuple(w.shape)) for w in ws]
    gxs = [empty((x.shape[0], a)) for a in sizes[:-1]]

    def step(i):
        h = x
        for w, out in zip(ws, outs):
            h = matmul(h, w, out=out)
        g = outs[-1]
        for k in range(len(ws) - 1, -1, -1):
            matmul((outs[k - 1] if k else x).T, g, out=gws[k])
            if k:
                g = matmul(g, ws[k].T, out=gxs[k])

    return step


def timed(step, steps, start):
    """(wall seconds, process CPU seconds) per step over ``steps`` steps."""
    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(start, start + steps):
        step(i)
    return (time.perf_counter() - w0) / steps, (time.process_time() - c0) / steps


def race(contenders, steps, repeats, warmup=3):
    """Per contender: best wall, median wall, best CPU time per step (engines take turns)."""
    for step in contenders.values():
        for i in range(warmup):
            step(i)
    times = {k: [] for k in contenders}
    for r in range(repeats):
        for k, step in contenders.items():
            times[k].append(timed(step, steps, warmup + r * steps))
    return {
        k: (min(w for w, _ in v), statistics.median(w for w, _ in v), min(c for _, c in v))
        for k, v in times.items()
    }


def mlp_case():
    import torch

    sizes, batch = [784, 1024, 1024, 10], 128
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], batch)
    g = build_model("mlp", input_shape=(784,), num_classes=10, hidden=[1024, 1024], activation="relu")
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    return "MLP 784-1024-1024-10, batch 128", with_mkl({
        "engine": engine_step_fn(g, {"x": x, "y": y}),
        "torch": torch_step_fn(model, torch.from_numpy(x), torch.from_numpy(y)),
        "numpy-by-hand": numpy_mlp_step_fn(sizes, x, y),
        "gemm-floor": gemm_floor_step_fn(sizes, x),
        "torch-gemms": gemm_floor_step_fn(sizes, x, torch),
    }, g, {"x": x, "y": y})


def cnn_case():
    import torch

    batch = 64
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    g = build_model("cnn", input_shape=(1, 28, 28), num_classes=10, channels=[16, 32], kernel=3, hidden=128, pool="max")
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10),
    )
    return "CNN 1x28x28 conv16-conv32 (3x3, max-pool) fc128, batch 64", with_mkl({
        "engine": engine_step_fn(g, {"x": x, "y": y}),
        "torch": torch_step_fn(model, torch.from_numpy(x), torch.from_numpy(y)),
    }, g, {"x": x, "y": y})


def lm_case():
    import torch

    V, T, D, H, L, F, batch = 256, 64, 128, 4, 2, 512, 16
    rng = np.random.default_rng(3)
    x = rng.integers(0, V, (batch, T))
    y = rng.integers(0, V, (batch, T))
    g = build_model("transformer_lm", vocab_size=V, seq_len=T, d_model=D, n_heads=H, n_layers=L, d_ff=F)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
            self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
            self.fc, self.proj = torch.nn.Linear(D, F), torch.nn.Linear(F, D)

        def forward(self, h):
            B = h.shape[0]
            a = self.ln1(h)
            q, k, v = (m(a).view(B, T, H, D // H).transpose(1, 2) for m in (self.q, self.k, self.v))
            s = (q @ k.transpose(-1, -2)) / (D // H) ** 0.5
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
            h = h + self.o(o)
            return h + self.proj(torch.nn.functional.gelu(self.fc(self.ln2(h)), approximate="tanh"))

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(V, D), torch.nn.Parameter(torch.zeros(T, D))
            self.blocks = torch.nn.Sequential(*(Block() for _ in range(L)))
            self.ln = torch.nn.LayerNorm(D)
            self.head = torch.nn.Linear(D, V, bias=False)

        def forward(self, ids):
            return self.head(self.ln(self.blocks(self.tok(ids) + self.pos)))

    return f"transformer LM V={V} T={T} d={D} heads={H} layers={L} ff={F}, batch {batch}", {
        "engine": engine_step_fn(g, {"x": x, "y": y}),
        "torch": torch_step_fn(LM(), torch.from_numpy(x), torch.from_numpy(y)),
    }


# the image models of tests/unit/graph/test_vision_models.py (dropout and stochastic depth off)
# and the Hugging Face models of tests/support/hf_zoo.py
VISION = ["tv_mobilenet_v3", "tv_efficientnet_b0", "tv_convnext", "tv_swin", "tv_swin_v2", "timm_mobilevit",
          "timm_levit", "timm_mixer", "tv_resnet18", "tv_shufflenet", "tv_regnet", "tv_densenet", "tv_vit",
          "timm_resnet10t", "timm_convnext_atto", "timm_deit_tiny", "timm_efficientnet"]
HF = ["bert", "distilbert", "gpt2", "llama", "roberta", "bart", "t5"]
ZOO = ["lenet", "resnet", "mobilenet", "vit", "gpt", "mixer"]


def zoo_cases(batch=32, names=tuple(ZOO), profile=False, mkl=False):
    """Models of tests/support/onnx_zoo.py (or of the zoos it reaches: vision_zoo ``NAME_p0``,
    hf_zoo), exported by torch (dynamo, training form; TorchScript for T5, which dynamo cannot
    export) and imported: the engine steps the imported graph, PyTorch the module it came from."""
    import tempfile

    import torch

    from hpc_rlx.graph.onnx.importer import import_onnx
    from tests.support import onnx_zoo

    for name in names:
        module = onnx_zoo.make(name)
        for m in module.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            path = onnx_zoo.export(module, onnx_zoo.sample_input(name, 2), f"{tmp}/{name}.onnx",
                                   "torchscript" if name == "t5" else "dynamo", "train", optimize=False)
            imported = import_onnx(path, label_dtype="int64")
        x = onnx_zoo.sample_input(name, batch, seed=1)
        g = imported.graph
        classes = g.types[g.meta["onnx"]["output_node"]].shape[-1]
        y = torch.randint(0, classes, tuple(d or batch for d in g.input("y").shape),
                          generator=torch.Generator().manual_seed(2))
        xn, yn = x.numpy(), y.numpy().astype(np.int64)
        if xn.dtype.kind == "f":
            xn = xn.astype(np.float32)
        params = sum(p.numel() for p in module.parameters())
        if profile:
            print_profile(g, batch)
        contenders = {
            "engine": engine_step_fn(g, {"x": xn, "y": yn}, initial=imported.initial),
            "torch": torch_step_fn(module.train(), x, y),
        }
        yield f"zoo {name} ({params} parameters), batch {batch}", (with_mkl(contenders, g, {"x": xn, "y": yn})
                                                                    if mkl else contenders)


def print_profile(graph, batch, top=8):
    """The engine's time per op type, forward plus backward, from ``node_times`` (its own
    profile of each node on a synthetic batch; the graph as written, no rewrites)."""
    from hpc_rlx.graph.node_timing import node_times

    times = node_times(graph, rows=batch, reps=3)
    by_op: dict = {}
    ops = {n.name: n.op for n in graph.nodes}
    for name, t in times.items():
        op = ops.get(name, name)
        total, count = by_op.get(op, (0.0, 0))
        by_op[op] = (total + t, count + 1)
    whole = sum(t for t, _ in by_op.values()) or 1.0
    print(f"  profile: {whole * 1e3:.2f} ms forward + backward over {len(times)} nodes")
    for op, (t, count) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {op:18s} {t * 1e3:8.2f} ms  {100 * t / whole:5.1f}%  ({count} nodes)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default="mlp,cnn,lm")
    ap.add_argument("--models", default=None, help="comma-separated: only these of zoo/vision/hf")
    ap.add_argument("--profile", action="store_true", help="print the engine's time per op type")
    ap.add_argument("--mkl", action="store_true", help="zoo, vision, hf: also race engine-mkl (device.cpu_blas=mkl)")
    args = ap.parse_args(argv)

    def pick(names):
        chosen = args.models.split(",") if args.models else None
        return [n for n in names if chosen is None or n in chosen or n.removesuffix("_p0") in chosen]

    import torch

    torch.set_num_threads(1)
    cases = {"mlp": lambda: [mlp_case()], "cnn": lambda: [cnn_case()], "lm": lambda: [lm_case()],
             "zoo": lambda: zoo_cases(names=pick(ZOO), profile=args.profile, mkl=args.mkl),
             "vision": lambda: zoo_cases(names=pick([n + "_p0" for n in VISION]), profile=args.profile, mkl=args.mkl),
             "hf": lambda: zoo_cases(names=pick(HF), profile=args.profile, mkl=args.mkl)}
    with threadpool_limits(limits=1):
        print(f"numpy {np.__version__}, torch {torch.__version__}, 1 BLAS thread, float32, "
              f"{args.repeats} repeats x {args.steps} steps")
        for key in args.only.split(","):
            for title, contenders in cases[key]():
                report(title, race(contenders, args.steps, args.repeats))


def report(title, t):
    print(f"{title}")
    base = t["torch"]
    for name, (best, med, cpu) in t.items():
        print(f"  {name:14s} wall best {best * 1e3:7.2f} ms  median {med * 1e3:7.2f} ms  "
              f"cpu best {cpu * 1e3:7.2f} ms   /torch: {best / base[0]:.2f}x wall, {cpu / base[2]:.2f}x cpu")
    e = t["engine"]
    print(f"  ratio engine/torch = {e[0] / base[0]:.2f} (best wall), {e[1] / base[1]:.2f} (median wall), "
          f"{e[2] / base[2]:.2f} (best cpu)")
    if "engine-mkl" in t:
        m = t["engine-mkl"]
        print(f"  ratio engine-mkl/torch = {m[0] / base[0]:.2f} (best wall), {m[1] / base[1]:.2f} (median wall), "
              f"{m[2] / base[2]:.2f} (best cpu)")
    if "gemm-floor" in t:
        f = t["gemm-floor"]
        print(f"  GEMM floor: torch {base[0] / f[0]:.2f}x, engine {e[0] / f[0]:.2f}x of it (best wall); "
              f"the most any engine can be ahead of this torch step: {base[0] / f[0]:.2f}x")
    if "torch-gemms" in t and "gemm-floor" in t:
        tg, f = t["torch-gemms"], t["gemm-floor"]
        print(f"  the same matrix products in PyTorch take {tg[0] / f[0]:.2f}x (best wall), "
              f"{tg[1] / f[1]:.2f}x (median) the time of NumPy's BLAS")

if __name__ == "__main__":
    main()
