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
