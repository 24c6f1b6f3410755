"""MPI's own fault tolerance (ULFM, User-Level Failure Mitigation) as `comm.on_failure=shrink`
uses it: is it really there, is an error a dead rank, and the survivors' new communicator.

Open MPI 5 has ULFM built in and switches it on with ``mpirun --with-ft ulfm``, which sets
``OMPI_MCA_mpi_ft_enable=1`` in the ranks' environment. mpi4py exposes it (`Comm.Revoke`,
`Ack_failed`, `Get_failed`, `Agree`, `Shrink`), but where the library lacks it mpi4py falls
back silently: `Shrink` becomes a plain duplicate, `Agree` an Allreduce, `Get_failed` an
empty group, and the error classes `ERR_PROC_FAILED` / `ERR_REVOKED` collapse into
`ERR_UNKNOWN` (measured with the MPICH wheel). Without ``--with-ft ulfm`` Open MPI's calls
answer on a healthy job, but a dead rank still takes the whole job down. So `problem()`
decides from the library, mpi4py's error classes and the launcher's setting, never from the
calls themselves, and "fault tolerant" never runs on top of a fallback.

One recovery (`shrink`), on every survivor, in this order:

1. ``Revoke``: every survivor still blocked in a collective of the old communicator leaves it
   with ``ERR_REVOKED``, wherever it is;
2. ``Ack_failed``: the failures known here are acknowledged, so the agreement does not
   itself report them;
3. ``Agree`` (a bitwise AND over the survivors, fault tolerant): every survivor learns that a
   failure happened. Where a survivor had not yet acknowledged a failure that the agreement
   met, ULFM reports ``ERR_PROC_FAILED`` from it on every survivor alike (its outcome is
   uniform), and all acknowledge and agree again;
4. ``Shrink``: the communicator of the survivors, in their old order (rank 0 stays rank 0
   while it lives).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

# The environment variable `mpirun --with-ft ulfm` sets in every rank (Open MPI 5).
FT_ENV = "OMPI_MCA_mpi_ft_enable"
AGREE_TRIES = 20
WORKS = "mpirun --with-ft ulfm -n N python -m hpc_rlx comm.on_failure=shrink"


def _mpi():
    from mpi4py import MPI
    return MPI


# Open MPI 5's hierarchical collectives (coll/han, chosen for communicators that span nodes) are
# not fault tolerant: with both ranks of one emulated node SIGKILLed, the survivor's Allreduce
# returned success with a wrong sum (its own contribution) instead of ERR_PROC_FAILED, and the
# failure surfaced a step later. Without han the same job reports it in the step and ends
# within 1e-16 of the reference (tests/cluster/test_multihost.py).
NOT_FAULT_TOLERANT = {"OMPI_MCA_coll": "^han"}


def launched_with_ft(env) -> bool:
    """Whether the launcher switched ULFM on for this rank (``mpirun --with-ft ulfm``) (pure)."""
    return (env.get(FT_ENV) or "").strip().lower() in ("1", "true", "yes", "on")


def settings_before_mpi_starts(env) -> dict[str, str]:
    """What a rank launched with ULFM adds to its environment before MPI_Init: the collective
    components that are not fault tolerant switched off, unless the site set its own (pure)."""
    if not launched_with_ft(env):
        return {}
    return {k: v for k, v in NOT_FAULT_TOLERANT.items() if k not in env}


# Open MPI's failure detector (slurm/train.sh switches it on for comm.on_failure=shrink|spare),
# as mpirun's `--mca` options reach the ranks' environment.
DETECTOR_ENV = "OMPI_MCA_mpi_ft_detector"
DETECTOR_THREAD_ENV = "OMPI_MCA_mpi_ft_detector_thread"


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on", "enabled")


def detector_thread_on(env) -> bool:
    """Whether Open MPI's failure detector runs in its own thread in this rank (pure).

    Then MPI_Finalize never returns in Open MPI 5.0.x: `ompi_comm_failure_detector_finalize`
    waits for the quit heartbeat of the rank it observes in a loop that, with the detector's
    thread active, only re-reads the thread flag; the compiled loop never reloads the
    observed rank, so the quit that the thread receives is never seen (every rank of a
    finished job spins there at 100% CPU; seen in the disassembly of the wheel's libmpi).
    Without the thread the same loop calls opal_progress and ends."""
    return _on(env.get(DETECTOR_ENV)) and _on(env.get(DETECTOR_THREAD_ENV))


def before_mpi_starts(env=None) -> None:
    """Every entry point that starts MPI calls this first (it must run before
    ``from mpi4py import MPI``): the settings above, and with the detector's thread on, no
    MPI_Finalize at exit (`detector_thread_on`): a rank leaves as after a survived failure
    (`leave_without_finalize`), and an error's exit does not hang either."""
    env = os.environ if env is None else env
    env.update(settings_before_mpi_starts(env))
    if detector_thread_on(env):
        import mpi4py
        mpi4py.rc.finalize = False


def problem_of(library: str, env_value: str | None, proc_failed: int, revoked: int,
               unknown: int) -> str | None:
    """Why ULFM is not active, in words, or None when it is (pure). `library`: the MPI
    library's version string; `env_value`: the rank's ``OMPI_MCA_mpi_ft_enable``; the error
    classes as mpi4py reports them."""
    name = " ".join((library.strip().splitlines() or ["an unknown MPI library"])[0].split(",")[0].split())
    if proc_failed in (unknown, revoked):
        return (f"the MPI library ({name}) has no ULFM in mpi4py: its fault-tolerance calls "
                f"fall back to plain ones that cannot survive a dead rank")
    if not name.startswith("Open MPI"):
        return f"ULFM is used with Open MPI 5 only, this job runs {name}"
    if not launched_with_ft({FT_ENV: env_value or ""}):
        return f"{name} was launched without --with-ft ulfm ({FT_ENV} is not set)"
    return None


def problem() -> str | None:
    """This rank's `problem_of`: None where a dead rank can be survived."""
    MPI = _mpi()
    return problem_of(MPI.Get_library_version(), os.environ.get(FT_ENV),
                      MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED, MPI.ERR_UNKNOWN)


def is_rank_failure(exc: BaseException) -> bool:
    """Whether `exc` is MPI telling of a dead rank (or of a communicator revoked after one)."""
    MPI = _mpi()
    if not isinstance(exc, MPI.Exception):
        return False
    failure = {MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED}
    pending = getattr(MPI, "ERR_PROC_FAILED_PENDING", None)
    if pending is not None:
        failure.add(pending)
    failure.discard(MPI.ERR_UNKNOWN)     # a fallback's classes are not failures
    try:
        return exc.Get_error_class() in failure
    except Exception:  # noqa: BLE001 - an error object MPI cannot classify
        return False


def failure_known(exc: BaseException, comm, wait_s: float = 2.0, others: tuple = ()) -> bool:
    """Whether `exc` comes of a dead rank of `comm`: its class says so, or it is another MPI
    error (Open MPI's shared-memory barrier reports a dead peer as ``ERR_OTHER``) while a
    rank of `comm` or of a communicator in `others` (derived from it: where the error came
    from) is known to have failed, or one of them was revoked, within `wait_s`."""
    MPI = _mpi()
    if is_rank_failure(exc):
        return True
    if not isinstance(exc, MPI.Exception):
        return False
    deadline = time.monotonic() + wait_s
    while True:
        for c in (comm, *others):
            group = c.Get_failed()
            try:
                if group.Get_size() > 0 or c.Is_revoked():
                    return True
            finally:
                group.Free()
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


@dataclass(frozen=True)
class Shrunk:
    """What one `shrink` gave this survivor."""
    comm: object                # the survivors' communicator
    failed: tuple[int, ...]     # ranks of the old communicator that failed
    old_rank: int               # this rank in the old communicator
    seconds: float


def shrink(comm) -> Shrunk:
    """Collective over the survivors of `comm`: revoke it, agree that a failure happened,
    and return the survivors' communicator (errors returned, not fatal)."""
    MPI = _mpi()
    t0 = time.perf_counter()
    old_rank = comm.Get_rank()
    comm.Revoke()
    for attempt in range(AGREE_TRIES):
        comm.Ack_failed()
        try:
            flag = comm.Agree(1)
            break
        except MPI.Exception as e:
            # a failure this rank had not acknowledged yet when the agreement ran: its outcome
            # is the same on every survivor, so every survivor acknowledges and agrees again
            if e.Get_error_class() != MPI.ERR_PROC_FAILED or attempt == AGREE_TRIES - 1:
                raise
    if not flag & 1:     # every survivor passes 1: an AND of 0 means the agreement itself broke
        raise RuntimeError("ULFM's agreement after a failure returned 0")
    failed_group = comm.Get_failed()
    group = comm.Get_group()
    failed = tuple(sorted(int(r) for r in failed_group.Translate_ranks(
        list(range(failed_group.Get_size())), group)))
    failed_group.Free()
    group.Free()
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    replaced(comm, new)
    return Shrunk(new, failed, old_rank, time.perf_counter() - t0)


def replaced(old, new) -> None:
    """From now on `new` stands for `old` (the survivors' communicator, or one renumbered from
    it): whoever still holds a handle to the launch communicator follows the whole chain with
    `current`. Every communicator a recovery makes to train on must be recorded here, or the
    job channel's last word goes to a communicator with a dead rank in it."""
    SUCCESSOR[id(old)] = (old, new)     # the old handle kept: its id is not reused


# old communicator (by id) -> the survivors' one: whoever kept the old handle (the job
# channel, the entry point) follows it with `current`
SUCCESSOR: dict[int, tuple] = {}


def current(comm):
    """`comm`, or the survivors' communicator that replaced it (after every shrink since)."""
    seen = 0
    while id(comm) in SUCCESSOR and seen < 1000:
        comm = SUCCESSOR[id(comm)][1]
        seen += 1
    return comm


def leave_without_finalize(code) -> None:
    """After a survived failure, or with the failure detector's thread on: leave now, with
    `code`, without MPI_Finalize. Open MPI 5.0's MPI_Finalize fences with every rank of the
    job, and after a rank had died that fence hung the survivors in 3 of 27 jobs here (all of
    them inside ompi_mpi_finalize, the training done and its files written); with the
    detector's thread it never returns (`detector_thread_on`). `mpirun --with-ft ulfm` takes
    an exit without it as a normal end (exit 0 when every rank exits 0). A no-op otherwise."""
    if not SUCCESSOR and not detector_thread_on(os.environ):
        return
    # every survivor leaves together: one leaving early is, to the others still waiting for
    # rank 0's last word (runtime/job_channel.py), another dead rank
    _barrier(current(_mpi().COMM_WORLD), LEAVE_WAIT_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


LEAVE_WAIT_S = 60.0


def _barrier(comm, timeout_s: float) -> None:
    """A barrier waited for at most `timeout_s`; a failure in it is no reason to stay."""
    try:
        req = comm.Ibarrier()
        deadline = time.monotonic() + timeout_s
        while not req.Test():
            if time.monotonic() >= deadline:
                return
            time.sleep(0.002)
    except Exception:  # noqa: BLE001 - leaving anyway
        return
