"""Checkpoint storage: round trips, checksums, atomic writes, retention and resume discovery.

Pure file tests (no MPI): the manager runs on rank 0 only.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rlx.checkpoint import (
    CheckpointManager, CheckpointState, check_compatible, checkpoints_dir, metric_mode,
    plan_deletions, read_checkpoint, verify_checkpoint,
)
from hpc_rlx.checkpoint import h5file as hf
from hpc_rlx.checkpoint import manager as mg
from hpc_rlx.base.errors import CheckpointError, ConfigError

REPO = Path(__file__).resolve().parents[3]
FP = "graph-sha256:0123abcd"


def state(step: int, n: int = 16, **meta) -> CheckpointState:
    rng = np.random.default_rng(step)
    arrays = {
        "params": rng.standard_normal(n).astype(np.float32),
        "opt/m": rng.standard_normal(n),
        "opt/step": np.array(step, dtype=np.int64),
    }
    return CheckpointState(arrays, {"step": step, "graph_fingerprint": FP, **meta})


def on_disk(directory: Path) -> list[int]:
    """Steps of the checkpoint files, by the exact names the manager writes."""
    names = (p.name for p in directory.iterdir() if p.is_file())
    return sorted(int(n[5:13]) for n in names if len(n) == 16 and n.startswith("ckpt-") and n.endswith(".h5"))


def save_sequence(mgr: CheckpointManager, values, first: int = 1) -> None:
    for i, value in enumerate(values):
        mgr.save(state(first + i), first + i, value)


class Warnings(list):
    def __call__(self, message: str) -> None:
        self.append(message)


def flip_byte(path: Path, dataset: str, index: int = 0) -> None:
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    assert offset is not None
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        b = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([b[0] ^ 0x01]))


# ------------------------------------------------------------------ round trips

def test_round_trip_is_bitwise_for_arrays_and_exact_for_meta(tmp_path):
    f32 = np.array([0.1, -0.0, np.inf, -np.inf, 1e-45, 3.4e38], dtype=np.float32)
    nan_payload = np.array([0x7FC00001, 0xFFC12345], dtype=np.uint32).view(np.float32)
    arrays = {
        "params": np.concatenate([f32, nan_payload]),
        "opt/m": np.array([0.1, -0.0, 5e-324, np.nan, 1.7976931348623157e308]),
        "opt/adam/v": np.arange(24, dtype=np.float64).reshape(2, 3, 4)[:, ::2, 1:],  # not contiguous
        "opt/step": np.array(123456789012, dtype=np.int64),
        "rng/key": np.array([2**64 - 1, 0], dtype=np.uint64),
        "policy/mask": np.array([True, False, True]),
        "policy/empty": np.zeros((0, 3), dtype=np.float32),
        "half": np.array([1.5, -2.25], dtype=np.float16),
        "cplx": np.array([1 + 2j, -0.0 - 1j], dtype=np.complex128),
        "bytes": np.arange(7, dtype=np.int8),
        "big_endian": np.array([1.5, -3.0], dtype=">f8"),
    }
    meta = {
        "step": 7, "epoch": 1, "step_in_epoch": 3,
        "shard_positions": [[0, 128], [1, 96]],
        "metric_history": [{"step": 5, "val_loss": 0.1 + 0.2, "val_accuracy": 1 / 3}],
        "big": 2**100, "tiny": 5e-324, "neg_zero": -0.0, "inf": math.inf, "none": None,
        "flag": True, "text": "Größe ✓ \"quoted\" \n\t", "config_yaml": "model:\n  width: 64\n",
        "rng": {"bit_generator": "PCG64", "state": {"state": 2**127 + 12345, "inc": 7}},
        "world_size": 4, "graph_fingerprint": FP,
    }
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(CheckpointState(arrays, meta), 7)
    back = read_checkpoint(path)
    assert list(back.arrays) == list(arrays)
    for name, a in arrays.items():
        b = back.arrays[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        assert b.tobytes() == np.ascontiguousarray(a).tobytes(), name
    assert back.meta == meta and list(back.meta) == list(meta)
    assert math.copysign(1.0, back.meta["neg_zero"]) == -1.0
    assert back.path == path and back.step == 7 and back.info["uid"]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40), st.sampled_from(["<f8", "<f4"]))
def test_any_float_bit_pattern_round_trips(bits, dtype):
    raw = np.array(bits, dtype=np.uint64)
    a = (raw if dtype == "<f8" else (raw & 0xFFFFFFFF).astype(np.uint32)).view(dtype)
    with tempfile.TemporaryDirectory() as d:
        path = CheckpointManager(d, verify_writes=False).save(CheckpointState({"params": a}, {}), 0)
        assert read_checkpoint(path).arrays["params"].tobytes() == a.tobytes()


def test_meta_is_normalised_to_json_types(tmp_path):
    meta = {"pair": (1, 2), "n": np.int64(5), "x": np.float32(0.5), "ok": np.bool_(True)}
    back = read_checkpoint(CheckpointManager(tmp_path).save(CheckpointState({}, meta), 1)).meta
    assert back == {"pair": [1, 2], "n": 5, "x": 0.5, "ok": True}
    assert type(back["n"]) is int and type(back["ok"]) is bool


@pytest.mark.parametrize("arrays, meta, error, words", [
    ({}, {"shard_positions": {0: 12}}, TypeError, ["shard_positions", "0", "strings"]),
    ({}, {"when": object()}, TypeError, ["when", "JSON"]),
    ({"params": [1.0, 2.0]}, {}, TypeError, ["params", "NumPy"]),
    ({"names": np.array(["a"], dtype=object)}, {}, TypeError, ["names", "object"]),
    ({"bad name": np.zeros(1)}, {}, ValueError, ["bad name"]),
    ({"opt//m": np.zeros(1)}, {}, ValueError, ["opt//m"]),
    ({"opt": np.zeros(1), "opt/m": np.zeros(1)}, {}, ValueError, ["'opt'", "'opt/m'", "clash"]),
    ({}, {"step": 3}, ValueError, ["step 3", "step 4"]),
])
def test_unsaveable_state_is_refused_before_touching_disk(tmp_path, arrays, meta, error, words):
    with pytest.raises(error) as info:
        CheckpointManager(tmp_path / "c").save(CheckpointState(arrays, meta), 4)
    for word in words:
        assert word in str(info.value)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ checksum and damaged files

def test_checksum_detects_one_flipped_byte(tmp_path):
    path = CheckpointManager(tmp_path).save(state(3, n=1000), 3)
    read_checkpoint(path)
    flip_byte(path, "arrays/opt/m", index=4001)
    for check in (read_checkpoint, verify_checkpoint):
        with pytest.raises(CheckpointError, match="checksum") as info:
            check(path)
        assert str(path) in str(info.value)


def test_streamed_verification_of_large_arrays(tmp_path, monkeypatch):
    monkeypatch.setattr(hf, "_BLOCK_BYTES", 1000)  # forces block-wise hashing of a 2-D array
    big = np.random.default_rng(0).standard_normal((300, 7))
    path = CheckpointManager(tmp_path).save(CheckpointState({"w": big}, {}), 1)
    assert verify_checkpoint(path)["step"] == 1
    flip_byte(path, "arrays/w", index=300 * 7 * 8 - 3)  # in the last block
    with pytest.raises(CheckpointError, match="checksum"):
        verify_checkpoint(path)


def test_unreadable_files_name_the_file(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        read_checkpoint(missing)
    assert str(missing) in str(info.value)
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(CheckpointError, match="not an HDF5 file") as info:
        read_checkpoint(garbage)
    assert str(garbage) in str(info.value)
    foreign = tmp_path / "model.h5"
    with h5py.File(foreign, "w") as f:
        f["w"] = np.zeros(3)
    with pytest.raises(CheckpointError, match="not an hpc_rlx checkpoint"):
        read_checkpoint(foreign)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_latest_valid_skips_a_damaged_newest_checkpoint(tmp_path, damage):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save_sequence(mgr, [None, None, None])
    newest = tmp_path / "ckpt-00000003.h5"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        flip_byte(newest, "arrays/params", index=5)
    warned = Warnings()
    assert mgr.latest_valid(warn=warned) == tmp_path / "ckpt-00000002.h5"
    assert len(warned) == 1 and "ckpt-00000003.h5" in warned[0]
    warned.clear()
    loaded = CheckpointManager(tmp_path).load_latest(warn=warned)
    assert loaded.step == 2 and loaded.meta["step"] == 2
    assert np.array_equal(loaded.arrays["params"], state(2).arrays["params"])
    assert "ckpt-00000003.h5" in warned[0]


def test_latest_valid_with_nothing_usable(tmp_path):
    assert CheckpointManager(tmp_path / "absent").latest_valid() is None
    assert CheckpointManager(tmp_path).latest_valid() is None
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save_sequence(mgr, [None, None])
    for p in tmp_path.glob("ckpt-*.h5"):
        p.write_bytes(b"\0" * 64)
    warned = Warnings()
    assert mgr.latest_valid(warn=warned) is None
    assert sorted(w.split(":")[0] for w in warned) == [
        f"skipping checkpoint {tmp_path / 'ckpt-00000001.h5'}",
        f"skipping checkpoint {tmp_path / 'ckpt-00000002.h5'}"]


# ------------------------------------------------------------------ retention

def test_keep_last_plus_an_old_best_outside_the_window(tmp_path):
    losses = [2.0, 1.9, 1.8, 1.7, 1.6, 1.55, 1.53, 1.52, 1.515, 1.51, 1.509, 1.508, 1.507, 1.506,
              1.505, 1.504, 1.503, 1.502, 1.497, 1.501, 1.510, 1.512, 1.511, 1.499, 1.513, 1.514,
              1.502, 1.520, 1.506, 1.530]
    mgr = CheckpointManager(tmp_path, keep_last=2, metric="val_loss")
    save_sequence(mgr, losses)
    assert mgr.best_step == 19 and mgr.best_value == 1.497
    assert on_disk(tmp_path) == [19, 29, 30]
    assert (tmp_path / "best").read_text().strip() == "ckpt-00000019.h5"
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000030.h5"


def test_old_best_is_deleted_once_a_newer_best_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    save_sequence(mgr, [3.0, 2.0, 2.5])
    assert on_disk(tmp_path) == [2, 3]
    mgr.save(state(4), 4, 2.6)
    assert on_disk(tmp_path) == [2, 3, 4]
    mgr.save(state(5), 5, 1.5)
    assert mgr.best_step == 5 and on_disk(tmp_path) == [4, 5]


def test_old_best_survives_a_resume_and_goes_when_beaten(tmp_path):
    first = CheckpointManager(tmp_path, keep_last=2)
    save_sequence(first, [3.0, 1.5, 2.0, 2.1, 2.2, 2.3])
    assert on_disk(tmp_path) == [2, 5, 6]

    # without the restored history a fresh manager would drop the old best
    control = tmp_path / "control"
    control.mkdir()
    for step in (2, 5, 6):
        (control / f"ckpt-{step:08d}.h5").write_bytes((tmp_path / f"ckpt-{step:08d}.h5").read_bytes())
    CheckpointManager(control, keep_last=2).save(state(7), 7, 2.4)
    assert on_disk(control) == [6, 7]

    resumed = CheckpointManager(tmp_path, keep_last=2)
    latest = resumed.load_latest()
    assert latest.step == 6
    resumed.restore_history(latest)
    assert resumed.best_step == 2
    resumed.save(state(7), 7, 2.4)
    assert on_disk(tmp_path) == [2, 6, 7]
    resumed.save(state(8), 8, 1.4)
    assert on_disk(tmp_path) == [7, 8] and resumed.best_step == 8


def test_accuracy_metric_keeps_the_highest(tmp_path):
    assert metric_mode("val_accuracy") == "max" and metric_mode("val_loss") == "min"
    mgr = CheckpointManager(tmp_path, keep_last=2, metric="val_accuracy")
    save_sequence(mgr, [0.5, 0.9, 0.7, 0.6, 0.65])
    assert mgr.best_step == 2 and on_disk(tmp_path) == [2, 4, 5]
    mgr.save(state(6), 6, 0.95)
    assert on_disk(tmp_path) == [5, 6]


def test_missing_or_nan_metrics_never_make_a_best(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    save_sequence(mgr, [None, float("nan"), None, None, np.float64("nan")])
    assert mgr.best_step is None and on_disk(tmp_path) == [3, 4, 5]
    assert not (tmp_path / "best").exists()
    mgr.save(state(6), 6, np.float32(0.25))
    assert mgr.best_step == 6 and mgr.best_value == 0.25


def test_resaving_a_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(state(1), 1, 1.0)
    mgr.save(state(2), 2, 0.5)
    mgr.save(state(2, n=4), 2, 2.0)  # e.g. a preemption checkpoint at a step just saved
    assert mgr.best_step == 1 and on_disk(tmp_path) == [1, 2]
    assert read_checkpoint(tmp_path / "ckpt-00000002.h5").arrays["params"].shape == (4,)
    assert [s for s, _ in mgr._history] == [1, 2]


def test_retention_deletes_only_its_own_files(tmp_path):
    keep = ["notes.txt", "ckpt-final.h5", "ckpt-1.h5", "model.h5", "ckpt-00000001.h5.bak", ".hidden"]
    for name in keep:
        (tmp_path / name).write_text("user data")
    (tmp_path / "ckpt-00000000.h5").mkdir()  # a directory with a checkpoint name is not ours
    mgr = CheckpointManager(tmp_path, keep_last=1)
    save_sequence(mgr, [None] * 5)
    assert on_disk(tmp_path) == [5]
    for name in keep:
        assert (tmp_path / name).read_text() == "user data"
    assert (tmp_path / "ckpt-00000000.h5").is_dir()


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 40), max_size=15), st.integers(0, 40), st.integers(1, 4),
       st.one_of(st.none(), st.integers(0, 40)))
def test_plan_deletions_keeps_window_best_and_the_future(existing, current, keep_last, best):
    doomed = set(plan_deletions(existing, current, keep_last, best))
    timeline = sorted({s for s in existing if s <= current} | {current})
    kept = set(timeline[-keep_last:]) | ({best} & set(timeline))
    assert doomed == set(timeline) - kept
    assert current not in doomed and best not in doomed
    assert all(s <= current for s in doomed)


@pytest.mark.parametrize("kwargs, words", [
    ({"keep_last": 0}, ["keep_last", "0"]),
    ({"keep_last": True}, ["keep_last", "True"]),
    ({"keep_last": "2"}, ["keep_last", "'2'"]),
    ({"metric": "val_f1"}, ["val_f1", "mode"]),
    ({"metric": "val_loss", "mode": "lowest"}, ["lowest"]),
])
def test_bad_settings_are_config_errors(tmp_path, kwargs, words):
    with pytest.raises(ConfigError) as info:
        CheckpointManager(tmp_path, **kwargs)
    for word in words:
        assert word in str(info.value)
    assert CheckpointManager(tmp_path, metric="val_f1", mode="max").mode == "max"


# ------------------------------------------------------------------ atomic writes and failures

def assert_previous_intact(directory: Path, step: int = 1) -> None:
    assert (directory / "latest").read_text().strip() == f"ckpt-{step:08d}.h5"
    assert read_checkpoint(directory / f"ckpt-{step:08d}.h5").step == step
    leftovers = [p.name for p in directory.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def _raise_enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("stage", ["write_h5", "fsync_file", "replace_file"])
def test_failed_write_leaves_previous_checkpoint(tmp_path, monkeypatch, stage):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(state(1), 1, 1.0)
    monkeypatch.setattr(hf, stage, _raise_enospc)
    with pytest.raises(CheckpointError) as info:
        mgr.save(state(2), 2, 0.5)
    message = str(info.value)
    assert "could not write checkpoint" in message and "ckpt-00000002.h5" in message
    assert "disk full" in message and "ckpt-00000001.h5" in message
    assert not (tmp_path / "ckpt-00000002.h5").exists()
    assert_previous_intact(tmp_path)
    monkeypatch.undo()
    mgr.save(state(2), 2, 0.5)  # the manager is still usable once space is back
    assert on_disk(tmp_path) == [2]


def test_failed_read_back_and_failed_first_save(tmp_path, monkeypatch):
    def garbled(path):
        raise CheckpointError(f"checkpoint {path} failed its checksum")
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(state(1), 1)
    monkeypatch.setattr(mg, "verify_checkpoint", garbled)
    with pytest.raises(CheckpointError, match="read back differently") as info:
        mgr.save(state(2), 2)
    assert "ckpt-00000001.h5" in str(info.value)
    assert_previous_intact(tmp_path)
    monkeypatch.setattr(hf, "write_h5", _raise_enospc)
    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointError, match="disk full.*no earlier checkpoint was affected"):
        CheckpointManager(fresh).save(state(1), 1)
    assert list(fresh.iterdir()) == []


def test_failed_pointer_update_keeps_both_and_resume_finds_the_new_one(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(state(1), 1)
    monkeypatch.setattr(hf, "write_text_atomic", _raise_enospc)
    with pytest.raises(CheckpointError, match="pointer could not be updated"):
        mgr.save(state(2), 2)
    monkeypatch.undo()
    assert on_disk(tmp_path) == [1, 2]  # nothing deleted after a failure
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000001.h5"
    assert CheckpointManager(tmp_path).latest_valid() == tmp_path / "ckpt-00000002.h5"


def test_insufficient_space_is_refused_before_writing(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    mgr.save(state(1), 1)
    monkeypatch.setattr(mg.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096})())
    with pytest.raises(CheckpointError, match=r"MiB are free .*disk full") as info:
        mgr.save(state(2, n=300_000), 2)
    assert "ckpt-00000002.h5" in str(info.value)
    assert_previous_intact(tmp_path)


def _run_script(body: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    prelude = textwrap.dedent("""
        import json, os, resource, signal, sys
        import numpy as np
        from hpc_rlx.checkpoint import CheckpointManager, CheckpointState
        from hpc_rlx.checkpoint import h5file as hf
        from hpc_rlx.base.errors import CheckpointError
        def state(step, n):
            return CheckpointState({"params": np.full(n, step, dtype=np.float64)}, {"step": step})
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_disk_full_under_rlimit_fsize(tmp_path):
    # limits just below the file's size fail at the last metadata write, smaller ones earlier
    proc = _run_script("""
        mgr = CheckpointManager("ck", keep_last=1)
        mgr.save(state(1, 100), 1)
        size = os.path.getsize(CheckpointManager("probe").save(state(2, 5000), 2))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        results = []
        for limit in (size - 1, size - 300, size // 2, 4096, 100):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            try:
                mgr.save(state(2, 5000), 2)
                error = None
            except CheckpointError as e:
                error = str(e)
            resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
            results.append({"limit": limit, "error": error, "files": sorted(os.listdir("ck"))})
        print(json.dumps(results))
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in results:
        message = r["error"]
        assert message is not None, f"writing under a {r['limit']}-byte file-size limit succeeded"
        assert "could not write checkpoint" in message and "ckpt-00000002.h5" in message
        assert "disk full" in message and "unchanged" in message
        assert r["files"] == ["ckpt-00000001.h5", "latest"]
    assert_previous_intact(tmp_path / "ck")
    CheckpointManager(tmp_path / "ck", keep_last=1).save(state(2), 2)
    assert on_disk(tmp_path / "ck") == [2]


@pytest.mark.parametrize("stage, resumes_at, leaves_temp", [
    ("fsync_file", 1, True),         # killed with the temp file written, before its fsync
    ("replace_file", 1, True),            # killed after fsync and verification, before the rename
    ("write_text_atomic", 2, False),  # killed after the rename, before 'latest' moved
])
def test_kill_at_any_stage_leaves_a_valid_checkpoint(tmp_path, stage, resumes_at, leaves_temp):
    proc = _run_script(f"""
        mgr = CheckpointManager("ck", keep_last=1)
        mgr.save(state(1, 1000), 1)
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        hf.{stage} = die
        mgr.save(state(2, 1000), 2)
        print("not killed")
    """, cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    directory = tmp_path / "ck"
    temps = [p for p in directory.iterdir() if ".tmp-" in p.name]
    assert bool(temps) == leaves_temp
    assert (directory / "latest").read_text().strip() == "ckpt-00000001.h5"
    resumed = CheckpointManager(directory, keep_last=1)
    latest = resumed.load_latest(warn=Warnings())
    assert latest.step == resumes_at
    assert np.all(latest.arrays["params"] == resumes_at)
    resumed.restore_history(latest)
    assert (directory / "latest").read_text().strip() == f"ckpt-{resumes_at:08d}.h5"
    resumed.save(CheckpointState({"params": np.zeros(3)}, {}), 3)
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]  # the leftover is cleaned up
    assert on_disk(directory) == [3]


# ------------------------------------------------------------------ resume choices

def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path):
    first = CheckpointManager(tmp_path, keep_last=5)
    save_sequence(first, [4.0, 3.0, 2.0, 1.0])
    originals = {s: (tmp_path / f"ckpt-{s:08d}.h5").read_bytes() for s in (3, 4)}
    second = CheckpointManager(tmp_path, keep_last=5)
    warned = Warnings()
    second.restore_history(tmp_path / "ckpt-00000002.h5", warn=warned)  # resume=PATH
    moved = sorted(tmp_path.glob("ckpt-*.abandoned-*.h5"))
    assert [p.name[:13] for p in moved] == ["ckpt-00000003", "ckpt-00000004"]
    assert [p.read_bytes() for p in moved] == [originals[3], originals[4]]  # kept, byte for byte
    assert len(warned) == 1 and all(p.name in warned[0] for p in moved)
    assert on_disk(tmp_path) == [1, 2] and second.best_step == 2
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000002.h5"
    assert (tmp_path / "best").read_text().strip() == "ckpt-00000002.h5"
    # preempted before its first save: resume=auto comes back to step 2, not to the moved step 4
    assert CheckpointManager(tmp_path).latest_valid() == tmp_path / "ckpt-00000002.h5"
    second.save(state(3), 3, 2.5)
    second.save(state(4), 4, 2.6)
    assert [p.read_bytes() for p in moved] == [originals[3], originals[4]]
    assert CheckpointManager(tmp_path).load_latest().arrays["params"].tobytes() == \
        state(4).arrays["params"].tobytes()
    for step in range(5, 12):
        second.save(state(step), step, 3.0)
    assert second.best_step == 3 and on_disk(tmp_path) == [3, 7, 8, 9, 10, 11]
    assert len(list(tmp_path.glob("*.abandoned-*"))) == 2


def test_resume_from_another_run_directory(tmp_path):
    old = CheckpointManager(tmp_path / "old", keep_last=1)
    save_sequence(old, [1.0, 2.0])
    new = CheckpointManager(checkpoints_dir(tmp_path / "new"))
    new.restore_history(tmp_path / "old" / "ckpt-00000002.h5")
    assert new.best_step is None and not (tmp_path / "new").exists()
    new.save(state(3), 3, 3.0)
    assert new.best_step == 3 and on_disk(tmp_path / "new" / "checkpoints") == [3]
    assert on_disk(tmp_path / "old") == [1, 2]


def test_changed_metric_rebuilds_best_from_the_metric_history(tmp_path):
    history = []
    mgr = CheckpointManager(tmp_path, keep_last=1, metric="val_loss")
    for step, (loss, acc) in enumerate([(1.0, 0.9), (0.5, 0.6), (0.8, 0.7)], start=1):
        history.append({"epoch": step, "step": step, "val_loss": loss, "val_accuracy": acc})
        mgr.save(state(step, history=list(history)), step, loss)
    assert on_disk(tmp_path) == [2, 3]
    by_acc = CheckpointManager(tmp_path, keep_last=1, metric="val_accuracy")
    warned = Warnings()
    by_acc.restore_history(tmp_path / "ckpt-00000003.h5", warn=warned)
    assert "val_accuracy" in warned[0]
    assert by_acc.best_step == 3  # step 1 had the best accuracy but its file is gone
    by_acc.save(state(4), 4, 0.65)
    assert on_disk(tmp_path) == [3, 4]


def test_foreign_graph_is_refused(tmp_path):
    path = CheckpointManager(tmp_path).save(state(1), 1)
    loaded = read_checkpoint(path)
    check_compatible(loaded, FP)
    with pytest.raises(CheckpointError) as info:
        check_compatible(loaded, "graph-sha256:ffff")
    message = str(info.value)
    assert str(path) in message and "different model graph" in message
    assert FP in message and "graph-sha256:ffff" in message
    without = CheckpointManager(tmp_path / "b").save(CheckpointState({}, {}), 1)
    with pytest.raises(CheckpointError, match="no model graph fingerprint"):
        check_compatible(read_checkpoint(without), FP)
