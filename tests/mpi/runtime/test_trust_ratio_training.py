"""optim=lamb and optim=lars in real `mpirun` jobs, float64: 5 steps of a tiny MLP (one step
an epoch, so each epoch's train_loss is that step's loss) equal a reference loop written here
(NumPy forward and backward, the update as lamb.py and lars.py state it, per parameter) to
<= 1e-10, on 1 rank and on 2 ranks with comm.shard=optimizer, whose slice boundary cuts a
parameter (its trust-ratio norms then come from both ranks); LAMB under schedule=multistep
with a warm-up; and a sharded run stopped after 3 steps resumes on 1 rank unsharded with the
optimizer state it saved."""

from __future__ import annotations

import bisect
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.base.even_split import segments as slices
from hpc_rlx.optim.segments import cut_parameters

from tests.support.jobs import explain, read_metrics, train_job

pytestmark = pytest.mark.mpi

N_TRAIN, N_VAL, FEATURES, HIDDEN, CLASSES, STEPS = 32, 8, 6, 8, 3, 5
NAMES = ("fc0.weight", "fc0.bias", "head.weight", "head.bias")     # the mlp builder's, in order
SHAPES = ((FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, CLASSES), (CLASSES,))
LAMB = {"name": "lamb", "lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.02}
LARS = {"name": "lars", "lr": 2.0, "momentum": 0.9, "weight_decay": 0.001, "trust_coefficient": 0.01}
MULTISTEP = {"warmup_steps": 2, "milestones": [1, 2], "gamma": 0.5}    # lr: b/2, b, b, b/2, b/4


def _files(folder: Path) -> tuple[Path, Path, np.ndarray, np.ndarray, dict]:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((N_TRAIN + N_VAL, FEATURES))
    y = np.arange(N_TRAIN + N_VAL) % CLASSES
    rng.shuffle(y)
    data, init = folder / "data.h5", folder / "init.h5"
    with h5py.File(data, "w") as f:
        f["x"], f["y"] = x, y
    params = {name: rng.standard_normal(shape) * 0.5 for name, shape in zip(NAMES, SHAPES)}
    params["head.bias"][:] = 0.0            # a parameter at 0: its trust ratio is 1
    with h5py.File(init, "w") as f:
        for name, value in params.items():
            f[name] = value
    return data, init, x[:N_TRAIN], y[:N_TRAIN], params


def _loss_and_grads(p: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
    """The mlp's mean cross-entropy (linear, relu, linear) and its gradient, by hand."""
    pre = x @ p["fc0.weight"] + p["fc0.bias"]
    h = np.maximum(pre, 0.0)
    z = h @ p["head.weight"] + p["head.bias"]
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    n = len(y)
    dz = np.exp(logp)
    dz[np.arange(n), y] -= 1.0
    dz /= n
    dh = (dz @ p["head.weight"].T) * (pre > 0)
    return float(-logp[np.arange(n), y].mean()), {
        "fc0.weight": x.T @ dh, "fc0.bias": dh.sum(0), "head.weight": h.T @ dz, "head.bias": dz.sum(0)}


def _lr(opt: dict, step: int, schedule: dict | None) -> float:
    """The documented schedule: a linear warm-up, then gamma per milestone reached, counted
    from the warm-up's end (or constant)."""
    if schedule is None:
        return opt["lr"]
    w = schedule["warmup_steps"]
    if step < w:
        return opt["lr"] * (step + 1) / w
    return opt["lr"] * schedule["gamma"] ** bisect.bisect_right(schedule["milestones"], step - w)


def _reference(opt: dict, params: dict, x, y, schedule=None) -> tuple[list[float], dict]:
    """STEPS steps of the update the optimizer's module states, per parameter tensor."""
    p = {k: v.copy() for k, v in params.items()}
    state = {k: [np.zeros_like(v), np.zeros_like(v)] for k, v in p.items()}
    losses = []
    for step in range(STEPS):
        loss, grads = _loss_and_grads(p, x, y)
        losses.append(loss)
        lr = _lr(opt, step, schedule)
        for k, g in grads.items():
            w, (a, b) = p[k], state[k]
            if opt["name"] == "lamb":
                b1, b2 = opt["betas"]
                a[...] = b1 * a + (1 - b1) * g
                b[...] = b2 * b + (1 - b2) * g * g
                t = step + 1
                u = (a / (1 - b1**t)) / (np.sqrt(b / (1 - b2**t)) + opt["eps"]) + opt["weight_decay"] * w
                pn, un = np.linalg.norm(w), np.linalg.norm(u)
                p[k] = w - lr * (pn / un if pn > 0 and un > 0 else 1.0) * u
            else:
                wd, pn, gn = opt["weight_decay"], np.linalg.norm(w), np.linalg.norm(g)
                ratio = opt["trust_coefficient"] * pn / (gn + wd * pn) if pn > 0 and gn > 0 else 1.0
                a[...] = opt["momentum"] * a + lr * ratio * (g + wd * w)
                p[k] = w - a
    return losses, p


def _overrides(data: Path, init: Path, opt: dict, schedule: dict | None) -> list[str]:
    keys = [f"optim={opt['name']}"] + [
        f"optim.{k}={list(v) if isinstance(v, tuple) else v}" for k, v in opt.items() if k != "name"]
    sched = (["optim.schedule=constant"] if schedule is None else
             ["optim.schedule=multistep"] + [f"optim.{k}={v}" for k, v in schedule.items()])
    return [f"data.path={data}", f"model.init_from={init}", "model.hidden=[8]", "train.dtype=float64",
            f"train.batch_size={N_TRAIN}", f"train.epochs={STEPS}", "data.shuffle=false",
            f"data.val_fraction={N_VAL / (N_TRAIN + N_VAL)}", "comm.deterministic=true", "report.tensorboard=false"] + keys + sched


def _final(run: Path) -> dict:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def _assert_matches(run: Path, losses: list[float], params: dict, what: str) -> None:
    got = [r["train_loss"] for r in read_metrics(run)]
    assert len(got) == STEPS, (what, got)
    np.testing.assert_allclose(got, losses, rtol=1e-10, atol=0, err_msg=what)
    final = _final(run)
    for k, v in params.items():
        rel = float(np.abs(final[k] - v).max() / max(np.abs(v).max(), 1e-300))
        assert rel <= 1e-10, f"{what}: {k} differs from the reference by {rel:.3e} (relative)"


def _cut_by_two_slices() -> list[int]:
    spans, off = [], 0
    for name, shape in zip(NAMES, SHAPES):
        spans.append((name, off, int(np.prod(shape))))
        off += spans[-1][2]
    return cut_parameters(spans, [lo for lo, _ in slices(off, 2)[1:]])


@pytest.mark.parametrize("opt, schedule", [(LAMB, MULTISTEP), (LARS, None)], ids=["lamb-multistep", "lars"])
def test_one_rank_equals_the_reference_loop(tmp_path, opt, schedule):
    data, init, x, y, params = _files(tmp_path)
    losses, final = _reference(opt, params, x, y, schedule)
    assert losses[-1] < losses[0]
    run = tmp_path / "run"
    proc = train_job(1, run, _overrides(data, init, opt, schedule) + ["checkpoint=off"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    _assert_matches(run, losses, final, f"{opt['name']} on 1 rank")


def test_lars_sharded_over_two_ranks_with_a_cut_parameter_equals_the_reference_loop(tmp_path):
    """comm.shard=optimizer: the two slices' boundary falls inside fc0.weight, whose trust
    ratio then needs both ranks' parts of its norms."""
    assert _cut_by_two_slices() == [0]
    data, init, x, y, params = _files(tmp_path)
    losses, final = _reference(LARS, params, x, y)
    run = tmp_path / "run"
    proc = train_job(2, run, _overrides(data, init, LARS, None) + ["comm.shard=optimizer", "checkpoint=off"],
                     timeout=240)
    assert proc.returncode == 0, explain(proc)
    _assert_matches(run, losses, final, "lars on 2 ranks, comm.shard=optimizer")


@pytest.mark.parametrize("opt, schedule", [(LAMB, MULTISTEP), (LARS, None)], ids=["lamb-multistep", "lars"])
def test_sharded_state_with_a_cut_parameter_resumes_on_one_rank_unsharded(tmp_path, opt, schedule):
    """3 steps on 2 ranks with sliced state (fc0.weight cut), then the checkpoint's LAMB
    moments (LARS's momentum), gathered whole, resume on 1 rank without sharding: all 5 steps
    equal the reference loop."""
    assert _cut_by_two_slices() == [0]
    data, init, x, y, params = _files(tmp_path)
    losses, final = _reference(opt, params, x, y, schedule)
    run = tmp_path / "run"
    common = _overrides(data, init, opt, schedule) + ["checkpoint.every_epochs=1"]
    proc = train_job(2, run, common + ["comm.shard=optimizer", "train.max_steps=3"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    sharded = [r["train_loss"] for r in read_metrics(run)]
    np.testing.assert_allclose(sharded, losses[:3], rtol=1e-10, atol=0, err_msg="the 3 sharded steps")
    proc = train_job(1, run, common, timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert "written on 2 ranks, shards re-planned for 1" in proc.stdout, explain(proc)
    _assert_matches(run, losses, final, f"{opt['name']} resumed on 1 rank from a 2-rank sharded checkpoint")
