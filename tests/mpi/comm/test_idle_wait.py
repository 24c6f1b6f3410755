"""`comm.idle_wait`: ranks that wait off the step path for a late rank 0 sleep instead of
spinning a core inside MPI, and get the same values as the blocking collectives."""

from __future__ import annotations

import json
import pytest

from hpc_rlx.comm import idle_wait
from hpc_rlx.comm.waiting import SLEEPY_WAIT
from tests.support.jobs import REPO, explain, mpirun

SCRIPT = REPO / "tests" / "support" / "mpi_scripts" / "idle_wait_cpu.py"


def _waits(kind: str, env: dict | None = None) -> dict[int, dict]:
    proc = mpirun(2, [str(SCRIPT), kind], timeout=120, env=env)
    assert proc.returncode == 0, explain(proc)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    return {r["rank"]: r for r in json.loads(line)}


@pytest.mark.openmpi
def test_a_late_root_is_waited_for_asleep_with_the_same_results():
    idle = _waits("idle")
    assert sorted(idle) == [0, 1]
    for r in idle.values():
        assert r["value"] == {"from": "rank 0"} and r["gathered"] == [0, 1], r
    # rank 1 waited about 2 s for rank 0: asleep, a small fraction of that in CPU time
    assert idle[1]["cpu_s"] < 0.5, idle[1]


def test_the_blocking_broadcast_spins_where_the_idle_one_sleeps():
    """What idle_wait is for: under MPICH the plain bcast keeps the waiting rank on the CPU.
    (Open MPI yields when idle under the tests' launcher flags, so only MPICH is compared.)"""
    from tests.support.mpi_launch import MPI_IMPL
    if MPI_IMPL != "mpich":
        pytest.skip("the tests launch Open MPI with mpi_yield_when_idle")
    # MPICH's own waiting, not the sleepy polling the suite's other jobs are given
    mpich_default = {key: None for key in SLEEPY_WAIT}
    blocking, idle = _waits("blocking", mpich_default), _waits("idle", mpich_default)
    assert blocking[1]["value"] == idle[1]["value"] == {"from": "rank 0"}
    assert blocking[1]["cpu_s"] > 2 * idle[1]["cpu_s"] + 0.2, (blocking[1], idle[1])


class _OneRank:
    size = 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]


def test_one_rank_and_stand_ins_without_ibarrier_do_not_wait():
    comm = _OneRank()
    assert idle_wait.bcast(comm, 5) == 5 and idle_wait.allgather(comm, 7) == [7]
    comm.size = 3       # a test's stand-in for a larger communicator, without Ibarrier
    idle_wait.wait_for_all(comm)
