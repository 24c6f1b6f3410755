"""A rank that dies before training starts (``comm.on_failure=shrink|spare``): the survivors
shrink and set the run up again.

Between the spec's broadcast and the first step (the weights' broadcast, data loading, the
lanes, the node's shared window, a resume) the survivors hold nothing that a fresh setup does
not rebuild: every one of them has the spec, rank 0's initial weights are a function of the
seed, and a checkpoint is read again. So a dead rank there is handled by starting over:

1. the node's shared window, if one was made, is abandoned (its communicators revoked, the
   window never freed: `node_memory.NodeSharedSum.abandon`);
2. revoke, agree, shrink (`resilience/ulfm.py`), as in a recovery during training;
3. under ``comm.on_failure=spare`` a dead rank takes a spare with it: the spec's
   ``comm.spares`` drops by the dead count (a dead spare included), so the first spares left
   train the dead ranks' shards, and with none left the ranks that train are fewer (`shrink`);
4. `train` again on the survivors, with the failure as the first record of `failures`
   (``step`` 0) and the job's rank numbers carried over, so later records name the same ranks.

The spec's own broadcast (`ship_spec`): a rank that dies during it is dropped and rank 0 sends
the spec again to the survivors; rank 0's death before it sent the spec cannot be survived (no
other rank has the job), and ends the job with one line.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from hpc_rlx.comm import collective
from hpc_rlx.resilience import ulfm
from hpc_rlx.comm.collective import CollectiveError
from hpc_rlx.base.topology import hostname
from hpc_rlx.config.spec import for_job_ranks
from hpc_rlx.observe.run_lock import RunDirLock
from hpc_rlx.resilience import plan
from hpc_rlx.resilience.failure import STARTUP, RunFailed, RunFailure, failure_of
from hpc_rlx.resilience.in_run import survivors_of
from hpc_rlx.resilience.mode import FailureMode


@dataclasses.dataclass(frozen=True)
class SpecLoss:
    """Who of the job's communicator (`job_ranks` ranks) the spec reached: `survivors`, the old
    ranks of the members of the communicator it reached (all of them where none died), and
    the seconds the broadcast took."""
    survivors: list
    job_ranks: int
    seconds: float


@dataclasses.dataclass
class EarlierStarts:
    """What failed starts leave to the next one: their failure records and, per rank of the
    current communicator, its MPI_COMM_WORLD rank and host."""
    failures: list
    world_ranks: list
    hosts: list


def ship_spec(comm, compose):
    """Rank 0 composes the spec (`compose()`, once) and broadcasts it (`root_computes`). Under
    ULFM a rank that dies meanwhile makes the survivors shrink: rank 0, alive, sends it again
    when its spec's comm.on_failure is shrink or spare (else every survivor raises the failure);
    with rank 0 dead no survivor has the job, and every survivor raises that, one line.
    Returns (the spec as a dict, the communicator it reached, `SpecLoss`). Collective."""
    made: list = []
    job, t0 = comm, time.perf_counter()

    def once():
        if not made:
            try:
                made.append(("ok", compose()))
            except Exception as exc:        # noqa: BLE001 - broadcast as root_computes does
                made.append(("err", exc))
        kind, value = made[0]
        if kind == "err":
            raise value
        return value

    while True:
        try:
            spec = collective.root_computes(comm, once)
            survivors = list(range(job.size)) if comm is job else survivors_of(job, comm)
            return spec, comm, SpecLoss(survivors, job.size, time.perf_counter() - t0)
        except Exception as exc:
            # the idle broadcast's Ibarrier may report the dead rank as ERR_OTHER: failure_known
            if not ulfm.is_rank_failure(exc) and not (ulfm.problem() is None and ulfm.failure_known(exc, comm)):
                raise
            shrunk = ulfm.shrink(comm)
            if 0 in shrunk.failed:
                raise CollectiveError("rank 0 died before it sent the job's spec: no other rank holds the job, so "
                                      "it cannot go on whatever comm.on_failure says; launch it again (resume=auto "
                                      "continues from the newest checkpoint)", kind="RankFailure", origin=0) from None
            dead = ", ".join(map(str, shrunk.failed))
            comm = shrunk.comm
            if made and made[0][0] == "ok" and not FailureMode.of(made[0][1]["comm"]).active:
                made[0] = ("err", CollectiveError(f"rank {dead} died during the spec's broadcast "
                                                  f"(comm.on_failure=abort)", kind="RankFailure"))


def train_surviving_startup(spec, comm, train, first=lambda spec, comm, earlier: None, lost: SpecLoss | None = None):
    """`first(spec, comm, earlier)`, then `train(spec, comm, earlier)` on `comm`, both started over on
    the survivors whenever a rank dies before training starts (an error from `first`, or a
    `RunFailed` from `train` whose failure is `before_training`), while comm.on_failure is
    shrink or spare. `lost`: the ranks that died during the spec's broadcast (`ship_spec`), the
    first record. Collective. An error from `first` leaves as `RunFailed` (phase `startup`)."""
    if not FailureMode.of(spec.comm).active:
        _first(first, spec, comm, None)
        return train(spec, comm, None)
    earlier = EarlierStarts([], list(range(comm.size)), comm.allgather(hostname()))
    if lost is not None and len(lost.survivors) < lost.job_ranks:
        # the dead ranks' hosts are unknown: no rank had asked for them before the spec
        dead, earlier.world_ranks, _ = plan.follow_survivors(list(range(lost.job_ranks)), ["?"] * lost.job_ranks,
                                                             lost.survivors)
        spec = _record_loss(spec, comm, earlier, lost.job_ranks, dead, lost.seconds)
    while True:
        try:
            _first(first, spec, comm, earlier)
            return train(spec, comm, earlier)
        except RunFailed as exc:      # a dead rank before training: start over
            failure = failure_of(exc)
            if not failure.before_training or not ulfm.failure_known(failure.cause, comm):
                raise
            comm, spec = _start_over(comm, spec, earlier, failure.abandon)


def _first(first, spec, comm, earlier) -> None:
    try:
        first(spec, comm, earlier)
    except Exception as exc:
        raise RunFailed(RunFailure(exc, phase=STARTUP)) from exc


def _start_over(comm, spec, earlier: EarlierStarts, abandon):
    t0 = time.perf_counter()
    if abandon is not None:
        abandon()                   # the node's shared window: revoked, never freed
    new = ulfm.shrink(comm).comm
    writer = earlier.world_ranks[0]         # the job rank that holds the run directory's lock
    dead, earlier.world_ranks, earlier.hosts = plan.follow_survivors(earlier.world_ranks, earlier.hosts,
                                                                     survivors_of(comm, new))
    spec = _record_loss(spec, new, earlier, comm.size, dead, time.perf_counter() - t0)
    if writer in [r for r, _ in dead] and new.rank == 0:     # the run directory's writer died: take its lock
        RunDirLock.acquire(spec.run_dir, hostname())
    return new, spec


def _record_loss(spec, new, earlier: EarlierStarts, job_ranks: int, dead: list, seconds: float):
    """The failure record of `dead` ((job rank, host) each, of a job of `job_ranks` ranks before
    it), the line rank 0 prints, and the spec for the survivors `new` (returned): under
    comm.on_failure=spare a dead rank takes a spare with it (the first spares left train the
    dead ranks' shards), and the ranks that train and the plan follow the new world."""
    ranks, hosts = [r for r, _ in dead], [h for _, h in dead]
    mode = FailureMode.of(spec.comm)
    before = mode.training_ranks(job_ranks)
    spares = mode.spares_after(len(dead))       # None under shrink: no spares to count
    spec = for_job_ranks(spec, new.size, spares)
    earlier.failures.append(plan.failure_record(0, ranks, hosts, seconds, spec.world_size, spares_left=spares))
    if new.rank == 0:
        who = ", ".join(f"{r} on {h}" if h != "?" else f"{r}" for r, h in dead)    # ?: before any host was asked
        sys.stdout.write(f"[hpc_rlx] rank{'s' if len(ranks) > 1 else ''} {who} died before training started: "
                         f"{spec.world_size} of {before} ranks set the run up again "
                         f"(comm.on_failure={mode.name})\n")
        sys.stdout.flush()
    return spec
