"""Checkpoints end to end under real mpirun: exact resume (mid-epoch and at an epoch end),
SIGTERM to one rank, fallback from a corrupt checkpoint, a failing write, a resume on fewer
ranks, a foreign model graph, the minutes interval and retention in a real run.

Every job is small (an MLP with one hidden layer of 32 on the digits) and runs in float64
with `comm.deterministic=true`, so "exact" means bitwise: a resumed run must end with the same
bytes as one reference run that went straight through.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from hpc_rlx.checkpoint import read_checkpoint, verify_checkpoint

from tests.support.jobs import REPO, explain, launch_cmd, mpi_env, mpirun, rank_pids, read_metrics, train_job

# the module's fixture runs its jobs once: its tests keep to one pytest-xdist worker
pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("resume-reference")]

EPOCHS = 4


def base(digits_h5: Path) -> list[str]:
    return [f"data.path={digits_h5}", "model.hidden=[32]", "train.dtype=float64",
            "comm.deterministic=true", f"train.epochs={EPOCHS}", "checkpoint.keep_last=10",
            "checkpoint.every_epochs=1"]


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"ckpt-{step:08d}.h5"


def model_params(run: Path) -> dict[str, np.ndarray]:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        diff = int(np.count_nonzero(a[k] != b[k]))
        assert diff == 0, f"{what}: {k} differs in {diff} of {a[k].size} values " \
                          f"(max abs {np.abs(a[k] - b[k]).max():.3e})"


def saved_checkpoints(stdout: str) -> list[tuple[str, int]]:
    """(reason, step) of every checkpoint a job logged, in order."""
    return [(m.group(1), int(m.group(2)))
            for m in re.finditer(r"checkpoint \((\w+)\) at step (\d+):", stdout)]


def ckpt_files(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def ref(tmp_path_factory, digits_h5):
    """The uninterrupted run every resume is compared with; it keeps all its epoch checkpoints."""
    run = tmp_path_factory.mktemp("ckpt_ref") / "run"
    proc = train_job(2, run, base(digits_h5), timeout=120)
    assert proc.returncode == 0, explain(proc)
    spe = int(re.search(r"(\d+) steps/epoch", proc.stdout).group(1))
    assert [s for _, s in saved_checkpoints(proc.stdout)] == [spe * e for e in range(1, EPOCHS + 1)]
    return SimpleNamespace(run=run, spe=spe, last=EPOCHS * spe, params=model_params(run),
                           metrics=read_metrics(run))


def metrics_view(records: list[dict]) -> list[tuple]:
    return [(r["epoch"], r["step"], r["train_loss"], r["train_accuracy"], r["val_loss"],
             r["val_accuracy"]) for r in records]


# ---------------------------------------------------------------------------- exact resume

@pytest.mark.openmpi
def test_exact_resume_mid_epoch_then_at_epoch_end(ref, tmp_path, digits_h5):
    run, spe = tmp_path / "run", ref.spe
    mid, end = spe + spe // 3, 2 * spe
    assert mid % spe, "the first stop must fall inside an epoch"

    proc = train_job(2, run, base(digits_h5) + [f"train.max_steps={mid}"], timeout=90)
    assert proc.returncode == 0, explain(proc)
    state = read_checkpoint(ckpt(run, mid))
    assert (state.meta["epoch"], state.meta["step_in_epoch"]) == (1, mid - spe)
    assert json.loads((run / "summary.json").read_text())["status"] == "max_steps"

    proc = train_job(2, run, base(digits_h5) + [f"train.max_steps={end}"], timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {ckpt(run, mid)}" in proc.stdout, explain(proc)
    # the epoch-end checkpoint holds exactly what the straight run had at that step
    mine, theirs = read_checkpoint(ckpt(run, end)), read_checkpoint(ckpt(ref.run, end))
    assert any(k.startswith("opt/") for k in mine.arrays), sorted(mine.arrays)   # momentum
    assert_bitwise(mine.arrays, theirs.arrays, f"checkpoint at step {end}")
    for key in ("epoch", "step", "step_in_epoch", "optimizer", "history"):
        assert mine.meta[key] == theirs.meta[key], key

    proc = train_job(2, run, base(digits_h5), timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {ckpt(run, end)}" in proc.stdout, explain(proc)
    assert_bitwise(model_params(run), ref.params, "final parameters after two resumes")
    # the epoch records read as one uninterrupted run, train_loss of the split epoch included
    assert metrics_view(read_metrics(run)) == metrics_view(ref.metrics)


# ---------------------------------------------------------------------------- SIGTERM

@pytest.mark.openmpi
def test_sigterm_to_one_rank_checkpoints_next_step_and_resumes_exactly(ref, tmp_path, digits_h5):
    run, spe = tmp_path / "run", ref.spe
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"   # records the requeue instead of talking to Slurm
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    env = mpi_env({"PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"})
    # SLURM_JOB_ID only for the ranks: mpirun itself must not think it runs under Slurm.
    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run}", "report.plots=false", "checkpoint.requeue=true",
                         "++debug.slowdown={0: 100.0, 1: 100.0}", "train.log_every_s=0.001"] + base(digits_h5),
                     rank_env={"SLURM_JOB_ID": "4242"})
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    out: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    progress = re.compile(r"epoch 2/\d+ +\d+% \(step (\d+)/\d+, global step (\d+)\)")
    sent_at = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            out.append(line)
            m = progress.search(line)
            if sent_at is None and m and 3 <= int(m.group(1)) <= spe // 2:
                pids = rank_pids(proc.pid)
                assert set(pids) == {0, 1}, f"rank pids found: {pids}"
                os.kill(pids[1], signal.SIGTERM)       # one rank, not mpirun
                sent_at = int(m.group(2))
        else:
            pytest.fail("the job did not finish within 90 s after start:\n" + "".join(out[-40:]))
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    text = "".join(out)
    assert sent_at is not None, "never saw epoch 2 in progress:\n" + text[-3000:]
    assert rc == 0, text[-4000:]
    m = re.search(r"stop requested \(signal\) at step (\d+)", text)
    assert m, text[-3000:]
    stop = int(m.group(1))
    # Rank 0 had logged step `sent_at` before the signal left; the flag rides the next bucket.
    assert sent_at <= stop <= sent_at + 3, (sent_at, stop)
    assert stop % spe, f"the stop at step {stop} is not mid-epoch"
    assert ("preempt", stop) in saved_checkpoints(text)
    state = read_checkpoint(ckpt(run, stop))
    assert (state.meta["step"], state.meta["step_in_epoch"]) == (stop, stop - spe)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "signal" and summary["steps"] == stop
    assert calls.read_text().split() == ["requeue", "4242"]   # after the checkpoint, once

    proc2 = train_job(2, run, base(digits_h5), timeout=90)
    assert proc2.returncode == 0, explain(proc2)
    assert f"resumed from {ckpt(run, stop)}" in proc2.stdout
    assert_bitwise(model_params(run), ref.params, "parameters after SIGTERM and resume")


# ---------------------------------------------------------------------------- corrupt newest

def flip_byte_in(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        offset = ds.id.get_offset() + ds.nbytes // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_corrupt_newest_checkpoint_falls_back_to_previous(ref, tmp_path, digits_h5):
    run, spe = tmp_path / "run", ref.spe
    shutil.copytree(ref.run, run)
    newest, previous = ckpt(run, ref.last), ckpt(run, ref.last - spe)
    flip_byte_in(newest, "arrays/params")      # silent corruption: only the checksum sees it

    proc = train_job(2, run, base(digits_h5), timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert re.search(rf"warning: skipping checkpoint {re.escape(str(newest))}: .*checksum", proc.stdout), \
        explain(proc)
    assert f"resumed from {previous}" in proc.stdout, explain(proc)
    # the last epoch was trained again, to the same bytes; the corrupt file was kept aside
    assert_bitwise(model_params(run), ref.params, "parameters after the fallback")
    verify_checkpoint(newest)
    assert any(re.fullmatch(rf"ckpt-{ref.last:08d}\.abandoned-.*\.h5", n) for n in ckpt_files(run))
    assert metrics_view(read_metrics(run)) == metrics_view(ref.metrics)


def test_resume_auto_refuses_to_start_over_when_no_checkpoint_is_readable(ref, tmp_path, digits_h5):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (ref.last - ref.spe, ref.last):    # both cut short, as by a failing disk
        data = ckpt(ref.run, step).read_bytes()
        ckpt(run, step).write_bytes(data[: len(data) // 2])
    before = {n: (run / "checkpoints" / n).read_bytes() for n in ckpt_files(run)}
    proc = train_job(2, run, base(digits_h5), timeout=60)
    assert proc.returncode == 2, explain(proc)
    assert "resume=auto: none of the checkpoints" in proc.stderr and "start over in a new hydra.run.dir" in proc.stderr, \
        explain(proc)
    for step in (ref.last - ref.spe, ref.last):
        assert f"skipping checkpoint {ckpt(run, step)}" in proc.stdout, explain(proc)
    assert {n: (run / "checkpoints" / n).read_bytes() for n in ckpt_files(run)} == before


# ---------------------------------------------------------------------------- failing write

# The limit is set after MPI_Init: MPI's own shared-memory files must not hit it.
LIMITED = ("import resource, runpy, sys; from mpi4py import MPI; "
           "resource.setrlimit(resource.RLIMIT_FSIZE, ({0}, {0})); "
           "sys.argv[0] = 'hpc_rlx'; runpy.run_module('hpc_rlx', run_name='__main__', alter_sys=True)")


def test_failing_write_keeps_previous_checkpoint_and_fails_cleanly(ref, tmp_path, digits_h5):
    run = tmp_path / "run"
    shutil.copytree(ref.run, run)
    previous = ckpt(run, ref.last)
    size = previous.stat().st_size
    limit = size // 2       # a checkpoint cannot be written; metrics and pointers can
    before = previous.read_bytes()

    args = ["-c", LIMITED.format(limit), f"hydra.run.dir={run}", "report.plots=false"] \
        + base(digits_h5) + [f"train.epochs={EPOCHS + 1}"]
    t0 = time.monotonic()
    proc = mpirun(2, args, timeout=90)
    assert proc.returncode == 2, explain(proc)
    assert time.monotonic() - t0 < 80
    failed = ckpt(run, ref.last + ref.spe)
    assert f"could not write checkpoint {failed}" in proc.stderr, explain(proc)
    assert "disk full" in proc.stderr and f"previous checkpoint {previous.name}" in proc.stderr
    assert not failed.exists()
    assert previous.read_bytes() == before
    verify_checkpoint(previous)
    assert (run / "checkpoints" / "latest").read_text().strip() == previous.name
    assert not [n for n in ckpt_files(run) if ".tmp-" in n], ckpt_files(run)


# ---------------------------------------------------------------------------- fewer ranks

@pytest.mark.openmpi
def test_resume_on_2_ranks_from_a_mid_epoch_checkpoint_written_on_4(ref, tmp_path, digits_h5):
    run, spe = tmp_path / "run", ref.spe
    mid = spe + spe // 3
    proc = train_job(4, run, base(digits_h5) + [f"train.max_steps={mid}"], timeout=90)
    assert proc.returncode == 0, explain(proc)
    state = read_checkpoint(ckpt(run, mid))
    assert state.meta["world_size"] == 4 and state.meta["step_in_epoch"] == mid - spe

    proc = train_job(2, run, base(digits_h5), timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert "written on 4 ranks, shards re-planned for 2" in proc.stdout, explain(proc)
    # Rows, and so every step's global batch, do not depend on the world size: only the
    # order of the floating-point sums does.
    mine = model_params(run)
    for k, theirs in ref.params.items():
        rel = float(np.abs(mine[k] - theirs).max() / np.abs(theirs).max())
        assert rel <= 1e-10, f"{k}: relative difference {rel:.3e} from the 2-rank straight run"


# ---------------------------------------------------------------------------- resume=PATH

def test_resume_path_refuses_another_graph_and_continues_the_right_one(ref, tmp_path, digits_h5):
    source = ckpt(ref.run, ref.last - ref.spe)
    proc = train_job(2, tmp_path / "other", base(digits_h5) + ["model.hidden=[16]", f"resume={source}"],
                     timeout=60)
    assert proc.returncode == 2, explain(proc)
    assert f"checkpoint {source} was written for a different model graph" in proc.stderr, explain(proc)

    run = tmp_path / "run"
    proc = train_job(2, run, base(digits_h5) + [f"resume={source}"], timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {source}" in proc.stdout
    assert_bitwise(model_params(run), ref.params, "parameters after resume=PATH")
    # a run directory stands for its newest valid checkpoint
    proc = train_job(2, tmp_path / "from_dir", base(digits_h5) + [f"resume={ref.run}"], timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {ckpt(ref.run, ref.last)}" in proc.stdout, explain(proc)
    # the source run directory is left as it was
    assert ckpt_files(ref.run) == sorted(["best", "latest"] + [ckpt(ref.run, s).name for s in
                                                                range(ref.spe, ref.last + 1, ref.spe)])


# ---------------------------------------------------------------------- save triggers and retention

def expected_kept(saves: list[tuple[str, int]], val_loss_at: dict[int, float], keep_last: int) -> set[int]:
    """Independent oracle: the last `keep_last` saves plus the first save with the lowest val_loss."""
    steps = [s for _, s in saves]
    best = None
    for s in steps:
        v = val_loss_at.get(s)
        if v is not None and (best is None or v < val_loss_at[best]):
            best = s
    return set(steps[-keep_last:]) | ({best} if best is not None else set())


def test_minutes_interval_and_keep_last_plus_best_in_a_real_run(tmp_path, digits_h5):
    run = tmp_path / "run"
    # every_steps=10 makes sure the keep-last window moves past the best; the minutes
    # interval adds saves wherever rank 0's clock says so.
    common = [f"data.path={digits_h5}", "model.hidden=[32]", "train.epochs=3", "checkpoint.keep_last=2",
              "checkpoint.every_epochs=1", "checkpoint.every_steps=10", "checkpoint.every_minutes=0.001",
              "++debug.slowdown={0: 100.0, 1: 100.0}"]
    proc = train_job(2, run, common + ["train.max_steps=55"], timeout=90)
    assert proc.returncode == 0, explain(proc)
    spe = int(re.search(r"(\d+) steps/epoch", proc.stdout).group(1))
    assert 2 * spe + 10 - (2 * spe) % 10 < 55 < 3 * spe, "a step interval save must fall between"
    saves = saved_checkpoints(proc.stdout)
    # Saves off both grids come from the minutes interval: rank 0's clock decided, and every
    # rank took part in the save at that same step (else the job would hang or fail).
    minute_steps = [s for r, s in saves if r == "cadence" and s % 10 and s % spe]
    assert minute_steps, saves

    def check(saves):
        # whole epochs rank the checkpoints (a partial epoch's validation does not)
        val = {r["step"]: r["val_loss"] for r in read_metrics(run) if not r.get("partial")}
        kept = expected_kept(saves, val, keep_last=2)
        names = sorted(ckpt(run, s).name for s in kept)
        assert [n for n in ckpt_files(run) if n.startswith("ckpt-")] == names, saves
        best = min((s for _, s in saves if s in val), key=lambda s: (val[s], s))
        assert (run / "checkpoints" / "best").read_text().strip() == ckpt(run, best).name
        return best

    best = check(saves)
    # This run shows both sequences: the epoch-1 best was replaced by the epoch-2 best and
    # deleted, and the epoch-2 best survives outside the keep-last window.
    assert best == 2 * spe and best not in [s for _, s in saves][-2:], saves
    assert not ckpt(run, spe).exists()

    # A resume rebuilds the best from the recorded history, so it survives the saves after it
    # (a manager that forgot it would delete it at the first one).
    proc = train_job(2, run, common + [f"train.max_steps={3 * spe - 2}"], timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {ckpt(run, 55)}" in proc.stdout, explain(proc)
    more = saved_checkpoints(proc.stdout)
    # the last step is saved exactly once: by the final save, or by the minutes interval when its
    # clock fell due at that same step (then the final save has nothing left to write)
    last = 3 * spe - 2
    assert more and more[-1][1] == last and more[-1][0] in ("final", "cadence"), more
    assert [s for _, s in more].count(last) == 1, more
    assert check(saves + more) == best and ckpt(run, best).exists()


# ---------------------------------------------------------------------------- broadcast by buffer

BCAST_SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
from hpc_rlx.checkpoint.runtime import bcast_arrays

comm = MPI.COMM_WORLD
want = {"step": np.array(7, np.int64), "scale": np.array(0.25), "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.float32), "strided": np.arange(12.0).reshape(3, 4)[:, ::2],
        "params": np.linspace(-1, 1, 1001, dtype=np.float32)}
shapes = {k: (list(v.shape), v.dtype.str) for k, v in want.items()}
got = bcast_arrays(comm, want if comm.rank == 0 else None, shapes)
bad = [k for k in want if got[k].shape != want[k].shape or got[k].dtype != want[k].dtype
       or not np.array_equal(got[k], want[k])]
print(f"rank {comm.rank}: bad={bad}", flush=True)
sys.exit(1 if bad else 0)
"""


def test_checkpoint_arrays_reach_every_rank_with_shape_and_dtype_kept():
    proc = mpirun(3, ["-c", BCAST_SCRIPT], timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("bad=[]") == 3, explain(proc)
