"""Step time of one model: CPU lane vs GPU lane vs both (device=all), and PyTorch on CUDA.

    python bench/gpu/throughput.py [--models mlp,cnn] [--steps 30] [--warmup 5] [--out FILE]

One process, no MPI: a step is what a rank does between two Allreduces. For hpc_rlx that is
the lanes' forward/backward into the bucket (the batch comes from host memory, the parameters
are copied up to the GPU first), the summed gradient read on the host, and the SGD update of
the host parameters. PyTorch runs the same layers, batch and dtype (float32, no TF32) with its
SGD on the GPU, once with the batch already on the GPU and once copying it up every step.

Columns: median ms per step over the timed steps, samples/s from it, and for hpc_rlx the
median split of a step (parameters up, lanes' compute, gradient down, optimizer) and each
lane's share of the samples. A variant that cannot run here (no CuPy, no CUDA PyTorch) is a
row that says why. Exit status 1 if no GPU variant ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpc_rlx.base import backend  # noqa: E402
from hpc_rlx.comm.collective import FusedBucket  # noqa: E402
from hpc_rlx.graph import ParamLayout, build_model, init_params  # noqa: E402
from hpc_rlx.runtime.lanes import LaneSet  # noqa: E402

LR = 1e-3
MODELS = {
    "mlp": ("mlp", dict(input_shape=(784,), num_classes=10, hidden=[1024, 1024], activation="relu"), 512,
            "MLP 784-1024-1024-10, batch 512"),
    "cnn": ("cnn", dict(input_shape=(1, 28, 28), num_classes=10, channels=[16, 32], kernel=3, hidden=64,
                        pool="max"), 128, "CNN conv16-conv32-fc64 on 1x28x28, batch 128"),
}


def data(kind: str, shape, batch: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + tuple(shape)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    return x, y


def time_steps(step, warmup: int, steps: int) -> list[float]:
    for i in range(warmup):
        step(i)
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(warmup + i)
        out.append(time.perf_counter() - t0)
    return out


def hpc_variant(graph, lanes_spec, x, y, warmup, steps) -> dict:
    layout = ParamLayout(graph)
    params = np.empty(layout.size, np.float32)
    init_params(graph, params, 0)
    bucket = FusedBucket(layout.size, ("samples",), np.float32)
    lanes = LaneSet(graph, lanes_spec, "float32", params, bucket, layout, cuda_aware="false")
    parts = {"up": [], "compute": [], "down": [], "optim": []}
    shares = []

    def step(i):
        t0 = time.perf_counter()
        lanes.refresh_device_params()          # what step() would do itself; timed apart here
        t1 = time.perf_counter()
        n, _, _, _ = lanes.step(x, y, seed=i)
        t2 = time.perf_counter()
        bucket.memory.payload_to_host()        # a device bucket comes down here
        grad = bucket.payload
        t3 = time.perf_counter()
        grad /= n
        np.subtract(params, np.float32(LR) * grad, out=params)
        t4 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[key].append(dt)
        shares.append([c / max(1, sum(lanes.last_counts)) for c in lanes.last_counts])

    times = time_steps(step, warmup, steps)
    keep = slice(warmup, None)
    res = {"times": times, "parts": {k: statistics.median(v[keep]) for k, v in parts.items()},
           "share": dict(zip(lanes.names, np.mean(shares[keep], axis=0))), "bucket": lanes.bucket_path,
           "params": layout.size}
    lanes.close()
    return res


def torch_model(kind: str, kw: dict):
    import torch.nn as nn

    if kind == "mlp":
        dims = [int(np.prod(kw["input_shape"]))] + list(kw["hidden"])
        layers = [nn.Flatten()]
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(dims[-1], kw["num_classes"]))
    c, h, w = kw["input_shape"]
    layers = []
    for out_c in kw["channels"]:
        layers += [nn.Conv2d(c, out_c, kw["kernel"], padding=kw["kernel"] // 2), nn.ReLU()]
        c = out_c
        if h >= 2 and w >= 2:
            layers.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c * h * w, kw["hidden"]), nn.ReLU(),
                         nn.Linear(kw["hidden"], kw["num_classes"]))


def torch_variant(kind, kw, x, y, warmup, steps, batch_on_gpu: bool) -> dict:
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise RuntimeError(f"PyTorch {torch.__version__} sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda:0")
    model = torch_model(kind, kw).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xt_host, yt_host = torch.from_numpy(x), torch.from_numpy(y)
    xt, yt = xt_host.to(dev), yt_host.to(dev)

    def step(i):
        xs, ys = (xt, yt) if batch_on_gpu else (xt_host.to(dev), yt_host.to(dev))
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xs), ys)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    times = time_steps(step, warmup, steps)
    return {"times": times, "params": sum(p.numel() for p in model.parameters())}


def row(name: str, res: dict | None, batch: int, err: str | None = None) -> str:
    if res is None:
        return f"| {name} | not run: {err} | | | |"
    ms = statistics.median(res["times"]) * 1e3
    split = share = ""
    if "parts" in res:
        p = res["parts"]
        split = (f"{p['up'] * 1e3:.2f} / {p['compute'] * 1e3:.2f} / {p['down'] * 1e3:.2f} / "
                 f"{p['optim'] * 1e3:.2f}")
        share = ", ".join(f"{k} {v:.0%}" for k, v in res["share"].items())
    return f"| {name} | {ms:.2f} | {batch / ms * 1e3:,.0f} | {split} | {share} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    gpu_ok = backend.cupy_available()
    gpu_ran = False
    text = []
    for key in args.models.split(","):
        kind, kw, batch, title = MODELS[key]
        graph = build_model(kind, **kw)
        x, y = data(kind, kw["input_shape"], batch)
        lines = [f"#### Step time: {title}, float32", "",
                 "| variant | ms/step | samples/s | split ms: params up / compute / grad down / optimizer "
                 "| lane share |", "|---|---|---|---|---|"]
        variants = [("hpc_rlx CPU lane", [("cpu", 0)]), ("hpc_rlx GPU lane", [("cuda", 0)]),
                    ("hpc_rlx all (GPU + CPU lane)", [("cuda", 0), ("cpu", 0)])]
        params = None
        for name, spec in variants:
            if any(k == "cuda" for k, _ in spec) and not gpu_ok:
                lines.append(row(name, None, batch, backend.gpu_unavailable_reason()))
                continue
            # the mixed lanes need a few steps to measure their rates first
            warm = args.warmup + (10 if len(spec) > 1 else 0)
            res = hpc_variant(graph, spec, x, y, warm, args.steps)
            params = res["params"]
            gpu_ran |= any(k == "cuda" for k, _ in spec)
            lines.append(row(name, res, batch))
            print(f"{key} {name}: {statistics.median(res['times']) * 1e3:.2f} ms ({res['bucket']})", flush=True)
        for name, on_gpu in (("PyTorch CUDA (batch on GPU)", True), ("PyTorch CUDA (batch copied up)", False)):
            try:
                res = torch_variant(kind, kw, x, y, args.warmup, args.steps, on_gpu)
                if params is not None and res["params"] != params:
                    name += f" [{res['params']} params vs {params}]"
                lines.append(row(name, res, batch))
                gpu_ran = True
                print(f"{key} {name}: {statistics.median(res['times']) * 1e3:.2f} ms", flush=True)
            except Exception as exc:  # noqa: BLE001 - a row that says why, not a crash
                lines.append(row(name, None, batch, f"{type(exc).__name__}: {exc}"[:160]))
        text.append("\n".join(lines) + "\n")
    out = "\n".join(text)
    print("\n" + out)
    if args.out:
        with open(args.out, "a") as f:
            f.write(out + "\n")
    return 0 if gpu_ran else 1


if __name__ == "__main__":
    sys.exit(main())
