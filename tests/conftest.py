"""Fixtures shared by every layer of the suite, and the markers a test's folder implies.

Layout: `unit/<package>/` runs in one process without MPI; `mpi/<package>/` launches real
`mpirun` jobs; `cluster/` needs the local Slurm cluster or emulated hosts (network namespaces);
`docs/` holds the pages to what runs; `support/` is the harness (launcher, clusters, scripts).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import leftovers, mpi_launch
from tests.support.shared import MachineShare, exclusive, run_dir

TESTS = Path(__file__).resolve().parent
# a test under these folders needs MPI, whatever its own marks say
MPI_FOLDERS = ("mpi", "cluster")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): most tests spend their time waiting on subprocesses
    (mpirun jobs, a Slurm cluster, timeouts), so two workers per core keep the cores busy; past
    that the ranks of concurrent jobs only take turns."""
    cores = len(os.sched_getaffinity(0))
    return max(2, min(2 * cores, 8))


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts and parts[0] in MPI_FOLDERS:
            item.add_marker(pytest.mark.mpi)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Under xdist, a `timing` test (its asserts compare wall times) runs while no other worker
    # runs a test: on a 2-core machine four workers' jobs would skew what it measures.
    run_uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_uid:
        yield
        return
    share = MachineShare(Path(os.environ.get("TMPDIR", "/tmp")) / f"hpc_rlx-tests-{run_uid}")
    with share.hold(alone=item.get_closest_marker("timing") is not None):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    # the launcher refuses a launch from a test without the `mpi` marker: `-m "not mpi"` must
    # mean what it says
    mpi_launch.RUNNING_TEST = item
    # every process the test starts inherits its mark: none of its jobs' may outlive the test
    watch = item.get_closest_marker("mpi") is not None
    mark = os.environ[leftovers.MARK] = leftovers.new_mark()
    outcome = None
    try:
        outcome = yield
    finally:
        mpi_launch.RUNNING_TEST = None
        os.environ.pop(leftovers.MARK, None)
    left = leftovers.left_behind(mark) if watch else []
    if left and outcome is not None and outcome.excinfo is None:
        lines = "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in left)
        outcome.force_exception(AssertionError(
            f"{item.nodeid} left {len(left)} process(es) of its jobs running (killed now):\n{lines}"))


@pytest.fixture(scope="session")
def digits_h5(tmp_path_factory) -> Path:
    """The real default dataset, prepared once per test run and shared by the xdist workers
    (tests read it; a test that changes data makes its own file)."""
    from hpc_rlx.data.prepare import ensure_prepared
    folder = run_dir(tmp_path_factory, "data")
    path = folder / "digits.h5"
    with exclusive(folder / "digits.lock"):
        ensure_prepared(str(path), "digits")
    return path
