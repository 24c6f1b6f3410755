"""The test harness itself: what the suite relies on from pytest-xdist and tests/conftest.py."""

from __future__ import annotations

import os

import pytest


@pytest.mark.xdist_group("harness-check")
def test_an_xdist_group_mark_reaches_the_scheduler(request):
    """Modules that share one Slurm cluster or one set of network namespaces rely on
    `--dist loadgroup` keeping their tests on one worker. xdist groups by a `@group` suffix it
    adds to each node id; a pytest that ignores the suffix (9.2 with xdist 3.8) runs those
    tests side by side, and they fail at random."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("runs under pytest-xdist with --dist loadgroup (the suite's default)")
    assert request.node.nodeid.endswith("@harness-check"), request.node.nodeid


def test_an_unavailable_memory_limit_skips_and_fails_under_the_ci_switch(monkeypatch):
    """The cgroup tests skip where no memory limit can be made; CI (.ci/run) sets
    HPC_RLX_REQUIRE_CGROUP=1 so that the same case fails there instead of hiding."""
    from tests.support import memory_limit

    def unavailable():
        raise memory_limit.LimitUnavailable("none mounted")
    monkeypatch.setattr(memory_limit, "find_parent", unavailable)

    def outcome() -> BaseException:      # a skip must not escape: it would skip this test
        try:
            memory_limit.memory_limit_or_skip(1 << 20)
        except BaseException as e:
            return e
        raise AssertionError("neither skipped nor failed")
    monkeypatch.delenv("HPC_RLX_REQUIRE_CGROUP", raising=False)
    skipped = outcome()
    assert isinstance(skipped, pytest.skip.Exception) and "none mounted" in str(skipped), repr(skipped)
    monkeypatch.setenv("HPC_RLX_REQUIRE_CGROUP", "1")
    failed = outcome()
    assert isinstance(failed, pytest.fail.Exception), repr(failed)
    assert "HPC_RLX_REQUIRE_CGROUP=1 but" in str(failed) and "none mounted" in str(failed)


def test_a_memory_limit_kills_a_process_over_it_and_reads_the_peak_of_one_under_it():
    """What the cgroup tests rely on, in a second: a child over the limit is OOM-killed (not
    paged out), one under it runs and its peak is read back."""
    import subprocess
    import sys

    from tests.support.memory_limit import memory_limit_or_skip
    limit = memory_limit_or_skip(64 << 20)
    grab = "x = bytearray({} << 20); x[::4096] = b'1' * len(x[::4096])"
    with limit as lim:
        over = subprocess.run(lim.wrap([sys.executable, "-c", grab.format(200)]), capture_output=True, timeout=60)
        assert over.returncode != 0 and lim.oom_killed(), over
    with limit as lim:
        under = subprocess.run(lim.wrap([sys.executable, "-c", grab.format(16)]), capture_output=True, timeout=60)
        assert under.returncode == 0, under
        peak = lim.peak_bytes()
        assert peak is not None and 16 << 20 <= peak <= 64 << 20, peak
        assert not lim.oom_killed()


def test_a_job_process_left_behind_by_a_test_is_found_and_killed():
    """The check tests/conftest.py runs after every MPI test: a process carrying the test's mark
    that runs a job's program is reported and killed; one without the mark is left alone."""
    import subprocess
    import sys
    import time

    from tests.support import leftovers

    mark = leftovers.new_mark()
    script = "import time; time.sleep(60)  # python -m hpc_rlx"
    leaked = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, leftovers.MARK: mark})
    other = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, leftovers.MARK: "another"})
    try:
        time.sleep(0.3)
        found = leftovers.left_behind(mark, grace_s=0.5)
        assert [pid for pid, _ in found] == [leaked.pid]
        assert leaked.wait(timeout=10) == -9
        assert other.poll() is None
        assert leftovers.left_behind(mark, grace_s=0.1) == []
    finally:
        for p in (leaked, other):
            p.kill()
            p.wait(timeout=10)
