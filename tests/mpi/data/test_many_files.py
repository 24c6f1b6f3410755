"""Many files as one data set, in real `mpirun` jobs: a directory of one-sample int16 volumes
(datasets inside a group, as DeepCAM's `climate/data`) and multi-sample int32 files of
unequal sizes train on 2 ranks as on 1 (float64, within 1e-10), stream bitwise as memory,
scatter, resume on another world size, hold integer inputs as stored; a resume over a
changed file list and a file lost mid-run are one error each."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.checkpoint import read_checkpoint
from tests.mpi.runtime.test_end_to_end import load_params, max_rel_diff
from tests.support.jobs import REPO, explain, launch_cmd, mpi_env, read_metrics, train_job

pytestmark = pytest.mark.mpi

VOLUMES = 256        # one-sample files of 32x32x32 int16 (64 KiB): 192 training, 64 validation
COMMON = ["data=file", "model=mlp", "model.hidden=[4]", "model.num_classes=4", "train.dtype=float64",
          "train.batch_size=16", "train.epochs=2", "data.leftover=partial", "optim.lr=0.01",
          "report.tensorboard=false"]


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many") / "volumes"
    root.mkdir()
    rng = np.random.default_rng(3)
    for i in range(VOLUMES):
        with h5py.File(root / f"v_{i}.h5", "w") as f:       # v_10 sorts before v_2
            f["climate/data"] = rng.integers(0, 8, (32, 32, 32)).astype(np.int16)
            f["climate/labels"] = np.int64(rng.integers(0, 4))
    return root


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-10 * abs(x) for x, y in zip(a, b))


def _params_at(run: Path, step: int) -> np.ndarray:
    return read_checkpoint(run / "checkpoints" / f"ckpt-{step:08d}.h5").arrays["params"]


def test_one_sample_files_stream_as_memory_and_resume_on_another_world_size(tmp_path, volumes):
    base = COMMON + [f"data.path={volumes}", "data.one_sample_per_file=true", "data.x=climate/data",
                     "data.y=climate/labels", "data.val_fraction=0.25"]
    ref, part = tmp_path / "memory_scatter", tmp_path / "stream"
    # 2 ranks, data.cache=memory with scatter, the whole run (a checkpoint at step 17) ...
    proc = train_job(2, ref, base + ["data.distribution=scatter", "checkpoint.every_steps=17"])
    assert proc.returncode == 0, explain(proc)
    assert "data: 256 samples in 256 one-sample files" in proc.stdout, proc.stdout
    # ... as data.cache=stream, stopped in the middle of epoch 2: bitwise the same ...
    proc = train_job(2, part, base + ["data.cache=stream", "train.max_steps=17"])
    assert proc.returncode == 0, explain(proc)
    assert np.array_equal(_params_at(ref, 17), _params_at(part, 17))
    streamed = _summary(part)["ranks"][1]      # its memory apart from its ring: the baseline
    # ... and resumed on 1 rank: the straight run's model and losses, within 1e-10
    proc = train_job(1, part, base + ["data.cache=stream"])
    assert proc.returncode == 0, explain(proc)
    assert _summary(part)["resumed_from"]
    assert max_rel_diff(load_params(ref), load_params(part)) <= 1e-10
    assert _close([r["val_loss"] for r in read_metrics(part)], [r["val_loss"] for r in read_metrics(ref)])
    # int16 inputs held as stored: rank 1 holds its shard's stored bytes (a float64 copy: 4x)
    held = _summary(ref)["ranks"][1]
    assert held["shard_bytes"] == 128 * (32 ** 3 * 2 + 8)      # 96 training + 32 validation rows
    assert held["peak_rss_bytes"] - (streamed["peak_rss_bytes"] - streamed["buffer_bytes"]) \
        < 1.5 * held["shard_bytes"], (held, streamed)
    # a file added to the directory: the checkpoint's list differs, one error naming it
    extra = volumes / "v_99a.h5"
    with h5py.File(extra, "w") as f:
        f["climate/data"] = np.zeros((32, 32, 32), np.int16)
        f["climate/labels"] = np.int64(0)
    try:
        proc = train_job(2, part, base + ["train.epochs=3"], timeout=120)
    finally:
        extra.unlink()
    assert proc.returncode != 0 and "was trained on other data files: data.path has 1 more file(s), the " \
        "first 'v_99a.h5'" in proc.stderr, explain(proc)


@pytest.mark.openmpi
def test_multi_sample_files_of_unequal_sizes_stream_and_scatter_on_two_ranks_as_one(tmp_path):
    data = tmp_path / "parts"
    data.mkdir()
    rng = np.random.default_rng(4)
    for k, n in enumerate([7, 13, 5, 20, 15, 9, 11]):      # validation: the last 16, over 2 files
        with h5py.File(data / f"part_{k}.h5", "w") as f:
            f["x"] = rng.integers(-50, 50, (n, 5)).astype(np.int32)
            f["y"] = rng.integers(0, 4, n).astype(np.int64)
    base = COMMON + [f"data.path={data}/part_*.h5", "checkpoint=off", "train.batch_size=8"]
    proc = train_job(1, tmp_path / "one", base)
    assert proc.returncode == 0, explain(proc)
    assert "data: 80 samples in 7 files" in proc.stdout, proc.stdout
    proc = train_job(2, tmp_path / "two", base + ["data.cache=stream", "data.distribution=scatter"])
    assert proc.returncode == 0, explain(proc)
    assert max_rel_diff(load_params(tmp_path / "one"), load_params(tmp_path / "two")) <= 1e-10
    assert _close([r["val_loss"] for r in read_metrics(tmp_path / "two")],
                  [r["val_loss"] for r in read_metrics(tmp_path / "one")])
    ranks = _summary(tmp_path / "two")["ranks"]
    assert sum(r["shard_bytes"] for r in ranks) == 80 * (5 * 4 + 8)     # int32 as stored


# Root reads a file of mode 000: the unreadable case runs the job without the capabilities that
# let it (setpriv drops them from the bounding set of every process mpirun starts).
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("how", ["deleted", "unreadable"])
def test_a_file_lost_mid_run_ends_the_run_with_one_error_naming_it(tmp_path, how):
    if how == "unreadable" and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root's file-permission override")
    data = tmp_path / "samples"
    data.mkdir()
    rng = np.random.default_rng(5)
    for i in range(40):       # 32 training samples, 16 a rank: s_020 is rank 1's
        with h5py.File(data / f"s_{i:03d}.h5", "w") as f:
            f["x"] = rng.standard_normal(6)
            f["y"] = np.int64(rng.integers(0, 3))
    run = tmp_path / "run"
    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run}", "report.plots=false", "data=file",
                         f"data.path={data}", "data.one_sample_per_file=true", "data.cache=stream",
                         "model=mlp", "model.hidden=[4]", "model.num_classes=3", "train.batch_size=8",
                         "train.epochs=100000", "checkpoint.every_steps=8", "report.tensorboard=false"])
    if how == "unreadable":
        cmd = NO_OVERRIDE + cmd
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((run / "checkpoints").glob("ckpt-*.h5")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.2)
        if how == "deleted":
            (data / "s_020.h5").unlink()
        else:
            (data / "s_020.h5").chmod(0)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, out[-2000:] + err[-2000:]
    said = ("does not exist" if how == "deleted" else "Permission denied")
    assert f"file '{data / 's_020.h5'}'" in err and said in err, err[-3000:]
    assert err.count(str(data / "s_020.h5")) <= 2, err[-3000:]      # one error (one rank's line + its echo)
    for ckpt in (run / "checkpoints").glob("ckpt-*.h5"):
        read_checkpoint(ckpt)          # each one whole: its checksum verified
