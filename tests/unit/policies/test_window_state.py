"""A windowed policy's one window state (`window.WindowState`), and the narrow interface its
streaming sync sees it through (`streaming.WindowHost`). No MPI."""

from __future__ import annotations

import ast
import inspect
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from hpc_rlx.policies import streaming
from hpc_rlx.policies.epochlog import EpochLog
from hpc_rlx.policies.streaming import WindowHost
from hpc_rlx.policies.window import WindowState
from hpc_rlx.policies.windowed import WindowedPolicy


def test_the_positions_move_by_the_reported_and_by_the_planned_counts():
    w = WindowState(2, batches=[8, 16], epoch_samples=200, cursors=[10, 10])
    w.advance([3, 1], 3 * 8 + 16)
    assert w.cursors == [13, 11] and w.epoch_consumed == 40
    w.advance_planned([2, 2])
    assert w.cursors == [15, 13] and w.epoch_consumed == 40 + 2 * 8 + 2 * 16
    assert w.samples_left() == 200 - 88 and w.fraction() == 88 / 200
    assert w.trim([10, 10]) == [6, 4]       # 6 x 8 + 4 x 16: the 112 samples left
    w.end_epoch()
    assert w.epoch_consumed == 0 and w.log is None


def test_the_lr_follows_data_progress_in_global_batches():
    worker = SimpleNamespace(epoch=2, steps_per_epoch=10, lr_at=lambda step: step / 100)
    w = WindowState(2, epoch_samples=400, epoch_consumed=120)
    assert w.lr_step(worker) == 2 * 10 + 3 and w.begin(worker) == 0.23 and w.lr == 0.23


def test_only_the_first_whole_sync_reads_as_free_and_every_fragment_wait_counts():
    w = WindowState(2)
    w.timed_sync(0.5)
    assert w.sync_ms == 0.0 and w.synced
    w.timed_sync(0.25)
    assert w.sync_ms == 250.0
    w.waited(0.125)
    assert w.sync_ms == 125.0


def test_a_restart_drops_the_position_and_measurements_and_keeps_the_lr_and_record():
    log = EpochLog(2)
    w = WindowState(2, batches=[8, 8], epoch_samples=96, cursors=[5, 5], epoch_consumed=80,
                    lr=0.1, sync_ms=3.0, divergence=0.2, cold=False, synced=True, log=log,
                    epoch_log=log, epoch_over=True, adopt_position=True)
    w.costs.add(4.0)
    w.restart(3)
    fresh = WindowState(3, batches=[8, 8], epoch_samples=96, lr=0.1, epoch_log=log, epoch_over=True)
    assert replace(w, costs=fresh.costs) == fresh
    assert w.costs.values == [] and w.costs.n == 3


def test_the_windowed_policy_is_a_window_host_and_the_streaming_sync_uses_nothing_else():
    members = {name for name in vars(WindowHost) if not name.startswith("_")} | set(WindowHost.__annotations__)
    assert members == {"window", "next_window", "local_steps", "stage_report", "reference", "read_report",
                       "restore_agreed", "apply_consensus", "note_sync"}
    for name in members - {"window"}:
        ours = inspect.signature(getattr(WindowedPolicy, name))
        theirs = inspect.signature(getattr(WindowHost, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    # every use of the policy in streaming.py (`policy.X`, `self.policy.X`) is a member of WindowHost
    used = set()
    for node in ast.walk(ast.parse(Path(streaming.__file__).read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "policy") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "policy"):
                used.add(node.attr)
    assert used and used <= members, sorted(used - members)
