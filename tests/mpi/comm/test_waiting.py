"""More ranks than cores on a node: the ranks ask their MPI to sleep while they wait
(hpc_rlx/comm/waiting.py), and leave a site's own settings alone."""

from __future__ import annotations

import pytest

from hpc_rlx.base.topology import cores_available
from hpc_rlx.comm.waiting import SLEEPY_WAIT, oversubscribed, sleepy_wait_settings

from tests.support.jobs import read_log, train_job


@pytest.mark.parametrize("ranks,cores,expected", [
    (3, 2, True), (8, 2, True), (2, 2, False), (1, 2, False),
    (4, 1, False),      # bound by the launcher to one core each: a core of its own
    (64, 64, False), (65, 64, True),
])
def test_oversubscribed_means_more_ranks_than_cores(ranks, cores, expected):
    assert oversubscribed(ranks, cores) is expected


def test_each_launchers_node_size_decides():
    assert sleepy_wait_settings({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "8"}, 2) == SLEEPY_WAIT
    assert sleepy_wait_settings({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 2) == SLEEPY_WAIT
    assert sleepy_wait_settings({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, 2) == {}
    assert sleepy_wait_settings({}, 2) == {}          # no launcher: a lone process


def test_a_setting_already_in_the_environment_wins():
    env = {"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "8", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"}
    added = sleepy_wait_settings(env, 2)
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in added
    assert added == {k: v for k, v in SLEEPY_WAIT.items() if k != "MPIR_CVAR_ENABLE_HEAVY_YIELD"}


def _plain_env() -> dict:
    """Without the suite's own setting of these variables (tests/support/jobs.py)."""
    return {key: None for key in SLEEPY_WAIT}


@pytest.mark.mpi
def test_an_oversubscribed_job_says_its_ranks_sleep_and_a_fitting_one_does_not(tmp_path, digits_h5):
    cores = cores_available()
    if cores + 1 > 8:
        pytest.skip(f"{cores} cores: an oversubscribed job would need more than 8 ranks")
    common = ["train.epochs=1", "model.hidden=[8]", "hydra.verbose=hpc_rlx", f"data.path={digits_h5}"]
    over = train_job(cores + 1, tmp_path / "over", common, env=_plain_env())
    assert over.returncode == 0, over.stderr[-3000:]
    log = read_log(tmp_path / "over")
    assert "waiting ranks sleep between MPI polls (MPIR_CVAR_ENABLE_HEAVY_YIELD=1" in log, log[-3000:]
    fits = train_job(1, tmp_path / "fits", common, env=_plain_env())
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert "waiting ranks sleep" not in read_log(tmp_path / "fits")
