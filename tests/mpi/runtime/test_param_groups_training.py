"""optim.no_decay and optim.lr_mult in real mpirun jobs: a PyTorch MLP exported to ONNX, its
parameters selected by their PyTorch names, trains with AdamW as torch.optim.AdamW with one
parameter group per setting (float64, to 1e-10) on 1 rank, on 2 ranks, and on 2 ranks with the
optimizer state sharded (a slice boundary inside fc1.weight)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpi.runtime.test_onnx_training import full_batch_steps, max_rel_diff, params_of, small_mlp_job_files
from tests.support.jobs import explain, train_job

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.mpi

N, TRAIN, STEPS, LR, WD = 48, 40, 4, 0.01, 0.1
GROUPS = ["optim=adamw", "optim.no_decay=[*bias]", "optim.lr_mult={fc2.*:10,fc1.bias:0.5}"]
COMMON = ["model=onnx", "data=file", "train.dtype=float64", f"train.epochs={STEPS}", f"train.batch_size={TRAIN}",
          "data.val_fraction=0.1667", "data.shuffle=false", f"optim.lr={LR}", f"optim.weight_decay={WD}",
          "optim.schedule=constant", "checkpoint=off", "report.tensorboard=false"]


def torch_reference(module, x: np.ndarray, y: np.ndarray) -> dict:
    """STEPS full-batch AdamW steps, one parameter group per parameter as the globs give."""
    module = module.double()
    factor = {"fc1.weight": 1.0, "fc1.bias": 0.5, "fc2.weight": 10.0, "fc2.bias": 10.0}
    groups = [{"params": [p], "lr": LR * factor[n], "weight_decay": 0.0 if n.endswith("bias") else WD}
              for n, p in module.named_parameters()]
    opt = torch.optim.AdamW(groups, lr=LR)
    return full_batch_steps(module, opt, x, y, STEPS)


def test_adamw_parameter_groups_equal_torchs_on_one_and_two_ranks_and_sharded(tmp_path):
    module, onnx_file, x, y, data = small_mlp_job_files(tmp_path, N)
    base = COMMON + GROUPS + [f"model.path={onnx_file}", f"data.path={data}"]
    runs = {}
    for name, n, extra in [("one", 1, []), ("two", 2, []), ("sharded", 2, ["comm.shard=optimizer"])]:
        runs[name] = tmp_path / name
        proc = train_job(n, runs[name], base + extra, timeout=180)
        assert proc.returncode == 0, explain(proc)
    want = torch_reference(module, x[:TRAIN], y[:TRAIN])
    one = params_of(runs["one"])
    # model.h5 holds the IR's names; the MLP's are its PyTorch names, Gemm weights transposed
    got = {k: (v.T if v.shape != want[k].shape else v) for k, v in one.items()}
    assert max_rel_diff(want, got) <= 1e-10, max_rel_diff(want, got)
    for name in ("two", "sharded"):
        assert max_rel_diff(one, params_of(runs[name])) <= 1e-10, name
