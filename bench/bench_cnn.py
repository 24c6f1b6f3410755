"""Full training path of `model=cnn` vs a plain PyTorch CPU training loop, same CNN, same data.

    .venv/bin/python bench/bench_cnn.py                       # 1 rank, 3 repeats, ~1 min
    .venv/bin/python bench/bench_cnn.py --ranks 1,2 --repeats 5 --steps 80
    .venv/bin/python bench/bench_cnn.py --code /tmp/old       # hpc_rlx of another checkout
    .venv/bin/python bench/bench_cnn.py --mkl                 # also with device.cpu_blas=mkl

The CNN of `bench_engine.py --only cnn`: 1x28x28 images, conv 3x3 16 -> ReLU -> max-pool 2 ->
conv 3x3 32 -> ReLU -> max-pool 2 -> linear 128 -> ReLU -> linear 10, float32, SGD (lr 0.01,
momentum 0.9), batch 64 per rank, one BLAS thread per process on both sides. The data: Gaussian
clusters (`python -m hpc_rlx.data prepare synthetic`, 784 features) stored as (N, 1, 28, 28)
images in an HDF5 file, read whole into memory by both sides.

hpc_rlx: `mpirun -n N python -m hpc_rlx model=cnn data=file ...`; its number is its own metric
`samples_per_s` over the epochs after the first (rank 0's step wall time: batch gather, forward,
backward, allreduce, optimizer). PyTorch: one process (the 1-rank peer: no DDP), each step timed
the same way (index the batch, zero_grad, forward, backward, SGD step) over the epochs after the
first. The sides alternate within every repeat; the best repeat is reported (as timeit does),
plus the 25th-percentile step time of each side, which leaves out most steps during which
another job held a core. PyTorch runs only at 1 rank; the rows for more ranks compare hpc_rlx's
N ranks against it (their scaling, not a DDP comparison).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (MPIRUN, PYTHON, REPO, fmt_table, hpc_throughput, machine_note,  # noqa: E402
                     one_thread_env, p25_step_samples_per_s, percentile, prepare_synthetic, result_line, run,
                     timed_torch_epochs)

SHAPE, CLASSES, BATCH, HIDDEN = (1, 28, 28), 10, 64, 128
LR, MOMENTUM = 0.01, 0.9


def prepare_images(work: Path, samples: int) -> Path:
    """The synthetic clusters as (N, 1, 28, 28) float32 images (attributes kept: num_classes)."""
    import h5py

    out = work / f"images_{samples}.h5"
    if out.exists():
        return out
    flat = prepare_synthetic(work / f"flat_{samples}.h5", samples, SHAPE[0] * SHAPE[1] * SHAPE[2], CLASSES)
    with h5py.File(flat, "r") as src, h5py.File(out, "w") as dst:
        dst.create_dataset("x", data=src["x"][...].reshape((-1,) + SHAPE))
        dst.create_dataset("y", data=src["y"][...])
        for k, v in src.attrs.items():
            dst.attrs[k] = v
    return out


def run_hpc(n: int, data: Path, epochs: int, workdir: Path, code: Path = REPO, extra: tuple = ()) -> dict:
    run_dir = workdir / f"hpc_n{n}_{time.monotonic_ns()}"
    args = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file", f"data.path={data}", "data.val_fraction=0",
            "model=cnn", "model.channels=[16,32]", "model.kernel=3", f"model.hidden={HIDDEN}", "model.pool=max",
            f"train.batch_size={BATCH * n}", f"train.epochs={epochs}", "train.threads_per_rank=1",
            "optim=sgd", f"optim.lr={LR}", f"optim.momentum={MOMENTUM}", "optim.schedule=constant",
            "checkpoint=off", "report.plots=false", "train.log_every_s=1000", "trace.enabled=true", *extra]
    # python -m puts the working directory first on sys.path: run from the checkout measured
    run([MPIRUN, "-n", str(n), PYTHON] + args, timeout=900, env=one_thread_env({"PYTHONPATH": str(code)}), cwd=code)
    out = hpc_throughput(run_dir, BATCH * n, skip_epochs=1)
    out["p25_samples_per_s"] = p25_step_samples_per_s(run_dir, BATCH * n)
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def torch_worker(data: str, epochs: int) -> None:
    import h5py
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    with h5py.File(data, "r", locking=False) as f:
        steps = f["x"].shape[0] // BATCH
        x = torch.from_numpy(np.ascontiguousarray(f["x"][: steps * BATCH]))
        y = torch.from_numpy(np.ascontiguousarray(f["y"][: steps * BATCH]))
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    lossf = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000)
    walls, step_times, loss = timed_torch_epochs(model, opt, lossf, x, y, BATCH, steps, epochs, steps * BATCH, gen)
    use = walls[1:] or walls
    step_times.sort()
    print("RESULT " + json.dumps({"samples_per_s": len(use) * steps * BATCH / sum(use),
                                  "p25_samples_per_s": BATCH / percentile(step_times or [1.0], 25),
                                  "step_ms": 1e3 * sum(use) / (len(use) * steps), "loss": float(loss)}))


def run_torch(data: Path, epochs: int, timeout: float = 900) -> dict:
    out = subprocess.run([PYTHON, __file__, "--torch-worker", str(data), str(epochs)], env=one_thread_env(),
                         cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"torch worker failed (rc={out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return result_line(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1")
    ap.add_argument("--steps", type=int, default=60, help="steps per epoch at 1 rank")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is warm-up, not timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the data and runs go (default: a temp dir, removed)")
    ap.add_argument("--code", default=str(REPO), help="the checkout whose hpc_rlx runs (default: this one)")
    ap.add_argument("--mkl", action="store_true",
                    help="also hpc_rlx with device.cpu_blas=mkl (MKL's GEMMs; needs pip install mkl)")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hpc_rlx_bench_cnn_"))
    work.mkdir(parents=True, exist_ok=True)
    samples = BATCH * args.steps
    data = prepare_images(work, samples)
    print(f"# {machine_note()}; hpc_rlx from {args.code}")
    print(f"# CNN {SHAPE} conv16-conv32 (3x3, max-pool) fc{HIDDEN}, batch {BATCH}/rank, {samples} samples, "
          f"{args.epochs} epochs (first untimed), {args.repeats} repeat(s)")
    sides = [(n, ()) for n in ranks] + ([(n, ("device.cpu_blas=mkl",)) for n in ranks] if args.mkl else [])
    res: dict = {"torch": []} | {side: [] for side in sides}
    for rep in range(args.repeats):
        order = ["torch"] + sides if rep % 2 == 0 else sides + ["torch"]
        for side in order:
            r = (run_torch(data, args.epochs) if side == "torch"
                 else run_hpc(side[0], data, args.epochs, work, Path(args.code), side[1]))
            res[side].append(r)
            name = "torch" if side == "torch" else f"hpc_rlx n={side[0]}{' mkl' if side[1] else ''}"
            print(f"  repeat {rep + 1} {name}: {r['samples_per_s']:,.0f} samples/s mean, "
                  f"{r['p25_samples_per_s']:,.0f} p25 ({r['step_ms']:.2f} ms/step)", flush=True)
    tb = {k: max(v[k] for v in res["torch"]) for k in ("samples_per_s", "p25_samples_per_s")}
    rows = []
    for side in sides:
        h = {k: max(v[k] for v in res[side]) for k in ("samples_per_s", "p25_samples_per_s")}
        rows.append([f"{side[0]}{' mkl' if side[1] else ''}", h["samples_per_s"], tb["samples_per_s"], f"{h['samples_per_s'] / tb['samples_per_s']:.2f}x",
                     h["p25_samples_per_s"], tb["p25_samples_per_s"],
                     f"{h['p25_samples_per_s'] / tb['p25_samples_per_s']:.2f}x"])
    print(f"\nsamples/s, best of {args.repeats} (PyTorch: one process, 1 rank):")
    print(fmt_table(["ranks", "hpc_rlx mean", "torch mean", "ratio", "hpc_rlx p25", "torch p25", "ratio p25"], rows))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
