"""TensorBoard event files of a run, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json

import pytest

from hpc_rlx.observe import tensorboard_log
from hpc_rlx.config import tensorboard_setting
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.observe.step_log import TENSORBOARD_INTERVAL_S, read_steps

from tests.support.jobs import explain, mpirun, read_metrics, train_job

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the tensorboard package reads the event files")


def _load(run_dir):
    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return files, acc


def _hparams(acc) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2
    meta = acc.SummaryMetadata("_hparams_/session_start_info")
    data = plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content)
    out = {}
    for key, value in data.session_start_info.hparams.items():
        out[key] = getattr(value, value.WhichOneof("kind"))
    return out


@pytest.mark.mpi
def test_a_default_run_writes_step_epoch_and_hparam_events(tmp_path, digits_h5):
    run_dir = tmp_path / "run"
    proc = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=3", "optim.lr=0.05",
                                  "data.distribution=read"])
    assert proc.returncode == 0, explain(proc)
    files, acc = _load(run_dir)
    assert len(files) == 1, files                 # rank 0 only
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "val/loss", "val/accuracy",
            "epoch/train_loss"} <= tags, tags
    epochs = [m for m in read_metrics(run_dir) if "epoch" in m]
    val = acc.Scalars("val/loss")
    assert [e.step for e in val] == [m["step"] for m in epochs]
    assert [e.value for e in val] == pytest.approx([m["val_loss"] for m in epochs], rel=1e-6)
    loss = acc.Scalars("train/loss")
    steps = [e.step for e in loss]
    assert steps == sorted(steps) and 1 <= len(steps) <= epochs[-1]["step"]
    # bounded rate: no closer than TENSORBOARD_INTERVAL_S apart
    wall = [e.wall_time for e in loss]
    assert all(b - a >= TENSORBOARD_INTERVAL_S * 0.9 for a, b in zip(wall, wall[1:])), wall
    assert all(0 < e.value < 10 for e in loss)
    lr = [e.value for e in acc.Scalars("train/lr")]
    assert all(0 < v <= 0.05 + 1e-9 for v in lr), lr
    hp = _hparams(acc)
    assert hp["optim.lr"] == pytest.approx(0.05) and hp["world_size"] == 2
    assert hp["train.epochs"] == 3 and hp["data.distribution"] == "read" and hp["model.name"] == "mlp"
    # the per-step log the plots read: bounded, in order, with the same keys
    recs = read_steps(run_dir / "steps.jsonl")
    assert recs and [r["step"] for r in recs] == sorted(r["step"] for r in recs)
    assert {"step", "epoch", "loss", "lr", "samples_per_s", "time_s"} <= set(recs[0])


@pytest.mark.mpi
def test_tensorboard_off_writes_no_events(tmp_path, digits_h5):
    run_dir = tmp_path / "run"
    proc = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=1", "report.tensorboard=false"])
    assert proc.returncode == 0, explain(proc)
    assert not (run_dir / "tensorboard").exists()


@pytest.mark.mpi
def test_tensorboard_true_without_the_library_is_one_clear_error(tmp_path, digits_h5):
    # every rank's interpreter starts as if tensorboardX were not installed: neither found
    # nor importable (a None entry in sys.modules, set by a sitecustomize ahead on the path)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboardX'] = None\n")
    env = {"PYTHONPATH": str(shadow)}
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "report.tensorboard=true"], env=env)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.count("report.tensorboard=true, but tensorboardX is not installed") == 1, explain(proc)
    assert "Traceback" not in proc.stderr
    # auto: the same machine trains without event files
    run_dir = tmp_path / "run2"
    proc = train_job(2, run_dir, [f"data.path={digits_h5}", "train.epochs=1"], env=env)
    assert proc.returncode == 0, explain(proc)
    assert not (run_dir / "tensorboard").exists() and (run_dir / "summary.json").is_file()


@pytest.mark.mpi
def test_a_bad_tensorboard_value_is_a_config_error(tmp_path, digits_h5):
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "report.tensorboard=maybe"])
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.count("report.tensorboard='maybe' is not one of auto, true, false") == 1, explain(proc)


def test_settings_and_hparams_are_flat():
    assert tensorboard_setting.normalize_setting(True) == "true"
    assert tensorboard_setting.normalize_setting("AUTO") == "auto"
    with pytest.raises(ConfigError):
        tensorboard_setting.normalize_setting("yes")
    hp = tensorboard_log.flat_hparams({"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "model": {"hidden": None},
                                       "hydra": {"x": 1}}, 4)
    assert hp == {"world_size": 4, "optim.lr": 0.1, "optim.betas": json.dumps([0.9, 0.99]),
                  "model.hidden": "null"}


@pytest.mark.mpi
def test_each_sweep_point_has_its_own_events_with_its_hparams(tmp_path, digits_h5):
    sweep = tmp_path / "sweep"
    proc = mpirun(2, ["-m", "hpc_rlx", "-m", "optim.lr=0.1,0.05", "train.epochs=1", "report.plots=false",
                      f"data.path={digits_h5}", f"hydra.sweep.dir={sweep}"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    lrs = {}
    for point in ("0", "1"):
        files, acc = _load(sweep / point)
        assert len(files) == 1 and acc.Scalars("val/loss"), files
        lrs[point] = _hparams(acc)["optim.lr"]
    assert lrs == pytest.approx({"0": 0.1, "1": 0.05})


def test_the_writer_does_not_import_torch(tmp_path):
    """tensorboardX would import torch where it is installed (seconds of rank 0's startup)."""
    import subprocess
    import sys

    code = ("import sys; from hpc_rlx.observe.tensorboard_log import TensorBoardLog; from hpc_rlx.config.tensorboard_setting import available; "
            f"assert available(); b = TensorBoardLog({str(tmp_path)!r}, {{'optim.lr': 0.1}}); "
            "b.step(1, {'loss': 1.0}); b.close(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
