"""The stall watchdog's side channel takes no orders from strangers: heartbeats are sealed with a
per-job key, rank 0 drops forged, replayed, foreign and malformed datagrams (counted, never
printed per datagram), and nothing that arrives can stop the watchdog or disturb training."""

from __future__ import annotations

import io
import json
import os
import random
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rlx.comm.heartbeat import MAX_DATAGRAM, HeartbeatGate, HeartbeatSealer, JobSecret, validate_heartbeat

from tests.support.jobs import REPO, explain, launch_cmd, mpi_env, write_small_classification

BEAT = {"r": 1, "label": "fused-bucket Allreduce", "step": 7, "for": 0.5, "seq": 12,
        "last": ["fused-bucket Allreduce", 6]}


def gate_and_sealer(size=2, sources=None):
    secret = JobSecret.draw()
    return HeartbeatGate(secret, size, sources), HeartbeatSealer(secret, 1), secret


# --------------------------------------------------------------------------------------
# The gate, pure
# --------------------------------------------------------------------------------------

def test_a_sealed_heartbeat_is_admitted_with_its_fields():
    gate, sealer, _ = gate_and_sealer()
    msg, reason = gate.admit(sealer.seal(BEAT), "127.0.0.1")
    assert reason is None and msg == BEAT
    busy = {"r": 1, "label": None, "step": None, "at": 9, "for": 2.0, "seq": 3, "last": None}
    assert gate.admit(sealer.seal(busy), "127.0.0.1") == (busy, None)
    assert gate.admit(sealer.seal({"r": 1, "bye": "finished"}), None) == ({"r": 1, "bye": "finished"}, None)


def test_a_datagram_without_the_jobs_key_is_dropped_as_bad_mac():
    gate, sealer, secret = gate_and_sealer()
    data = bytearray(sealer.seal(BEAT))
    for i in (0 + 14, len(data) // 2, len(data) - 1):      # payload, middle, MAC
        bad = bytearray(data)
        bad[i] ^= 0x01
        assert gate.admit(bytes(bad), None) == (None, "bad_mac"), i
    stranger = HeartbeatSealer(JobSecret.draw(), 1)            # another key
    assert gate.admit(stranger.seal(BEAT), None) == (None, "bad_mac")
    other_job = HeartbeatSealer(JobSecret(secret.key, os.urandom(16)), 1)   # same key, other nonce
    assert gate.admit(other_job.seal(BEAT), None) == (None, "bad_mac")
    assert gate.admit(bytes(data), None)[1] is None             # the untouched original passes


def test_a_replayed_or_older_datagram_is_dropped_as_replay():
    gate, sealer, _ = gate_and_sealer()
    first, second = sealer.seal(BEAT), sealer.seal(BEAT)
    assert gate.admit(second, None)[1] is None
    assert gate.admit(second, None) == (None, "replay")
    assert gate.admit(first, None) == (None, "replay")          # older counter
    assert gate.admit(sealer.seal(BEAT), None)[1] is None       # the next one is fine


def test_a_datagram_from_another_address_than_its_ranks_is_dropped_before_the_mac():
    gate, sealer, _ = gate_and_sealer(sources={1: "10.0.0.2"})
    data = sealer.seal(BEAT)
    assert gate.admit(data, "10.0.0.9") == (None, "foreign_sender")
    assert gate.admit(data, "10.0.0.2")[1] is None


@pytest.mark.parametrize("payload", [
    {"r": 1, "label": "x", "step": 1, "for": "long", "seq": 1, "last": None},
    {"r": 1, "label": "x", "step": 1, "for": 1e300, "seq": 1, "last": None},
    {"r": 1, "label": "x", "step": 1, "for": float("nan"), "seq": 1, "last": None},
    {"r": 1, "label": "x", "step": -1, "for": 1.0, "seq": 1, "last": None},
    {"r": 1, "label": "x" * 500, "step": 1, "for": 1.0, "seq": 1, "last": None},
    {"r": 1, "label": "a\nhpc_rlx: STALL", "step": 1, "for": 1.0, "seq": 1, "last": None},
    {"r": 1, "label": 3, "step": 1, "for": 1.0, "seq": 1, "last": None},
    {"r": 1, "label": "x", "step": 1, "for": 1.0, "seq": True, "last": None},
    {"r": 1, "label": "x", "step": 1, "for": 1.0, "seq": 1, "last": ["x"]},
    {"r": 0, "label": "x", "step": 1, "for": 1.0, "seq": 1, "last": None},   # not the header's rank
    {"r": 1, "bye": ["not", "a", "string"]},
    [1, 2, 3],
])
def test_fields_of_the_wrong_type_or_range_are_dropped_as_malformed(payload):
    gate, sealer, _ = gate_and_sealer()
    assert validate_heartbeat(payload, 1) is None
    assert gate.admit(sealer.seal(payload), None) == (None, "malformed")


def test_short_oversized_and_out_of_range_datagrams_are_dropped():
    gate, sealer, _ = gate_and_sealer(size=2)
    assert gate.admit(b"", None) == (None, "malformed")
    assert gate.admit(b'{"r": 1, "for": 1e6}', None) == (None, "malformed")
    assert gate.admit(b"\x00" * (MAX_DATAGRAM + 1), None) == (None, "oversized")
    rank5 = HeartbeatSealer(gate.secret, 5)                    # a rank the job does not have
    assert gate.admit(rank5.seal(dict(BEAT, r=5)), None) == (None, "malformed")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=MAX_DATAGRAM + 50))
def test_no_bytes_at_all_make_the_gate_raise_or_admit(data):
    gate, _, _ = gate_and_sealer()
    msg, reason = gate.admit(data, "127.0.0.1")
    assert msg is None and reason in ("malformed", "oversized", "bad_mac")


# --------------------------------------------------------------------------------------
# The watchdog thread, in-process
# --------------------------------------------------------------------------------------

class RootComm:
    """Rank 0 of a job of `size` ranks on this host, without MPI: what the watchdog's startup
    collectives would return."""

    def __init__(self, size: int):
        self.rank, self.size = 0, size

    def allgather(self, x):
        return [x] * self.size

    def bcast(self, x, root=0):
        return x

    def gather(self, x, root=0):
        return ["127.0.0.1"] * self.size


def test_the_watchdog_survives_a_flood_and_still_hears_its_ranks():
    from hpc_rlx.comm.watchdog import StallWatchdog

    out, aborted = io.StringIO(), threading.Event()
    wd = StallWatchdog(RootComm(2), warn_s=0.3, abort_s=1.0, position=lambda: 4, out=out,
                       abort=lambda code: aborted.set())
    rank1 = HeartbeatSealer(wd._gate.secret, 1)
    rng = random.Random(1)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.0.0.2", 0))
    forged = {"r": 1, "label": "fused-bucket Allreduce", "step": 1, "for": 1e6, "seq": 1, "last": None}
    try:
        with wd:
            captured = rank1.seal({"r": 1, "label": None, "step": None, "at": 3, "for": 0.1,
                                   "seq": 1, "last": None})
            sender.sendto(captured, wd._root)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0:
                sender.sendto(json.dumps(forged).encode(), wd._root)
                sender.sendto(HeartbeatSealer(JobSecret.draw(), 1).seal(forged), wd._root)
                sender.sendto(captured, wd._root)
                stranger.sendto(rank1.seal(forged), wd._root)
                sender.sendto(rng.randbytes(rng.randrange(0, 300)), wd._root)
                sender.sendto(rng.randbytes(3000), wd._root)
                time.sleep(0.001)
            assert wd._thread.is_alive()
            # like a real rank, keep beating: right after a flood the kernel queue may be full
            beat = {"r": 1, "label": None, "step": None, "at": 4, "for": 0.2, "seq": 2, "last": None}
            t1 = time.monotonic()
            while wd._states.get(1, {}).get("at") != 4 and time.monotonic() - t1 < 5:
                sender.sendto(rank1.seal(beat), wd._root)
                time.sleep(0.05)
            assert wd._states[1].get("at") == 4, "a genuine heartbeat after the flood was not heard"
            stats = wd.stats()
    finally:
        sender.close()
        stranger.close()
    assert not aborted.is_set(), out.getvalue()
    assert "STALL" not in out.getvalue(), out.getvalue()
    dropped = stats["dropped"]
    for reason in ("bad_mac", "replay", "malformed", "foreign_sender", "oversized"):
        assert dropped.get(reason, 0) > 0, dropped
    # counted, then mentioned once at the end
    assert out.getvalue().count("dropped") == 1 and "not this job's heartbeats" in out.getvalue()


def test_stall_reports_are_at_most_one_every_ten_seconds():
    from hpc_rlx.comm.watchdog import StallWatchdog

    out = io.StringIO()
    wd = StallWatchdog(RootComm(2), warn_s=0.2, abort_s=None, position=lambda: 4, out=out)
    with wd:
        for label in ("first collective", "second collective", "third collective"):
            wd.enter(label)
            time.sleep(0.8)                # each one a new stall of its own
            wd.leave()
    assert out.getvalue().count("STALL:") == 1, out.getvalue()


def test_rank_0_listens_on_loopback_only_on_one_host():
    from hpc_rlx.comm.watchdog import StallWatchdog

    wd = StallWatchdog(RootComm(2), warn_s=60, position=lambda: 0, out=io.StringIO())
    with wd:
        assert wd._sock.getsockname()[0] == "127.0.0.1"


# --------------------------------------------------------------------------------------
# Real mpirun jobs under a flood
# --------------------------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="capturing heartbeats off loopback needs root")
# stall reports at 3 s: a flood must cause none, while a busy CI machine may hold an honest step
# for over a second
BASE = ["data=file", "data.val_fraction=0.2", "train.batch_size=8", "model.hidden=[16]",
        "comm.stall_warning_s=3", "comm.deterministic=true", "report.plots=false"]


@pytest.fixture(scope="module")
def flood_h5(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("flood") / "small.h5", rows=2400, seed=3)


def run_flooded(run_dir: Path, overrides: list[str], flood: bool, timeout: float = 120,
                seconds: float = 6.0):
    """A 2-rank job in a session of its own, flooded by a stranger for at most `seconds` while it
    runs. Returns (the finished job, what the flood sent, whether it was still sending when the
    job ended)."""
    from tests.support.udp_flood import Flood

    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}"] + overrides)
    proc = subprocess.Popen(cmd, cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    sent, flooding = None, False
    try:
        if flood:
            with Flood(proc.pid, ranks=2, seconds=seconds) as f:
                out, err = proc.communicate(timeout=timeout)
                flooding = f.flooding
            sent = f.sent
        else:
            out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"job did not finish in {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), sent, flooding


def params(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


@needs_root
@pytest.mark.mpi
@pytest.mark.slow
def test_a_flooded_job_finishes_bitwise_equal_and_counts_what_it_dropped(tmp_path, flood_h5):
    overrides = BASE + [f"data.path={flood_h5}", "train.epochs=5"]
    calm, _, _ = run_flooded(tmp_path / "calm", overrides, flood=False)
    assert calm.returncode == 0, explain(calm)
    # the flooded job's ranks 30x slower (sleeps only: the numbers are the calm run's), so its
    # 1200 steps (0.1 ms each unslowed) outlast the flood's start on a fast machine
    flooded, sent, _ = run_flooded(tmp_path / "flooded", overrides + ["debug.slowdown={0:30.0,1:30.0}"],
                                   flood=True)
    assert flooded.returncode == 0, explain(flooded)
    assert sent and sent["replay"] > 0 and sent["foreign"] > 0, f"the flood did not get going: {sent}"
    a, b = params(tmp_path / "calm"), params(tmp_path / "flooded")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    dropped = json.loads((tmp_path / "flooded" / "summary.json").read_text())["watchdog"]["dropped"]
    for reason in ("bad_mac", "replay", "malformed", "foreign_sender", "oversized"):
        assert dropped.get(reason, 0) > 0, (dropped, sent)
    text = flooded.stdout + flooded.stderr
    assert "STALL" not in text and "FORGED" not in text, explain(flooded)
    assert len(re.findall(r"stall watchdog dropped \d+ datagram", text)) == 1, explain(flooded)


@needs_root
@pytest.mark.mpi
@pytest.mark.slow
def test_a_genuine_stall_still_aborts_while_the_flood_goes_on(tmp_path, flood_h5):
    overrides = BASE + [f"data.path={flood_h5}", "train.epochs=2", "comm.stall_abort_s=5",
                        "debug.stall_rank=1", "debug.stall_step=300", "debug.stall_s=120"]
    t0 = time.monotonic()
    # the flood lasts up to 20 s, past the ~6 s to the abort: it goes on while the stall is
    # reported and the job aborted
    proc, sent, flooding = run_flooded(tmp_path / "stalled", overrides, flood=True, timeout=90,
                                       seconds=20.0)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, explain(proc)
    assert elapsed < 45, f"the stalled job took {elapsed:.1f}s to end"
    err = proc.stderr
    assert "at step 300" in err and "not arrived (1/2): ranks 1" in err, explain(proc)
    assert re.search(r"stalled for \d+\.\d s >= comm\.stall_abort_s=5: aborting all 2 ranks", err), explain(proc)
    assert sent and sum(sent.values()) > 0, "the flood did not get going"
    assert flooding, f"the flood had ended before the job did ({elapsed:.1f} s): make it longer"
    assert "FORGED" not in err and err.count("STALL:") <= 2, explain(proc)


# --------------------------------------------------------------------------------------
# The default abort (comm.stall_abort_s=auto), reachability, unreachable nodes
# --------------------------------------------------------------------------------------

def test_rank_0s_own_answers_sent_back_to_it_are_dropped():
    secret = JobSecret.draw()
    root_gate = HeartbeatGate(secret, 2, own_rank=0)
    rank0 = HeartbeatSealer(secret, 0)
    answer = rank0.seal({"r": 0, "ack": 5})
    assert root_gate.admit(answer, None) == (None, "replay")
    rank_gate = HeartbeatGate(secret, 1, {0: "10.0.0.1"}, answers=True)
    assert rank_gate.admit(answer, "10.0.0.1") == ({"r": 0, "ack": 5}, None)
    # and a rank's gate takes answers only: a heartbeat is not one
    assert rank_gate.admit(rank0.seal(dict(BEAT, r=0)), "10.0.0.1") == (None, "malformed")


def test_a_host_none_of_whose_ranks_is_heard_is_unreachable():
    from hpc_rlx.comm.stall_report import alive_and_busy, stall_report, unreachable_hosts

    now = 100.0
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node2", 4: "node3"}
    states = {
        0: {"label": "fused-bucket Allreduce", "step": 7, "for": 30.0, "recv": 99.9},
        1: {"label": None, "step": None, "at": 7, "for": 30.0, "recv": 99.9, "last": None},
        2: {"label": "fused-bucket Allreduce", "step": 7, "for": 1.0, "recv": 70.0},   # silent
        4: {"label": None, "step": None, "at": 7, "for": 1.0, "recv": 60.0, "last": None},
    }
    assert unreachable_hosts(states, 5, now, 3.0, hosts) == {"node2", "node3"}
    assert alive_and_busy(states, now, 3.0) == [1]
    text, _ = stall_report(states, 5, now, 10.0, 3.0, hosts, ("10.9.0.1", 4000))
    assert "rank 2 on node2: silent: no heartbeat for 30.0 s" in text
    assert ("rank 3 on node2: heartbeats cannot reach rank 0: none has arrived at its watchdog at "
            "10.9.0.1:4000") in text and "never reported" not in text
    assert text.count("unreachable: no rank on node2 is heard") == 2
    assert "unreachable: no rank on node3 is heard" in text
    assert "rank 1 on node1: busy outside any collective" in text and "node1 is heard" not in text


def _root_beating(wd, sealer, label, seconds, sender):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        beat = {"r": 1, "label": label, "step": None if label is None else 4, "at": 4,
                "for": time.monotonic() - t0, "seq": 9, "last": None}
        if label is not None:
            beat.pop("at")
        sender.sendto(sealer.seal(beat), wd._root)
        time.sleep(0.05)


@pytest.fixture
def default_abort_root(monkeypatch):
    """Rank 0 of 2 with comm.stall_abort_s=auto on a 1 s clock (the rule, not the 600 s), a
    genuine rank 1's sealer and a socket to send as it."""
    from hpc_rlx.comm import watchdog
    from hpc_rlx.comm.watchdog import StallWatchdog

    monkeypatch.setattr(watchdog, "DEFAULT_ABORT_S", 1.0)
    out, aborted = io.StringIO(), threading.Event()
    wd = StallWatchdog(RootComm(2), warn_s=0.3, abort_s="auto", position=lambda: 4, out=out,
                       abort=lambda code: aborted.set())
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        yield wd, HeartbeatSealer(wd._gate.secret, 1), sender, out, aborted
    finally:
        sender.close()
        wd.close()


def test_the_default_abort_never_ends_a_job_whose_ranks_are_busy_but_ends_a_silent_one(default_abort_root):
    wd, rank1, sender, out, aborted = default_abort_root
    with wd:
        wd.enter("fused-bucket Allreduce")
        _root_beating(wd, rank1, None, 3.0, sender)       # rank 1 busy (say, checkpointing)
        assert not aborted.is_set(), out.getvalue()
        assert "STALL" in out.getvalue()                  # reported, not aborted
        # rank 1 goes silent (its node cut off): now the job is stuck
        assert aborted.wait(10), out.getvalue()
        wd.leave()
    assert re.search(r"stalled for \d+\.\d s >= comm\.stall_abort_s=auto \(1 s\): aborting all 2 ranks",
                     out.getvalue()), out.getvalue()
    assert "rank 1 on" in out.getvalue() and "silent: no heartbeat" in out.getvalue()


def test_the_default_abort_ends_a_job_whose_ranks_all_wait_in_one_collective(default_abort_root):
    wd, rank1, sender, out, aborted = default_abort_root
    with wd:
        wd.enter("fused-bucket Allreduce")
        t0 = time.monotonic()
        while not aborted.is_set() and time.monotonic() - t0 < 10:
            _root_beating(wd, rank1, "fused-bucket Allreduce", 0.2, sender)   # both inside
        wd.leave()
    assert aborted.is_set(), out.getvalue()
    assert "arrived (2/2)" in out.getvalue()


def test_a_rank_warns_once_when_rank_0_never_answers_its_heartbeats(monkeypatch):
    from hpc_rlx.comm.watchdog import StallWatchdog

    class RankComm(RootComm):
        def __init__(self, root_addr):
            super().__init__(2)
            self.rank, self.root_addr, self.secret = 1, root_addr, JobSecret.draw()

        def bcast(self, x, root=0):
            return self.root_addr, self.secret.as_tuple()

        def gather(self, x, root=0):
            return None

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # a rank 0 that cannot answer
    sink.bind(("127.0.0.1", 0))
    out = io.StringIO()
    wd = StallWatchdog(RankComm(sink.getsockname()), warn_s=0.2, abort_s=None, position=lambda: 1, out=out)
    wd.reach_after = 0.5
    try:
        with wd:
            time.sleep(1.5)
    finally:
        sink.close()
    assert out.getvalue().count("has not answered") == 1, out.getvalue()
    assert "its heartbeats cannot reach rank 0" in out.getvalue()


def test_rank_0_names_ranks_whose_heartbeats_never_arrive():
    from hpc_rlx.comm.watchdog import StallWatchdog

    out = io.StringIO()
    wd = StallWatchdog(RootComm(3), warn_s=0.2, abort_s=None, position=lambda: 1, out=out)
    wd.reach_after = 0.5
    with wd:
        time.sleep(1.5)
    assert "no heartbeat from rank(s) 1-2" in out.getvalue() and "has reached rank 0's stall watchdog" in out.getvalue()


def test_rank_0_listens_where_the_other_nodes_can_reach_it():
    from hpc_rlx.comm.side_channel import root_address

    route = {"10.0.0.2": "10.0.0.1", "192.168.1.7": None}.get
    assert root_address(["a", "a"], [["10.0.0.1"], ["10.0.0.1"]], route) == "127.0.0.1"   # one host
    assert root_address(["a", "b"], [["10.0.0.5"], ["10.0.0.2"]], route) == "10.0.0.5"    # its name
    # a name that resolves to loopback only (127.0.1.1): the address that reaches another node
    assert root_address(["a", "b", "c"], [[], ["192.168.1.7"], ["10.0.0.2"]], route) == "10.0.0.1"


def test_rank_0_binds_the_first_address_this_machine_has_not_every_interface():
    from hpc_rlx.comm.side_channel import bind_narrowly

    # 192.0.2.1 (TEST-NET-1) is no address of this machine, as a stale hosts entry would give
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        addr, port = bind_narrowly(sock, ["192.0.2.1", "127.0.0.1"])
        assert (addr, port) == ("127.0.0.1", sock.getsockname()[1])
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()
