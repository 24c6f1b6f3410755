"""The pipeline bubble per stage: the pure measurement on a hand-made trace with a known answer,
and `python -m hpc_rlx.report` on a real 2-stage run with the trace on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc_rlx.observe.pipeline_bubble import rank_bubbles, stage_bubbles, theory

from tests.support.jobs import explain, train_job


def _meta(pid, tid, name):
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _x(name, pid, tid, ts, dur, micro=None):
    e = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if micro is not None:
        e["args"] = {"micro": micro}
    return e


def hand_trace():
    """S=2, M=2, GPipe with unit-time forward and backward (in ms): each stage is busy 4 of the
    6 time units of a step; stage 1 waits 1 unit for its first activations. Two steps, the first
    slower (warm-up: 12 units, the same spans) so that skipping it changes the answer."""
    ev = [_meta(0, 0, "main"), _meta(0, 1, "stage 0"), _meta(1, 0, "main"), _meta(1, 1, "stage 1")]
    for t0, length in ((0, 12_000), (20_000, 6_000)):
        ev += [_x("pipeline step", 0, 0, t0, length), _x("pipeline step", 1, 0, t0, length)]
        # stage 0: F0 F1 . . B0 B1 at 0,1 | 4,5 ; stage 1: . F0 F1 B1 B0 . at 1,2,3,4
        ev += [_x("forward", 0, 1, t0 + 0, 1000, 0), _x("forward", 0, 1, t0 + 1000, 1000, 1),
               _x("backward", 0, 1, t0 + 4000, 1000, 1), _x("backward", 0, 1, t0 + 5000, 1000, 0),
               _x("recv gradients", 0, 0, t0 + 2000, 2000, 1)]
        ev += [_x("recv activations", 1, 0, t0 + 0, 1000, 0),
               _x("forward", 1, 1, t0 + 1000, 1000, 0), _x("forward", 1, 1, t0 + 2000, 1000, 1),
               _x("backward", 1, 1, t0 + 3000, 1000, 1), _x("backward", 1, 1, t0 + 4000, 1000, 0)]
    ev.append(_x("forward", 0, 1, 40_000, 1000, 0))     # outside every step: not counted
    return ev


def test_bubble_of_a_hand_made_trace():
    rows = stage_bubbles(hand_trace(), skip_steps=1)
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert r["steps"] == 1 and r["micro"] == 2 and r["stages"] == 2
        assert r["step_s"] == pytest.approx(0.006)
        assert r["busy_s"] == pytest.approx(0.004)
        assert r["bubble"] == pytest.approx(1 / 3)
        assert r["theory"] == pytest.approx(1 / 3)      # (S-1)/(M+S-1) with S=M=2
    assert rows[0]["wait_s"] == pytest.approx(0.002) and rows[0]["wait_fraction"] == pytest.approx(1 / 3)
    assert rows[1]["wait_s"] == pytest.approx(0.001)
    both = rank_bubbles(hand_trace())
    assert both[0]["steps"] == 2 and both[0]["step_s"] == pytest.approx(0.018)
    assert both[0]["bubble"] == pytest.approx(1 - 8 / 18)


def test_theory():
    assert theory(1, 4) == 0.0
    assert theory(2, 4) == pytest.approx(1 / 5)
    assert theory(4, 8) == pytest.approx(3 / 11)


def test_a_trace_without_pipeline_spans_has_no_bubble():
    assert stage_bubbles([_x("step", 0, 0, 0, 10), _x("forward_backward", 0, 0, 0, 5)]) == []


@pytest.mark.mpi
def test_report_prints_the_bubble_of_a_real_pipelined_run(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}", "train.epochs=1", "train.batch_size=32",
                              "train.max_steps=6", "model.hidden=[32,16]", "checkpoint=off",
                              "trace.enabled=true", "parallel.pipeline_stages=2", "parallel.microbatches=4"])
    assert proc.returncode == 0, explain(proc)
    doc = json.loads((run / "trace.json").read_text())
    events = doc["traceEvents"]
    rows = stage_bubbles(events, skip_steps=1)
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert r["micro"] == 4 and r["steps"] >= 1
        assert 0.0 <= r["bubble"] <= 1.0 and 0.0 <= r["wait_fraction"] <= 1.0
        assert r["theory"] == pytest.approx(1 / 5)
        # consistent with the spans: busy is the forward/backward time inside the counted steps
        pid = r["ranks"][0]
        steps = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == pid
                        and e["name"] == "pipeline step"), key=lambda e: e["ts"])[1:]
        lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        busy = sum(e["dur"] for e in events if e.get("ph") == "X" and e["pid"] == pid
                   and e["name"] in ("forward", "backward") and lo <= e["ts"] <= hi)
        assert r["busy_s"] == pytest.approx(busy * 1e-6, rel=1e-9)
        assert r["step_s"] == pytest.approx(sum(e["dur"] for e in steps) * 1e-6, rel=1e-9)
        assert r["bubble"] == pytest.approx(1 - r["busy_s"] / r["step_s"], rel=1e-9)
        assert r["busy_s"] + r["wait_s"] <= r["step_s"] * (1 + 1e-9)
    out = subprocess.run([sys.executable, "-m", "hpc_rlx.report", str(run), "--no-plots"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pipeline bubble per stage (2 stages, 4 micro-batches" in out.stdout, out.stdout
    table = out.stdout.split("pipeline bubble per stage")[1].splitlines()
    assert "(S-1)/(M+S-1)" in table[1]
    assert table[2].split()[0] == "0" and table[3].split()[0] == "1"
    assert table[2].split()[-1] == "0.200"
    assert float(table[2].split()[4]) == pytest.approx(rows[0]["bubble"], abs=6e-4)
