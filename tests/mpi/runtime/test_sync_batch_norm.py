"""model.sync_batch_norm=true under real mpirun: batch norm's statistics over the global batch,
so a PyTorch batch-norm CNN trains in float64 on 2 ranks, and on 1 rank x 2 lanes, exactly as on
1 rank, which equals PyTorch's own loop (as its SyncBatchNorm would). The last step is partial,
with rows on rank 0 alone: rank 1 takes part in its batch-norm sums with none."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, train_job

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
nn = torch.nn

pytestmark = pytest.mark.mpi

BATCH, STEPS, LR = 16, 4, 0.2
EXTRA = 2       # rows 0 and 1 hold one sample more: a last, partial step that only rank 0 has rows in
LENGTHS = [STEPS + 1 if j < EXTRA else STEPS for j in range(BATCH)]
STARTS = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(int)


class TwoBatchNormNet(nn.Module):
    """Batch norm on the input (no input gradient) and after a convolution."""

    def __init__(self):
        super().__init__()
        self.bn_in = nn.BatchNorm2d(1)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=0.2)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.conv(self.bn_in(x)))), 2)
        return self.fc(torch.flatten(x, 1))


def _data(folder: Path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    """BATCH x STEPS + EXTRA training samples (one epoch of STEPS + 1 steps with
    data.leftover=partial) and a small validation file; the inputs are off-centre, so the
    per-rank and global statistics differ clearly."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((STARTS[-1], 1, 8, 8)) * 2.0 + 1.0
    x[: STARTS[BATCH // 2]] += 1.5          # rank 0's rows (the first half) sit elsewhere
    y = rng.integers(0, 10, STARTS[-1])
    train, val = folder / "train.h5", folder / "val.h5"
    with h5py.File(train, "w") as f:
        f["x"], f["y"] = x, y
    with h5py.File(val, "w") as f:
        f["x"], f["y"] = x[:8], y[:8]
    return train, val, x, y


def _params(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(a[k]).max(), 1e-300)) for k in a)


def _torch_loop(module: nn.Module, x: np.ndarray, y: np.ndarray) -> dict:
    """Plain SGD in float64; step s takes sample s of every row that has one (the plan)."""
    module = module.double().train()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for s in range(STEPS + 1):
        rows = [STARTS[j] + s for j in range(BATCH) if s < LENGTHS[j]]
        opt.zero_grad()
        nn.functional.cross_entropy(module(torch.from_numpy(x[rows])), torch.from_numpy(y[rows])).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def test_sync_batch_norm_two_ranks_and_two_lanes_equal_one_rank_and_pytorch(tmp_path):
    from tests.support import onnx_zoo
    torch.manual_seed(0)
    module = TwoBatchNormNet()
    onnx_file = onnx_zoo.export(module, torch.randn(2, 1, 8, 8), tmp_path / "bn.onnx", "torchscript", "train",
                                optimize=False)
    train, val, x, y = _data(tmp_path)
    base = ["train.dtype=float64", "train.epochs=1", f"train.batch_size={BATCH}", f"optim.lr={LR}",
            "optim.momentum=0.0", "optim.schedule=constant", "checkpoint=off", "data.shuffle=false",
            "data.leftover=partial",
            f"data.path={train}", f"data.val_path={val}", "model=onnx", f"model.path={onnx_file}",
            "model.sync_batch_norm=true"]
    # w2 with comm.overlap: the bucket's chunks start reducing during the backward that holds
    # the batch-norm sums (these on a communicator of their own)
    runs = {"w1": (1, []), "w2": (2, ["comm.overlap=true"]), "w1_lanes2": (1, ["device=cpu", "device.cpu_lanes=2"])}
    for name, (n, extra) in runs.items():
        proc = train_job(n, tmp_path / name, base + extra, timeout=120)
        assert proc.returncode == 0, f"{name}: " + explain(proc)
    assert "model.sync_batch_norm: 2 batch-norm layer(s)" in proc.stdout + proc.stderr, explain(proc)
    one = _params(tmp_path / "w1")
    assert _max_rel_diff(one, _params(tmp_path / "w2")) <= 1e-10
    assert _max_rel_diff(one, _params(tmp_path / "w1_lanes2")) <= 1e-10
    # one rank is PyTorch's loop (parameters and running statistics)
    ref = _torch_loop(module, x, y)
    assert _max_rel_diff(one, {k: ref[k] for k in one}) <= 1e-10
