"""The decisions of a recovery after a dead rank (`resilience/plan.py`) and the test of
whether ULFM is active (`resilience/ulfm.problem_of`): pure, no MPI."""

from __future__ import annotations

import pytest

from hpc_rlx.resilience import plan
from hpc_rlx.resilience.ulfm import FT_ENV, detector_thread_on, problem_of, settings_before_mpi_starts


def test_survivors_at_one_step_adopt_nothing():
    assert plan.adoption([5, 5, 5]) == plan.Adoption(step=5, source=0, behind=())


def test_survivors_one_step_apart_adopt_the_furthest_state_from_its_lowest_rank():
    # survivor 1 and 2 completed the step's Allreduce, 0 saw it fail
    assert plan.adoption([5, 6, 6]) == plan.Adoption(step=6, source=1, behind=(0,))
    assert plan.adoption([6, 5, 6, 5]) == plan.Adoption(step=6, source=0, behind=(1, 3))


def test_survivors_in_different_epochs_are_not_adopted_yet():
    # at the end of an epoch: one survivor still in its last step, one in the validation after it
    assert plan.adoption([15, 16], [0, 0]) == plan.Adoption(step=16, source=1, behind=(0,))
    # a validation that completed on one survivor only: it ended the epoch, the other did not
    with pytest.raises(ValueError, match=r"different epochs \(1 and 2\) at steps 16-16"):
        plan.adoption([16, 16], [0, 1])


def test_survivors_further_apart_are_a_bug_not_a_state_to_adopt():
    with pytest.raises(ValueError, match="more than one step apart"):
        plan.adoption([4, 6])
    with pytest.raises(ValueError, match="no survivor"):
        plan.adoption([])


def test_failed_ranks_and_when_the_run_directory_cannot_be_taken_over():
    assert plan.failed_ranks(4, [0, 1, 3]) == (2,)
    # the job ranks 5, 7, 8, 9 on a, b, c, d; old ranks 0 and 2 survive
    assert plan.follow_survivors([5, 7, 8, 9], ["a", "b", "c", "d"], [0, 2]) == (
        [(7, "b"), (9, "d")], [5, 8], ["a", "c"])
    assert plan.failed_ranks(4, [1, 2]) == (0, 3)
    assert plan.takeover_problem(False, False, "node2") is None     # rank 0 lives: nothing to take over
    assert plan.takeover_problem(True, True, "node2") is None       # the new rank 0 sees the run directory
    assert plan.takeover_problem(True, False, "node2") == (
        "rank 0 wrote the run directory, which the survivors' rank 0 on node2 does not see (no shared "
        "filesystem between their nodes), so no survivor can take it over")
    assert plan.takeover_problem(True, True, "node2", unreadable="/scratch/d.h5") == (
        "rank 0 read the data and sent each rank its rows (data.distribution=scatter), and the survivors' "
        "rank 0 on node2 cannot read /scratch/d.h5, so no survivor can send them")
    assert plan.takeover_problem(False, True, "node2", unreadable="/scratch/d.h5") is None    # rank 0 lives


def test_the_failure_record_and_its_line():
    rec = plan.failure_record(5, [2], ["node7"], 0.031234, 3)
    assert rec == {"step": 5, "ranks": [2], "hosts": ["node7"], "recovery_s": 0.0312, "world_size_after": 3}
    assert plan.failure_line(rec, 4) == ("rank 2 on node7 failed: 3 of 4 ranks train on from step 5 "
                                         "(comm.on_failure=shrink, recovered in 0.03 s)")


def test_a_spare_takes_the_dead_ranks_shard_and_the_ranks_are_renumbered_by_shard():
    # 3 shards, spares 3 and 4; rank 0 died: survivors (old ranks 1, 2, 3, 4) hold shards 1, 2, spare, spare
    placed = plan.places([1, 2, None, None], 3)
    assert placed.roles == (1, 2, 0, None) and placed.world == 3 and placed.spares == 1
    assert placed.replaced == ((2, 0),)                     # survivor 2 (old rank 3) trains shard 0
    assert placed.keys == (1, 2, 0, 3)                      # it becomes rank 0, the writer
    # two ranks die, one spare: the spare takes the first vacant shard, then the rest close up
    placed = plan.places([0, None], 3)
    assert placed.replaced == ((1, 1),) and placed.world == 2 and placed.spares == 0
    assert placed.roles == (0, 1) and placed.keys == (0, 1)
    # a spare dies: nothing moves
    placed = plan.places([0, 1, None], 2)
    assert placed.roles == (0, 1, None) and placed.keys == (0, 1, 2) and placed.replaced == ()


def test_shrink_without_spares_keeps_the_survivors_order():
    placed = plan.places([0, 2, 3], 4)
    assert placed.roles == (0, 1, 2) and placed.keys == (0, 1, 2) and placed.world == 3 and placed.spares == 0


def test_the_spare_failure_lines():
    rec = plan.failure_record(5, [1], ["node2"], 0.031, 2, spares_left=0, replaced_by=[2])
    assert rec["spares_left"] == 0 and rec["replaced_by"] == [2]
    assert plan.failure_line(rec, 2, "spare", [(2, "node3", 1)]) == (
        "rank 1 on node2 failed: spare rank 2 on node3 trains shard 1; 2 ranks train on from step 5, "
        "0 spares left (comm.on_failure=spare, recovered in 0.03 s)")
    rec = plan.failure_record(7, [0], ["node1"], 0.02, 1, spares_left=0)
    assert plan.failure_line(rec, 2, "spare") == (
        "rank 0 on node1 failed: no spare left, 1 of 2 ranks train on from step 7 "
        "(comm.on_failure=spare goes on as shrink, recovered in 0.02 s)")


# the error classes as mpi4py reports them: Open MPI 5 (75, 77, unknown 14), MPICH wheel (13 for all)
OMPI = dict(proc_failed=75, revoked=77, unknown=14)
MPICH = dict(proc_failed=13, revoked=13, unknown=13)


def test_ulfm_is_active_only_with_open_mpi_launched_with_ft():
    ompi = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
    assert problem_of(ompi, "1", **OMPI) is None
    assert problem_of(ompi, "true", **OMPI) is None
    assert problem_of(ompi, None, **OMPI) == ("Open MPI v5.0.11 was launched without --with-ft ulfm "
                                              "(OMPI_MCA_mpi_ft_enable is not set)")
    assert "launched without --with-ft ulfm" in problem_of(ompi, "0", **OMPI)
    mpich = "MPICH Version:      5.0.2\nMPICH Release date: ..."
    assert problem_of(mpich, None, **MPICH) == ("the MPI library (MPICH Version: 5.0.2) has no ULFM in "
                                                "mpi4py: its fault-tolerance calls fall back to plain ones "
                                                "that cannot survive a dead rank")
    # a library with the error classes but not Open MPI (an MPICH build with ULFM classes)
    assert problem_of("MPICH Version: 4.2", "1", **OMPI) == "ULFM is used with Open MPI 5 only, this job runs MPICH Version: 4.2"


def test_under_ulfm_the_collectives_that_are_not_fault_tolerant_are_switched_off():
    assert settings_before_mpi_starts({FT_ENV: "1"}) == {"OMPI_MCA_coll": "^han"}
    assert settings_before_mpi_starts({FT_ENV: "1", "OMPI_MCA_coll": "^tuned"}) == {}   # the site's own wins
    assert settings_before_mpi_starts({}) == {} and settings_before_mpi_starts({FT_ENV: "0"}) == {}


def test_the_failure_detectors_thread_is_read_from_mpiruns_mca_options():
    """Both `--mca mpi_ft_detector true` and `--mca mpi_ft_detector_thread true` (as they reach a
    rank's environment) mean MPI_Finalize would never return: the rank leaves without it."""
    on = {"OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_thread": "1"}
    assert detector_thread_on(on)
    assert not detector_thread_on({**on, "OMPI_MCA_mpi_ft_detector_thread": "false"})
    assert not detector_thread_on({"OMPI_MCA_mpi_ft_detector_thread": "true"})   # no detector
    assert not detector_thread_on({})
