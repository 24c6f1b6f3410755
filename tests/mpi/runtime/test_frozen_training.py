"""model.freeze in real mpirun jobs: a PyTorch MLP exported to ONNX, fc1's bias and fc2's weight
frozen by their PyTorch names, trains with AdamW as torch.optim.AdamW does with those parameters
requires_grad=False (float64, to 1e-10) on 1 rank, on 2 ranks and with the optimizer state
sharded; the frozen parameters stay bitwise what they were, the bucket (wire_bytes) shrinks by
exactly their size, a sharded checkpoint resumes bitwise, and cadence and async train with them
fixed, from a trained run's model.h5 (model.init_from)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpi.runtime.test_onnx_training import full_batch_steps, max_rel_diff, params_of, small_mlp_job_files
from tests.support.jobs import explain, read_log, read_metrics, train_job

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.mpi, pytest.mark.slow]      # 7 jobs: about 24 s on 2 cores

N, TRAIN, STEPS, LR, WD = 48, 40, 5, 0.01, 0.1
FROZEN = ("fc1.bias", "fc2.weight")         # fc2's input gradient still reaches fc1.weight
FREEZE = f"model.freeze=[{','.join(FROZEN)}]"
COMMON = ["model=onnx", "data=file", "train.dtype=float64", f"train.epochs={STEPS}", f"train.batch_size={TRAIN}",
          "data.val_fraction=0.1667", "data.shuffle=false", "optim=adamw", f"optim.lr={LR}",
          f"optim.weight_decay={WD}", "optim.schedule=constant", "report.tensorboard=false",
          "comm.shared_memory=false"]     # MPI's Allreduce: wire_bytes is the ring's volume of the bucket


def torch_reference(module, x: np.ndarray, y: np.ndarray) -> tuple[dict, dict]:
    """(initial, after STEPS full-batch AdamW steps) in float64, FROZEN with requires_grad=False."""
    module = module.double()
    initial = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    for n, p in module.named_parameters():
        p.requires_grad_(n not in FROZEN)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    return initial, full_batch_steps(module, opt, x, y, STEPS)


def _as_torch(params: dict, like: dict) -> dict:
    """model.h5's arrays in PyTorch's layout (the import keeps Gemm weights transposed)."""
    return {k: (v.T if v.shape != like[k].shape else v) for k, v in params.items()}


def _run(tmp_path, name: str, n: int, overrides: list[str]):
    proc = train_job(n, tmp_path / name, overrides, timeout=180)
    assert proc.returncode == 0, f"{name}: " + explain(proc)
    return tmp_path / name


def test_frozen_parameters_train_as_torch_with_requires_grad_false_and_never_move(tmp_path):
    module, onnx_file, x, y, data = small_mlp_job_files(tmp_path, N)
    base = COMMON + [f"model.path={onnx_file}", f"data.path={data}"]
    one = _run(tmp_path, "one", 1, base + [FREEZE, "checkpoint=off"])
    two = _run(tmp_path, "two", 2, base + [FREEZE, "checkpoint=off"])
    sharded = _run(tmp_path, "sharded", 2, base + [FREEZE, "comm.shard=optimizer", "checkpoint.every_epochs=1"])
    full = _run(tmp_path, "full", 2, base + ["checkpoint=off"])

    initial, want = torch_reference(module, x[:TRAIN], y[:TRAIN])
    got = _as_torch(params_of(one), want)
    assert max_rel_diff(want, got) <= 1e-10, max_rel_diff(want, got)
    for name in (two, sharded):
        assert max_rel_diff(got, _as_torch(params_of(name), want)) <= 1e-10, name
    for run in (one, two, sharded):
        params = _as_torch(params_of(run), want)
        for name in FROZEN:         # the very values PyTorch started from, bit for bit
            assert np.array_equal(params[name], initial[name]), (run.name, name)
        assert not np.array_equal(params["fc1.weight"], initial["fc1.weight"])

    # the bucket leaves them out: per step and rank, MPI's Allreduce of 2 ranks moves the bucket
    frozen_values = sum(initial[n].size for n in FROZEN)
    wire = {run.name: sum(m["wire_bytes"] for m in read_metrics(run)) for run in (two, full)}
    assert wire["full"] - wire["two"] == STEPS * 2 * frozen_values * 8, wire
    line = next(ln for ln in read_log(two).splitlines() if "frozen parameters:" in ln)
    assert f"2 of 4 parameter tensors frozen ({frozen_values} values" in line and "fc1.bias, fc2.weight" in line

    # a sharded checkpoint of epoch 2 resumes (in a new directory) to the same bits; its
    # checkpoints name the frozen set, which a resume checks
    ckpt = sorted((sharded / "checkpoints").glob("ckpt-*.h5"))[1]
    resumed = _run(tmp_path, "resumed", 2, base + [FREEZE, "comm.shard=optimizer", f"resume={ckpt}"])
    assert all(np.array_equal(a, b) for a, b in zip(params_of(sharded).values(), params_of(resumed).values()))

    # cadence and async from the trained full run's weights: the frozen ones keep those values
    start = params_of(full)
    for policy in ("cadence", "async"):
        run = _run(tmp_path, policy, 2, base + [FREEZE, f"policy={policy}", "checkpoint=off",
                                               f"model.init_from={full / 'model.h5'}"])
        params = params_of(run)
        for name in FROZEN:
            assert np.array_equal(params[name], start[name]), (policy, name)
        assert not np.array_equal(params["fc1.weight"], start["fc1.weight"]), policy
        assert np.isfinite(read_metrics(run)[-1]["train_loss"])
