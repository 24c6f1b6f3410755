"""Entry point: every rank runs this.

    mpirun -n 4 python -m hpc_rlx                                  # default job
    mpirun -n 4 python -m hpc_rlx model=cnn optim=adamw optim.lr=3e-3
    mpirun -n 4 python -m hpc_rlx -m optim.lr=0.1,0.05 policy=sync,cadence   # sweep, in lockstep
    sbatch slurm/train.sh model=cnn train.epochs=20

MPI starts before Hydra so that all ranks agree on one run directory (a known trap: each
process computing its own timestamped directory), and so that only rank 0 writes Hydra's
files. The Hydra task is a thin wrapper: the work is `hpc_rlx.runtime.train.train(spec, comm)`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.config import CONFIG_DIR as _CONFIG_DIR   # ./configs links there


def _run_id(comm) -> str:
    """One run id for all ranks: under Slurm the job's directory or a fresh one of the job
    (hpc_rlx.config.rundirs: only the same training continues a directory), else rank 0's clock."""
    global _FRESH_ROOT
    rid = fresh = None
    if comm.rank == 0:
        from hpc_rlx.config.rundirs import claim_timestamp_dir, new_run_root, slurm_run_id
        argv = sys.argv[1:]
        rid = slurm_run_id(argv)
        if rid is None:
            rid, fresh = claim_timestamp_dir(argv, time.strftime("%Y-%m-%d_%H-%M-%S"))
        else:
            fresh = new_run_root(argv, rid)   # before anything creates it
    rid, _FRESH_ROOT = comm.bcast((rid, fresh), root=0)
    return rid


# The directory this run creates for its run directory; removed again if the run fails before
# training (only a run that trained keeps a directory).
_FRESH_ROOT: Path | None = None


def _remove_unused_run_dir() -> None:
    from hpc_rlx.config.rundirs import remove_unused_run_dir
    remove_unused_run_dir(_FRESH_ROOT)


# How long the ranks wait for each other before rank 0 removes an unused run directory. They
# all reach that point at once unless one is dead or the machine is very busy.
RUN_DIR_AGREE_S = 60.0


def _all_ranks_done_with_run_dir(comm, timeout_s: float = RUN_DIR_AGREE_S) -> bool:
    """Every rank calls this before rank 0 removes the run directory: every rank creates it as
    its job starts (Hydra on rank 0, run_job on the others), and a rank still on its way there
    (an error from rank 0's broadcast reaches it late) would create it again after the removal. A non-blocking
    barrier, waited for at most `timeout_s`, so a dead rank cannot hang the exit."""
    if _FRESH_ROOT is None or comm.size == 1:
        return True
    try:
        req = comm.Ibarrier()
        deadline = time.monotonic() + timeout_s
        while not req.Test():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
    except Exception:  # noqa: BLE001 - the directory is a nicety; the error report is not
        return False


def _error_exit(comm, failure) -> None:
    """Errors agreed by every rank print once (rank 0) and exit 2; anything else prints one
    message from the failing rank (rank, host, what it was doing, step, cause) and aborts.
    `failure`: a `resilience.failure.RunFailure`."""
    from hpc_rlx.comm.collective import CollectiveError, abort
    from hpc_rlx.base.topology import hostname

    from hpc_rlx.base.errors import HpcRlxError

    exc, step = failure.cause, failure.step
    at = "" if step is None else f" at step {step}"
    if isinstance(exc, CollectiveError) or (isinstance(exc, HpcRlxError) and getattr(exc, "agreed", False)):
        origin = getattr(exc, "origin", 0)
        # an error decided from the bucket names no host: rank 0, which prints, is the origin
        host = getattr(exc, "host", None) or (hostname() if origin == 0 else None)
        _all_ranks_done_with_run_dir(comm)
        if comm.rank == 0:
            _remove_unused_run_dir()
            kind = getattr(exc, "kind", type(exc).__name__)
            text = str(exc)
            who = f"rank {origin}" + (f" on {host}" if host else "")
            if text.startswith("Traceback"):
                # an unexpected exception that every rank agreed on: the cause first, then where
                cause = text.rstrip().splitlines()[-1]
                sys.stderr.write(f"hpc_rlx: error ({kind}, reported by {who}) during "
                                 f"{failure.doing}{at}: {cause}\n{text}\n")
            else:
                sys.stderr.write(f"hpc_rlx: error ({kind}, reported by {who}): {text}\n")
            sys.stderr.flush()
            _log_in_run_dir(f"hpc_rlx: error ({kind}, reported by {who}): {text}")
        sys.stdout.flush()
        raise SystemExit(2)
    if isinstance(exc, HpcRlxError):
        cause, detail = f"{type(exc).__name__}: {exc}", ""
    else:
        cause = "".join(traceback.format_exception_only(exc)).strip()
        detail = "\n" + "".join(traceback.format_exception(exc)).rstrip()
    _remove_unused_run_dir()     # the failing rank: the others are about to be killed
    abort(comm, f"hpc_rlx: rank {comm.rank} on {hostname()} failed during {failure.doing}"
                f"{at}: {cause}{detail}\n"
                f"hpc_rlx: aborting all {comm.size} ranks", code=1)


def _log_in_run_dir(line: str) -> None:
    """The error line in the run directory's log too, if the directory is kept."""
    try:
        from hydra.core.hydra_config import HydraConfig

        from hpc_rlx.observe.display import append_run_log
        run_dir = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - before Hydra: there is no run directory yet
        return
    if run_dir.is_dir():
        append_run_log(run_dir, line)


_FAILED_POINTS: list[str] = []     # sweep points that failed with an agreed error


def _added_keys(task_overrides) -> list[str]:
    """`+key=value` overrides: keys the config does not declare, which hpc_rlx never reads."""
    return [o for o in task_overrides if o.startswith("+") and not o.startswith("++")]


def run_job(job, comm, cfg=None, hydra_cfg=None) -> float | None:
    """Compose the spec on rank 0, ship it, train. Returns the final val_loss (for sweeps).
    `job` comes from Hydra on rank 0 and from rank 0's word on the others (runtime.job_channel);
    `cfg` and `hydra_cfg`, the composed config and Hydra's own, exist on rank 0 only."""
    from hpc_rlx.resilience.ulfm import current
    comm = current(comm)    # after a dead rank (comm.on_failure=shrink): the survivors' communicator
    locks: list = []        # the run directory's lock, once rank 0 took it
    try:
        # Inside the try: a rank that cannot even import must take the job down, not leave the
        # others waiting in the spec broadcast.
        from hpc_rlx.comm import collective
        from hpc_rlx.config.spec import TrainSpec
        from hpc_rlx.injection import DebugHooks, spec_failure_hooks
        from hpc_rlx.resilience.startup import ship_spec, train_surviving_startup
        from hpc_rlx.runtime.train import train

        # Hydra makes the directory on rank 0; a rank on a node that does not share its
        # filesystem needs its own (hpc_rlx warns about that case once training starts)
        Path(job.run_dir).mkdir(parents=True, exist_ok=True)
        if comm.rank == 0:
            from hpc_rlx.observe import debuglog
            debuglog.configure(hydra_cfg.verbose)
        hooks = None if comm.rank == 0 else spec_failure_hooks(sys.argv[1:], comm.rank)
        if hooks is not None:   # debug.fail_point=spec on another rank: read from the command line
            hooks.fail_at("spec")
        # a dead rank: the survivors' communicator
        shipped, comm, lost = ship_spec(comm, lambda: _compose_spec(job, comm, cfg, hydra_cfg, locks))
        spec = TrainSpec.from_dict(shipped)
        if comm.rank == 0:
            debuglog.startup(spec)

        def first(spec, comm, earlier):
            rank = earlier.world_ranks[comm.rank] if earlier else comm.rank     # the job's number
            collective.agree(comm, lambda: DebugHooks.for_rank(spec, rank).fail_at("startup"))

        # comm.on_failure=shrink|spare: a rank that dies before the first step starts it over
        result = train_surviving_startup(spec, comm, train, first, lost)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must end the whole job
        if isinstance(exc, KeyboardInterrupt):
            raise
        from hpc_rlx.resilience.failure import failure_of
        failure = failure_of(exc)      # before `train`: a failure of the start-up
        comm = current(comm)     # a rank died during this job: the survivors' word, not the old world's
        if job.multirun and _is_agreed(failure.cause):
            # One bad sweep point: every rank agrees on it, so record it and go on to the next.
            _record_failed_point(comm, failure.cause, Path(job.run_dir))
            return None
        _error_exit(comm, failure)
        raise
    finally:
        for lock in locks:
            lock.release()    # a sweep's next point, or this directory's next job, may take it
    if result.get("status") == "interrupted":
        from hpc_rlx.runtime.signals import INTERRUPT_EXIT
        raise SystemExit(INTERRUPT_EXIT)     # Ctrl-C: the checkpoint is written; a sweep stops too
    final = result.get("final") or {}
    return final.get("val_loss")


def _compose_spec(job, comm, cfg, hydra_cfg, locks: list) -> dict:
    """Rank 0: the spec of the composed config `cfg`, as a dict; the run directory's lock,
    taken before this job writes anything there, added to `locks`."""
    from omegaconf import OmegaConf

    from hpc_rlx.base.topology import hostname
    from hpc_rlx.config.overrides import unset_values
    from hpc_rlx.config.spec import build_spec
    from hpc_rlx.injection import DebugHooks
    from hpc_rlx.observe.run_lock import RunDirLock
    from hpc_rlx.resilience.mode import check_on_failure

    from hpc_rlx.base.errors import ConfigError

    added = _added_keys(hydra_cfg.overrides.task)
    if added:
        raise ConfigError(f"unknown config key(s) {', '.join(added)}: hpc_rlx rejects keys it "
                          f"does not read (see configs/config.yaml and configs/<group>/)")
    unset = unset_values(cfg)     # checked before Hydra too, but not for a sweep's points
    if unset:
        raise ConfigError(unset)
    locks.append(RunDirLock.acquire(job.run_dir, hostname()))
    container = OmegaConf.to_container(cfg, resolve=True)
    DebugHooks.from_section(container.get("debug") or {}, 0).fail_at("spec")   # debug.fail_point=spec
    return build_spec(container, job.run_dir, comm.size, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                      refusals=check_on_failure).to_dict()      # comm.on_failure's, before anything is read


def _is_agreed(exc: BaseException) -> bool:
    from hpc_rlx.comm.collective import CollectiveError
    return isinstance(exc, CollectiveError)


def _record_failed_point(comm, exc: BaseException, out: Path) -> None:
    import json

    message = f"{getattr(exc, 'kind', type(exc).__name__)}: {exc}"
    _FAILED_POINTS.append(out.name)
    if comm.rank == 0:
        sys.stderr.write(f"hpc_rlx: error in sweep point {out.name}: {message}\n")
        out.mkdir(parents=True, exist_ok=True)
        (out / names.SUMMARY).write_text(json.dumps({"status": "failed", "error": message}, indent=1))


# Hydra flags that print something and exit without running a job.
PRINT_ONLY_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")


def main() -> None:
    from hpc_rlx.runtime.signals import INTERRUPT_EXIT, SIGNALS
    SIGNALS.install()   # first: a Ctrl-C while MPI and Hydra start exits quietly (see signals.py)

    # Open MPI: the bucket's node window (comm.shared_memory) is one-sided memory, which osc/sm
    # serves; the osc/ucx component prints an error on every rank while it probes a machine
    # without UCX devices (the pip wheel on a plain host). A site's own setting wins.
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    # mpirun --with-ft ulfm: no collective component that answers a dead rank with a wrong sum
    # (and with Open MPI's failure detector in its thread, no MPI_Finalize: resilience/ulfm.py)
    from hpc_rlx.resilience.ulfm import before_mpi_starts
    before_mpi_starts()
    # more ranks than cores on this node: waiting ranks sleep between MPI's polls (comm/waiting.py)
    from hpc_rlx.comm.waiting import apply_before_mpi_starts
    apply_before_mpi_starts()
    from mpi4py import MPI

    from hpc_rlx.runtime.job_channel import JobChannel
    from hpc_rlx.comm.launcher_watch import watch_parent
    watch_parent()      # a rank whose launcher died leaves instead of waiting for ever
    comm = MPI.COMM_WORLD
    SIGNALS.install(comm.rank, comm)    # a Ctrl-C that came while MPI started exits here
    print_only = any(a.split("=", 1)[0] in PRINT_ONLY_FLAGS for a in sys.argv[1:])
    if print_only:
        # --help and the like print and exit: once, from rank 0, with no collective and no
        # run directory (every rank sees the same command line, so all take this branch)
        if comm.rank != 0:
            return
        rid = time.strftime("%Y-%m-%d_%H-%M-%S")
    else:
        rid = _run_id(comm)
    SIGNALS.before_exit = _remove_unused_run_dir     # a Ctrl-C before training leaves no directory
    channel = JobChannel(comm)
    if print_only:
        channel.others_left()    # the others returned above; nobody waits for a word
    from hpc_rlx.resilience.ulfm import leave_without_finalize
    try:
        try:
            if comm.rank == 0:
                code = _lead(comm, channel, rid, print_only)
            else:
                # the other ranks never compose: they run the jobs rank 0 announces
                code = channel.follow(lambda job: run_job(job, comm))
        except KeyboardInterrupt:   # raised only where python_interrupts() asked for it, after clean-up
            sys.stderr.write("hpc_rlx: interrupted\n")
            raise SystemExit(INTERRUPT_EXIT) from None
    except SystemExit as e:
        leave_without_finalize(e.code)   # a survived dead rank, or the detector: no MPI_Finalize
        raise
    leave_without_finalize(code)
    if code:
        raise SystemExit(code)


# slurm/train.sh names a file here when it cannot know the run directory itself (a
# fault-tolerant run outside Slurm): rank 0 writes the directory into it as the run starts, so
# a launch whose ranks never got that far is not taken for a finished run (mpirun exits 0 then)
RUN_DIR_REPORT_ENV = "HPC_RLX_RUN_DIR_REPORT"


def _report_run_dir(job) -> None:
    path = os.environ.get(RUN_DIR_REPORT_ENV)
    if path and not job.multirun:
        try:
            Path(path).write_text(str(Path(job.run_dir).resolve()) + "\n")
        except OSError as e:
            sys.stderr.write(f"hpc_rlx: warning: cannot write the run directory to {path}: {e}\n")


def _lead(comm, channel, rid: str, print_only: bool) -> int:
    """Rank 0: check the command line, run Hydra, tell the others each job and the end.
    Returns the exit status."""
    from omegaconf import OmegaConf

    from hpc_rlx.runtime.job_channel import Job
    from hpc_rlx.config.overrides import config_problem

    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: rid)
    problem = None if print_only else config_problem(sys.argv[1:])
    if problem:
        _remove_unused_run_dir()
        from hpc_rlx.base.topology import hostname
        sys.stderr.write(f"hpc_rlx: error (ConfigError, reported by rank 0 on {hostname()}): {problem}\n")
        sys.stderr.flush()
        channel.end(2)
        return 2

    import hydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(config_path=_CONFIG_DIR, config_name="config", version_base="1.3")
    def _task(cfg):
        hc = HydraConfig.get()
        job = Job(run_dir=str(hc.runtime.output_dir), multirun=str(hc.mode).endswith("MULTIRUN"))
        _report_run_dir(job)
        channel.start(job)
        try:
            return run_job(job, comm, cfg, hc)
        except BaseException:
            # an agreed error or a served Ctrl-C: every rank leaves this job the same way
            channel.others_left()
            raise

    try:
        _task()
    except SystemExit as e:
        # Hydra's own exit (a config it cannot compose, a failing callback): tell the others
        code = e.code if isinstance(e.code, int) else 1
        channel.end(code)
        raise
    except BaseException:
        channel.end(1)
        raise
    code = 0
    if _FAILED_POINTS:
        sys.stderr.write(f"hpc_rlx: {len(_FAILED_POINTS)} sweep point(s) failed: "
                         f"{', '.join(_FAILED_POINTS)} (see sweep_summary.md)\n")
        code = 2
    channel.end(code)
    return code


if __name__ == "__main__":
    main()
