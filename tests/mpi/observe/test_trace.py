"""Chrome-trace timeline: span recording, clock-offset math, merge and wait inference, the
disabled path, and real mpirun runs (skewed clocks aligned; a training run's trace.json)."""

from __future__ import annotations

import json
import statistics
import textwrap
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rlx.base import trace

from tests.support.jobs import REPO, explain, mpirun, train_job


@pytest.fixture(autouse=True)
def _no_active_tracer():
    trace.ACTIVE = None
    yield
    trace.ACTIVE = None


# ---- recording ---------------------------------------------------------------------------

def test_disabled_span_is_a_shared_no_op():
    a = trace.span("optimizer", "optim")
    b = trace.span("step", "step", args={"step": 3})
    assert a is b is trace._NULL          # nothing allocated, nothing recorded
    with a:
        pass


def test_enabled_spans_are_recorded_in_order_with_tracks_and_args():
    ticks = iter(range(100))
    tr = trace.Tracer(rank=1, host="h", clock=lambda: float(next(ticks)))
    trace.ACTIVE = tr
    with trace.span("step", "step"):
        with trace.span("optimizer", "optim", args={"lr": 0.1}):
            pass
    tr.add("forward_backward", "compute", "lane cpu0", 10.0, 12.5, {"n": 4})
    names = [e[0] for e in tr.events]
    assert names == ["optimizer", "step", "forward_backward"]   # inner span closes first
    opt, step, fb = tr.events
    assert step[3] <= opt[3] <= opt[4] <= step[4]
    assert opt[5] == {"lr": 0.1} and fb[2] == "lane cpu0" and fb[4] - fb[3] == 2.5


def test_event_cap_counts_instead_of_storing():
    tr = trace.Tracer(max_events=3)
    for i in range(10):
        tr.add("x", "", trace.MAIN, i, i + 1)
    assert len(tr.events) == 3 and tr.dropped == 7


def test_sequence_numbers_count_collectives():
    tr = trace.Tracer()
    assert [tr.next_seq() for _ in range(3)] == [1, 2, 3]


# ---- clock offsets -----------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(offset=st.floats(-1e4, 1e4), base=st.floats(0, 1e5),
       delays=st.lists(st.tuples(st.floats(1e-6, 5e-3), st.floats(1e-6, 5e-3)), min_size=1, max_size=8))
def test_ping_offset_is_within_half_the_best_round_trip(offset, base, delays):
    samples, t = [], base
    for out, back in delays:
        t0 = t
        t1 = t0 + out + offset           # remote reads its clock when the ping arrives
        t2 = t0 + out + back
        samples.append((t0, t1, t2))
        t = t2 + 1e-3
    est, rtt, _ = trace.offset_from_pings(samples)
    assert rtt == pytest.approx(min(o + b for o, b in delays), rel=1e-6, abs=1e-9)
    assert abs(est - offset) <= rtt / 2 + 1e-6 * max(1.0, abs(offset), base)


def test_offset_interpolates_linear_drift():
    start, end = (2.0, 100.0), (2.010, 200.0)     # remote gains 10 ms over 100 s of rank-0 time
    assert trace.offset_at(100.0 + 2.0, start, end) == pytest.approx(2.0)
    assert trace.offset_at(150.0 + 2.0, start, end) == pytest.approx(2.005)
    assert trace.offset_at(200.0 + 2.0, start, end) == pytest.approx(2.010, abs=1e-6)
    assert trace.offset_at(123.0, start, None) == 2.0


# ---- merge ---------------------------------------------------------------------------------

def _fake_rank(rank, skew, enter, leave, dropped=0):
    ev = [("allreduce", "comm", trace.MAIN, enter + skew, leave + skew, {"seq": 1}),
          ("chunk", "comm", trace.MAIN, enter + skew, leave + skew, {"seq": 1, "i": 0}),
          ("forward_backward", "compute", "lane cpu0", enter - 0.5 + skew, enter - 0.1 + skew, None)]
    return {"rank": rank, "host": "n%d" % rank, "events": ev, "dropped": dropped}


def test_merge_aligns_clocks_and_infers_waits():
    # rank 1's clock reads 1000 s ahead; it enters the allreduce 0.4 s after rank 0.
    parts = [_fake_rank(0, 0.0, 10.0, 10.6), _fake_rank(1, 1000.0, 10.4, 10.6)]
    doc = trace.merge(parts, {0: (0.0, 0.0), 1: (1000.0, 0.0)}, None, origin=9.0)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    ends = {e["pid"]: e["ts"] + e["dur"] for e in xs if e["name"] == "allreduce"}
    assert ends[0] == pytest.approx(ends[1]) == pytest.approx(1.6e6)
    waits = [e for e in xs if e["name"] == "wait"]
    assert len(waits) == 1 and waits[0]["pid"] == 0
    assert waits[0]["ts"] == pytest.approx(1.0e6) and waits[0]["dur"] == pytest.approx(0.4e6)
    # tracks: main is tid 0, the lane gets its own named thread
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "main"), (0, "lane cpu0"), (1, "main"), (1, "lane cpu0")}
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {0: "rank 0 (n0)", 1: "rank 1 (n1)"}
    fb = [e for e in xs if e["name"] == "forward_backward"]
    assert {e["tid"] for e in fb} == {1}
    assert doc["otherData"]["waits_inferred"] is True


def test_single_chunk_allreduce_is_its_own_chunk_for_waits():
    def part(rank, enter):
        return {"rank": rank, "host": "", "dropped": 0, "events": [
            ("allreduce", "comm", trace.MAIN, enter, 2.0, {"seq": 4, "chunks": 1})]}
    doc = trace.merge([part(0, 1.0), part(1, 1.25)], {}, None, origin=0.0)
    waits = [e for e in doc["traceEvents"] if e.get("name") == "wait"]
    assert len(waits) == 1 and waits[0]["pid"] == 0
    assert waits[0]["ts"] == pytest.approx(1.0e6) and waits[0]["dur"] == pytest.approx(0.25e6)


def test_merge_skips_waits_when_events_were_dropped():
    parts = [_fake_rank(0, 0.0, 10.0, 10.6), _fake_rank(1, 0.0, 10.4, 10.6, dropped=5)]
    doc = trace.merge(parts, {}, None, origin=0.0)
    assert not [e for e in doc["traceEvents"] if e.get("name") == "wait"]
    assert doc["otherData"]["dropped_events"] == {"0": 0, "1": 5}


def test_write_is_valid_json_and_summarize_totals(tmp_path):
    parts = [_fake_rank(0, 0.0, 10.0, 10.6), _fake_rank(1, 0.0, 10.4, 10.6)]
    doc = trace.merge(parts, {}, None, origin=0.0)
    path = trace.write(doc, tmp_path / "trace.json")
    assert json.loads(path.read_text())["traceEvents"] == doc["traceEvents"]
    assert not list(tmp_path.glob("*.tmp"))
    tot = trace.summarize(doc)
    assert tot["allreduce"] == pytest.approx(0.6 + 0.2)
    assert tot["wait"] == pytest.approx(0.4)


def test_start_disabled_clears_the_tracer_and_finish_without_tracer_is_local():
    trace.ACTIVE = trace.Tracer()
    assert trace.start(comm=None, enabled=False) is None and trace.ACTIVE is None
    assert trace.finish(comm=None, tracer=None, path=None) is None


def assert_properly_nested(xs: list[dict], slack_us: float = 1.0) -> None:
    """Per track, spans either nest or follow each other (what the viewers draw correctly)."""
    tracks = defaultdict(list)
    for e in xs:
        tracks[(e["pid"], e["tid"])].append(e)
    for key, evs in tracks.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - slack_us:
                stack.pop()
            if stack:
                parent = stack[-1]
                assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + slack_us, (key, parent, e)
            stack.append(e)


def test_nesting_check_catches_overlap():
    ok = [{"pid": 0, "tid": 0, "ts": 0, "dur": 10}, {"pid": 0, "tid": 0, "ts": 2, "dur": 3},
          {"pid": 0, "tid": 0, "ts": 10, "dur": 5}]
    assert_properly_nested(ok)
    with pytest.raises(AssertionError):
        assert_properly_nested(ok + [{"pid": 0, "tid": 0, "ts": 8, "dur": 5}])


@pytest.mark.parametrize("drift", [2e-4, -2e-4, 3.0, -3.0])
def test_drift_correction_keeps_a_ranks_spans_in_sequence_and_nested(drift):
    # Rank 1's clock is 5 s ahead; the two offset measurements, 1 s of rank-0 time apart,
    # disagree by `drift` per second (noise under load reads as 1e-4; 3.0 is absurd).
    # Epoch 1 ends at the very reading where epoch 2 starts; the last step ends with its epoch.
    events = [("step", "step", trace.MAIN, 5.8, 5.9, None),
              ("epoch 1", "epoch", trace.MAIN, 5.1, 5.9, None),
              ("epoch 2", "epoch", trace.MAIN, 5.9, 6.3, None),
              ("step", "step", trace.MAIN, 5.9, 6.0, None)]
    parts = [{"rank": 1, "host": "", "dropped": 0, "events": events}]
    doc = trace.merge(parts, {1: (5.0, 0.0)}, {1: (5.0 + drift, 1.0)}, origin=0.0)
    xs = {(e["name"], e["ts"]): e for e in doc["traceEvents"] if e["ph"] == "X"}
    by_name = sorted(xs.values(), key=lambda e: e["ts"])
    e1 = next(e for e in by_name if e["name"] == "epoch 1")
    e2 = next(e for e in by_name if e["name"] == "epoch 2")
    last_step, first_step = [e for e in by_name if e["name"] == "step"]
    assert e2["ts"] >= e1["ts"] + e1["dur"] - 1e-6, (e1, e2)
    assert first_step["ts"] >= last_step["ts"] + last_step["dur"] - 1e-6
    assert last_step["ts"] + last_step["dur"] <= e1["ts"] + e1["dur"] + 1e-6
    assert all(e["dur"] > 0 for e in by_name)
    assert_properly_nested(list(xs.values()), slack_us=1e-3)


@settings(max_examples=200, deadline=None)
@given(drift=st.floats(-1e-2, 1e-2), offset=st.floats(-1e4, 1e4),
       gaps=st.lists(st.floats(0, 600), min_size=2, max_size=20))
def test_back_to_back_spans_stay_in_order_whatever_the_drift(drift, offset, gaps):
    bounds = [offset + 10.0]
    for g in gaps:
        bounds.append(bounds[-1] + g)
    events = [(f"s{i}", "", trace.MAIN, a, b, None) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    parts = [{"rank": 1, "host": "", "dropped": 0, "events": events}]
    doc = trace.merge(parts, {1: (offset, 0.0)}, {1: (offset + drift * 50.0, 50.0)}, origin=0.0)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == [e[0] for e in events]
    for a, b in zip(xs, xs[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)      # 1 ns: float rounding only


# ---- under mpirun ------------------------------------------------------------------------

SKEW_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from mpi4py import MPI
    from hpc_rlx.base import trace

    comm = MPI.COMM_WORLD
    r = comm.rank
    # every rank's clock is off by r*1000 s and runs r*0.1% fast
    t_ref = time.perf_counter()
    clock = lambda: (time.perf_counter() - t_ref) * (1 + 1e-3 * r) + 1000.0 * r
    tr = trace.start(comm, True, host="h", clock=clock)
    buf = np.ones(1000)
    for k in range(12):
        time.sleep(0.01 * r)                  # higher ranks enter later: lower ranks wait
        seq = tr.next_seq()
        t0 = tr.now()
        comm.Allreduce(MPI.IN_PLACE, buf)
        t1 = tr.now()
        tr.add("chunk", "comm", trace.MAIN, t0, t1, {"seq": seq, "i": 0})
        tr.add("allreduce", "comm", trace.MAIN, t0, t1, {"seq": seq})
    doc = trace.finish(comm, tr, sys.argv[1] if r == 0 else None)
    if r == 0:
        print(json.dumps(doc["otherData"]))
""")


@pytest.mark.mpi
def test_skewed_clocks_are_aligned_and_waits_attributed(tmp_path):
    script = tmp_path / "skew.py"
    script.write_text(SKEW_SCRIPT)
    out = tmp_path / "trace.json"
    proc = mpirun(3, [str(script), str(out)], timeout=120, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, explain(proc)
    doc = json.loads(out.read_text())
    offsets = doc["otherData"]["offsets_s"]
    for r in (1, 2):
        assert offsets[str(r)]["start_s"] == pytest.approx(1000.0 * r, abs=0.05)
    ends = defaultdict(dict)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "allreduce":
            ends[e["args"]["seq"]][e["pid"]] = (e["ts"] + e["dur"]) * 1e-6
    assert len(ends) == 12 and all(len(v) == 3 for v in ends.values())
    # An allreduce finishes at nearly the same moment everywhere; unaligned, the ends would be
    # 1000 s apart. The median hides a preempted rank on a shared machine.
    spread = statistics.median(max(v.values()) - min(v.values()) for v in ends.values())
    assert spread < 0.005, spread
    waits = Counter()
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "wait":
            waits[e["pid"]] += e["dur"] * 1e-6
    # rank 0 enters 20 ms before rank 2 each time, rank 2 enters last and never waits long
    assert waits[0] > 12 * 0.012, waits
    assert waits[2] < waits[0] / 3, waits


@pytest.mark.mpi
@pytest.mark.parametrize("chunks", [1, 3])
def test_training_run_writes_one_merged_trace(tmp_path, digits_h5, chunks):
    run = tmp_path / "run"
    # 1210 parameters + 6 tail slots: one chunk by default, 3 with a 2 kB cap (MPI's Allreduce:
    # the node's shared memory sums without chunks on one node)
    cap = [] if chunks == 1 else ["comm.bucket_cap_mb=0.002", "comm.shared_memory=false"]
    proc = train_job(2, run, [f"data.path={digits_h5}", "train.epochs=2", "trace.enabled=true",
                              "checkpoint.every_steps=10", "model.hidden=[16]"] + cap)
    assert proc.returncode == 0, explain(proc)
    doc = json.loads((run / "trace.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["trace"] == str(run / "trace.json")
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = Counter((e["pid"], e["name"]) for e in xs)
    steps = summary["steps"]
    for pid in (0, 1):
        for name in ("step", "forward_backward", "allreduce", "optimizer", "data.batch"):
            assert names[(pid, name)] == steps, (pid, name, names)
        # a single-chunk allreduce is its own chunk; else ceil(1216 floats / 524 per chunk)
        assert names[(pid, "chunk")] == (0 if chunks == 1 else 3 * steps)
        for name in ("data.load", "evaluate", "checkpoint", "epoch 1", "epoch 2"):
            assert names[(pid, name)] >= 1, (pid, name)
    assert sum(n for (_, name), n in names.items() if name == "wait") > 0
    threads = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {(0, "main"), (0, "lane cpu0"), (1, "main"), (1, "lane cpu0")} <= threads
    # chunks nest inside their allreduce on the same track; nothing has negative duration
    by_seq = {(e["pid"], e["args"]["seq"]): e for e in xs if e["name"] == "allreduce"}
    for e in xs:
        assert e["dur"] >= 0
        if e["name"] == "chunk":
            parent = by_seq[(e["pid"], e["args"]["seq"])]
            assert parent["tid"] == e["tid"]
            assert parent["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + 1
    assert doc["otherData"]["waits_inferred"] is True
    assert_properly_nested(xs)


@pytest.mark.mpi
def test_no_trace_file_when_disabled(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = train_job(1, run, [f"data.path={digits_h5}", "train.epochs=1", "model.hidden=[16]",
                              "checkpoint=off"])
    assert proc.returncode == 0, explain(proc)
    assert not (run / "trace.json").exists()
    assert json.loads((run / "summary.json").read_text())["trace"] is None
