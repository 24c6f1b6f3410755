"""How a rank answers signals: a stop that checkpoints, never a traceback.

- SIGTERM / SIGUSR1 (preemption, `scancel`, Slurm's `--signal`): set a flag; the flag travels
  in the next step's bucket, all ranks stop at that step, rank 0 writes a checkpoint, exit 0.
- SIGINT (Ctrl-C; MPICH's mpiexec forwards it to every rank): the same stop and checkpoint,
  then exit 130 (128 + SIGINT, what a shell reports for Ctrl-C).
  - Before training starts (Hydra composing, data loading, resume) there is nothing to save:
    exit 130 at once.
  - A second SIGINT at least `REPEAT_AFTER_S` after the first: exit 130 at once, without a
    checkpoint. Within that time it is the same Ctrl-C arriving twice (the terminal and a
    launcher both deliver it), so it is ignored.

The handlers never raise (an exception from a handler would surface as a traceback wherever
the main thread happened to be); the immediate exits never run cleanup code, so none can block
in a collective that the other ranks have left.

An immediate exit must not leave another rank waiting for this one. A rank blocked inside MPI
(its own MPI_Init, a collective) cannot run its Python handler, whatever signal it gets, and
a launcher only ends the job for a rank that exits after MPI started on it (MPICH's hydra
leaves the others waiting in MPI_Init forever). So a SIGINT that arrives while MPI is still
starting is answered once it has started (`install(rank, comm)`), and that exit is
MPI_Abort, which ends the job under any launcher. A second SIGINT during training exits at
once (the launcher ends the job for a rank that leaves after MPI started). Rank 0 prints the
one line; the other ranks leave it `ABORT_GRACE_S` to do so first (a launcher that forwards
Ctrl-C signals every rank) and print it themselves when rank 0 could not (it was waiting inside
a collective, where no Python handler runs).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from hpc_rlx.comm.job_abort import abort_job

INTERRUPT_EXIT = 130
REPEAT_AFTER_S = 1.0
ABORT_GRACE_S = 1.0     # a rank other than 0 waits this long for rank 0 to print and abort
STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
# Launcher variables that give a rank's number before MPI starts (only rank 0 prints).
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def _rank_from_env() -> int:
    for var in RANK_ENV:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return 0


class Signals:
    """The decisions are plain methods (`on_signal`), so they can be tested without signals."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.received: int | None = None        # the first stop signal
        self.interrupted_at: float | None = None
        self.training = False
        self.rank: int | None = None
        self.comm = None                        # set once MPI has started on this rank
        self.exit_pending = False               # an exit asked for while MPI was starting
        self.installed = False
        # Rank 0's clean-up for an exit before training: remove the run directory this run
        # created (a run that never trained leaves none behind). Must not raise or block.
        self.before_exit = None

    # ---- decisions (pure) ----------------------------------------------------------------
    def on_signal(self, signum: int) -> str:
        """'stop' (at the next step), 'exit' (now) or 'ignore'."""
        if signum == signal.SIGINT:
            now = self.clock()
            if self.interrupted_at is None:
                self.interrupted_at = now
                if self.received is None:
                    self.received = signum
                return "stop" if self.training else "exit"
            return "exit" if now - self.interrupted_at >= REPEAT_AFTER_S else "ignore"
        if self.received is None:
            self.received = signum
        return "stop"

    @property
    def raised(self) -> bool:
        """A stop was asked for: the training loop puts this into the step's bucket."""
        return self.received is not None

    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    @property
    def exit_code(self) -> int:
        return INTERRUPT_EXIT if self.interrupted else 0

    def exit_message(self) -> str:
        if not self.training:
            return "hpc_rlx: interrupted before training started: exiting (nothing to save yet)"
        return "hpc_rlx: interrupted again: exiting now, without a checkpoint"

    # ---- process-wide state ----------------------------------------------------------------
    def install(self, rank: int | None = None, comm=None) -> "Signals":
        """Idempotent; `rank` (once MPI knows it) decides who prints. `comm` (MPI_COMM_WORLD,
        once MPI has started here) is what an immediate exit aborts; an exit asked for before
        then happens now."""
        if rank is not None:
            self.rank = rank
        if comm is not None:
            self.comm = comm
            if self.exit_pending:
                self._exit_now()
        if self.installed:
            return self
        for name in ("SIGINT",) + STOP_SIGNALS:
            try:
                signal.signal(getattr(signal, name), self._handler)
            except (ValueError, OSError, AttributeError):   # not the main thread / no such signal
                continue
        self.installed = True
        return self

    def stop_served(self) -> None:
        """A run has stopped and saved for a SIGTERM/SIGUSR1: the next run in this process (a
        sweep's next point) starts without the flag, as each run did when it had its own."""
        if not self.interrupted:
            self.received = None

    def training_started(self) -> None:
        """From here on a first SIGINT stops at the next step with a checkpoint."""
        self.training = True

    def _handler(self, signum, frame) -> None:
        if self.on_signal(signum) == "exit":
            self._exit_now()

    def _exit_now(self) -> None:
        if self.comm is None:
            # MPI is still starting on this rank: leaving now would strand the others in
            # MPI_Init. install(rank, comm) exits as soon as it has started.
            self.exit_pending = True
            return
        rank = self.rank if self.rank is not None else _rank_from_env()
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - e.g. the signal interrupted a write to stdout
            pass
        if rank == 0:
            try:
                os.write(2, (self.exit_message() + "\n").encode())
            except OSError:
                pass
            if not self.training and self.before_exit is not None:
                try:
                    self.before_exit()
                except Exception:  # noqa: BLE001 - the exit itself must happen
                    pass
        if self.training:
            # Every rank is past MPI_Init: a rank that exits after MPI started ends the job
            # under any launcher, and it must leave before the launcher does (MPICH's
            # mpiexec, on its own second Ctrl-C, cleans up and exits 0).
            if rank != 0:
                # Rank 0 may sit in a collective waiting for this rank, where its handler
                # cannot run: once the grace is over (the launcher has not ended the job for
                # a rank 0 that printed and left) this rank says it instead.
                time.sleep(ABORT_GRACE_S)
                try:
                    os.write(2, (self.exit_message() + "\n").encode())
                except OSError:
                    pass
            os._exit(INTERRUPT_EXIT)
        if rank != 0:
            time.sleep(ABORT_GRACE_S)
        _abort(self.comm)


def _abort(comm) -> None:
    """End the whole job with exit status 130, without MPICH's one-line abort banner: the
    interrupt's own line has been printed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    except OSError:
        pass
    abort_job(comm, INTERRUPT_EXIT)


# One per process: signal handlers are process-wide.
SIGNALS = Signals()


def python_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt again, for a process that is no training rank and must
    clean up on it (the Slurm sweep launcher cancels the jobs it submitted)."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:      # not the main thread: its handler is not ours to change
        pass
