"""Mini CosmoFlow and mini DeepCAM (tests/support/mlperf_hpc.py) end to end under real mpirun,
on directories of one-sample HDF5 files in their native layouts (CosmoFlow: int16 counts and
float32 targets; DeepCAM: ``climate/data``, ``climate/labels_0`` and the statistics in the
model).

- One rank, float64, ``data.shuffle=false``, dropout 0: the first steps' losses
  (``steps.jsonl``) and the parameters after them equal a plain PyTorch loop over the same
  files to <= 1e-10. The loop builds each batch as the data plan does (hpc_rlx/data/plan.py):
  the N files are cut into B rows of N/B consecutive files, and step s takes file s of every
  row (not B consecutive files).
- DeepCAM with class weights and an ignored label (a border of label 255): with
  ``model.sync_batch_norm=true``, 2 ranks equal that PyTorch loop too; without it, 2 ranks
  equal 1 rank x 2 lanes in float64 (batch norm normalises per lane or rank: the two see the same
  micro-batches), the loss falls and ``val_iou`` is recorded; CosmoFlow trains on 2 ranks with
  its loss falling and ``val_mae`` recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, read_metrics, train_job

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

from tests.support import mlperf_hpc  # noqa: E402

pytestmark = pytest.mark.mpi

BATCH, STEPS = 2, 5
SGD = ["optim=sgd", "optim.momentum=0.0", "optim.schedule=constant"]
EQUIV = ["train.dtype=float64", f"train.batch_size={BATCH}", "data.shuffle=false", "checkpoint=off",
         "data.one_sample_per_file=true", "model=onnx"] + SGD
DEEPCAM_SMALL = (32, 48, 16)         # the mini model at a third of its size: CI time
WEIGHTS, IGNORE = [1.0, 4.0, 6.0], 255


def plan_batches(n_files: int, batch: int, steps: int) -> list[list[int]]:
    """The files of each step, as the plan takes them without shuffling."""
    k = n_files // batch
    return [[j * k + s for j in range(batch)] for s in range(steps)]


def read_files(folder: Path, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    files = sorted(folder.iterdir())
    xs, ys = [], []
    for f in files:
        with h5py.File(f, "r") as h:
            xs.append(h[x][...])
            ys.append(h[y][...])
    return np.stack(xs), np.stack(ys)


def torch_loop(module, x, y, loss_fn, lr: float, steps: int) -> tuple[list[float], dict]:
    """Plain SGD in float64 over the plan's batches: the loss of each step and the state after."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for rows in plan_batches(len(x), BATCH, steps):
        opt.zero_grad()
        loss = loss_fn(module(torch.from_numpy(x[rows].astype(np.float64))), torch.from_numpy(y[rows]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in module.state_dict().items()}


def step_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows[:STEPS]] == list(range(1, STEPS + 1)), rows
    return [r["loss"] for r in rows]


def params_of(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() <= b.keys(), sorted(set(a) - set(b))
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-300)) for k in a)


def assert_equal_losses(ours: list[float], ref: list[float]) -> None:
    for s, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= 1e-10 * abs(b), (s + 1, a, b, ours, ref)


def test_mini_cosmoflow_equals_a_pytorch_loop_and_trains_on_two_ranks(tmp_path):
    data = mlperf_hpc.write_cosmoflow(tmp_path / "cosmo", train=BATCH * STEPS, val=4)
    torch.manual_seed(0)
    module = mlperf_hpc.MiniCosmoFlow(dropout=0.0)
    onnx_file = mlperf_hpc.export(module, torch.rand(2, *mlperf_hpc.COSMO_SHAPE), tmp_path / "cf.onnx", "torchscript")
    files = [f"data.path={data['train']}", f"data.val_path={data['validation']}", f"model.path={onnx_file}"]
    lr = 0.05
    proc = train_job(1, tmp_path / "w1", EQUIV + files + [f"optim.lr={lr}", "train.epochs=1"], timeout=180)
    assert proc.returncode == 0, explain(proc)

    x, y = read_files(data["train"], "x", "y")
    assert x.dtype == np.int16 and y.dtype == np.float32
    ref_losses, ref_state = torch_loop(module.double().train(), x, y.astype(np.float64),
                                       torch.nn.functional.mse_loss, lr, STEPS)
    assert_equal_losses(step_losses(tmp_path / "w1")[:STEPS], ref_losses)
    assert max_rel_diff(params_of(tmp_path / "w1"), ref_state) <= 1e-10
    assert "val_mae" in read_metrics(tmp_path / "w1")[-1]

    # 2 ranks, float32, as a user runs it: the loss falls, the MAE is recorded every epoch
    proc = train_job(2, tmp_path / "w2", files + ["model=onnx", "data.one_sample_per_file=true", "train.epochs=4",
                                                  f"train.batch_size={BATCH}", "optim=adamw", "optim.lr=0.003",
                                                  "checkpoint=off"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(tmp_path / "w2")
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"], metrics
    assert all(np.isfinite(m["val_mae"]) for m in metrics), metrics


def _deepcam(tmp_path: Path):
    data = mlperf_hpc.write_deepcam(tmp_path / "deepcam", train=BATCH * STEPS, val=4, shape=DEEPCAM_SMALL,
                                    ignore=IGNORE)
    minval, maxval = mlperf_hpc.read_stats(data["stats"])
    torch.manual_seed(0)
    module = mlperf_hpc.MiniDeepCAM(minval, maxval, channels=DEEPCAM_SMALL[-1])
    onnx_file = mlperf_hpc.export(module, torch.rand(2, *DEEPCAM_SMALL), tmp_path / "dc.onnx", "torchscript")
    overrides = EQUIV + [f"data.path={data['train']}", f"data.val_path={data['validation']}",
                         "data.x=climate/data", "data.y=climate/labels_0", f"model.path={onnx_file}",
                         f"model.class_weights=[{','.join(map(str, WEIGHTS))}]", f"model.ignore_index={IGNORE}"]
    return data, module, overrides


def test_mini_deepcam_with_class_weights_and_an_ignored_label_equals_a_pytorch_loop_also_with_sync_bn(tmp_path):
    data, module, overrides = _deepcam(tmp_path)
    lr = 0.1
    proc = train_job(1, tmp_path / "w1", overrides + [f"optim.lr={lr}", "train.epochs=1"], timeout=180)
    assert proc.returncode == 0, explain(proc)

    x, y = read_files(data["train"], "climate/data", "climate/labels_0")
    assert (y == IGNORE).any() and x.shape[1:] == DEEPCAM_SMALL
    weight = torch.tensor(WEIGHTS, dtype=torch.float64)

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels.long(), weight=weight, ignore_index=IGNORE)

    ref_losses, ref_state = torch_loop(mlperf_hpc.as_imported(module).train(), x, y, loss_fn, lr, STEPS)
    assert_equal_losses(step_losses(tmp_path / "w1")[:STEPS], ref_losses)
    ours = params_of(tmp_path / "w1")
    assert any(k.endswith("running_mean") for k in ours)          # batch norm's statistics compared too
    assert max_rel_diff(ours, ref_state) <= 1e-10

    # model.sync_batch_norm: 2 ranks of one sample each normalise over the global batch, as
    # the one rank (and PyTorch) did; the weighted loss's denominator is global too
    proc = train_job(2, tmp_path / "w2_sync", overrides + [f"optim.lr={lr}", "train.epochs=1",
                                                           "model.sync_batch_norm=true"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    assert_equal_losses(step_losses(tmp_path / "w2_sync")[:STEPS], ref_losses)
    assert max_rel_diff(params_of(tmp_path / "w2_sync"), ref_state) <= 1e-10


def test_mini_deepcam_two_ranks_equal_two_lanes_and_the_loss_falls_with_val_iou(tmp_path):
    data, module, overrides = _deepcam(tmp_path)
    # a partial last step would be split 1/1 over lanes but 1/0 over ranks: leftover=drop
    common = overrides + ["optim.lr=0.1", "train.epochs=2", "comm.deterministic=true", "data.leftover=drop"]
    runs = {"w2": (2, []), "w1_lanes2": (1, ["device=cpu", "device.cpu_lanes=2"])}
    for name, (n, extra) in runs.items():
        proc = train_job(n, tmp_path / name, common + extra, timeout=240)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
    assert max_rel_diff(params_of(tmp_path / "w2"), params_of(tmp_path / "w1_lanes2")) <= 1e-10
    metrics = read_metrics(tmp_path / "w2")
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"], metrics
    assert all(0.0 <= m["val_iou"] <= 1.0 for m in metrics), metrics
