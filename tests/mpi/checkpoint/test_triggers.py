"""The default checkpoint save triggers: a time interval, the end of the run and preemption, and
the best epoch kept without a file per epoch. The decisions are tested on a test clock; one real
job counts the files the default job writes."""

from __future__ import annotations

import re
import pytest
import yaml

from hpc_rlx.checkpoint import read_checkpoint
from hpc_rlx.checkpoint.triggers import BestWatch, SaveTriggers

from tests.support.jobs import REPO, explain, read_metrics, train_job

DEFAULT = REPO / "hpc_rlx" / "configs" / "checkpoint" / "default.yaml"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def default_triggers(clock) -> SaveTriggers:
    return SaveTriggers.from_config(yaml.safe_load(DEFAULT.read_text()), clock=clock)


def test_the_default_saves_on_time_not_on_every_epoch_or_step():
    clock = Clock()
    triggers = default_triggers(clock)
    assert triggers.enabled, "the default must still save (end of run, preemption, time)"
    assert not any(triggers.epoch_due(e) for e in range(1, 1000)), "no save per epoch by default"
    assert not any(triggers.steps_due(s) for s in range(1, 10_000)), "no save per N steps by default"
    assert 0 < triggers.every_minutes <= 10, "a long run saves at least every 10 minutes"


def test_a_long_run_saves_every_interval_of_training_counted_from_the_last_save():
    clock = Clock()
    triggers = default_triggers(clock)
    period = 60.0 * triggers.every_minutes
    clock.now += 3600.0            # startup (data loading, resume) does not count ...
    triggers.restart()             # ... training starts here
    clock.now += period - 1
    assert not triggers.minutes_due()
    clock.now += 1
    assert triggers.minutes_due()
    triggers.restart()             # the save was written
    assert not triggers.minutes_due()
    clock.now += period / 2
    assert not triggers.minutes_due()
    clock.now += period / 2
    assert triggers.minutes_due()


def test_explicit_intervals_still_work_and_zero_or_null_turns_them_off():
    clock = Clock()
    c = SaveTriggers(every_steps=5, every_epochs=2, every_minutes=None, clock=clock)
    assert [s for s in range(1, 16) if c.steps_due(s)] == [5, 10, 15]
    assert [e for e in range(1, 7) if c.epoch_due(e)] == [2, 4, 6]
    clock.now += 1e9
    assert not c.minutes_due()
    assert not SaveTriggers(0, 0, 0, clock=clock).enabled
    assert SaveTriggers(None, None, None, clock=clock).describe() == "off"


def test_best_watch_picks_strict_improvements_and_continues_a_resumed_best():
    watch = BestWatch("val_loss")
    assert [watch.offer(s, v) for s, v in [(10, 1.0), (20, 0.8), (30, 0.9), (40, 0.8), (50, None)]] \
        == [True, True, False, False, False]
    resumed = BestWatch("val_accuracy")
    resumed.seed(20, 0.9)
    assert not resumed.offer(30, 0.85) and resumed.offer(40, 0.95)


@pytest.mark.mpi
def test_the_default_job_writes_at_most_two_checkpoints_and_keeps_the_best(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    files = sorted(p.name for p in (run / "checkpoints").glob("ckpt-*.h5"))
    saves = re.findall(r"checkpoint \((\w+)\) at step (\d+):", proc.stdout)
    assert 1 <= len(files) <= 2 and len(saves) == len(files), (files, saves)
    assert {reason for reason, _ in saves} <= {"final", "best"}, saves

    metrics = read_metrics(run)
    last = metrics[-1]["step"]
    best = min(metrics, key=lambda r: (r["val_loss"], r["step"]))
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"ckpt-{last:08d}.h5"
    assert (ckpts / "best").read_text().strip() == f"ckpt-{best['step']:08d}.h5", (files, best)
    # the best file holds that epoch's own state, not a later one: its metric history ends there
    state = read_checkpoint(ckpts / f"ckpt-{best['step']:08d}.h5")
    assert state.meta["step"] == best["step"] and state.meta["step_in_epoch"] == 0
    assert state.meta["history"][-1]["val_loss"] == best["val_loss"]
    assert state.meta["epoch"] == best["epoch"]
    # ... and it is a whole checkpoint: a run continues from it
    again = train_job(2, tmp_path / "again", [f"data.path={digits_h5}", f"resume={ckpts / files[0]}",
                                               f"train.max_steps={int(files[0][5:13]) + 3}"], timeout=180)
    assert again.returncode == 0, explain(again)
    assert f"resumed from {ckpts / files[0]}" in again.stdout, explain(again)
