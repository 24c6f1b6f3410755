"""`comm.on_failure`: what a dead rank does to the run. `abort` (the default): nothing here, the
job ends as it always did. `shrink`: the survivors carry on, by MPI's fault tolerance (ULFM,
`resilience/ulfm.py`); the decisions are `resilience/plan.py`'s.

A recovery, on every survivor, from the step whose collective reported the failure:

1. the node's shared window (`comm.shared_memory`) is abandoned: its communicators revoked so
   no rank stays in its barriers, the window never freed (that may hang), its segment kept as
   this rank's own bucket memory; the bucket is summed by MPI's Allreduce from then on;
2. revoke, acknowledge, agree, shrink (`ulfm.shrink`): the survivors' communicator;
3. the survivors agree on the step to continue from (`plan.adoption`: forward) and
   the ones behind take that state by broadcast; under `cadence` and `async` every survivor
   first drops the window in flight (back to the last sync: the restore point the policy
   marks at each, `Loop.restore_point`) and all then take rank 0's inner optimizer state;
4. each part of the run that survives a dead rank rebuilds over the survivors by its one
   method (`hooks.RankLossHook.rebuild`): the worker re-plans the data exactly as a resume on
   that many ranks does (the same global batch; the learning rate scaled for the new world
   size) and reads its new shard, a windowed policy is set up again as a resume of the
   adopted survivor's state on that many ranks, the checkpoints follow the new writer; and
   training goes on from the state in memory.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.comm import collective, watchdog
from hpc_rlx.comm.collective import CollectiveError
from hpc_rlx.base.topology import hostname, rank_span
from hpc_rlx.data.files import plan_files
from hpc_rlx.base.errors import ConfigError, phase
from hpc_rlx.observe.display import RunDisplay
from hpc_rlx.observe.outputs import RunOutputs
from hpc_rlx.observe.run_lock import RunDirLock
from hpc_rlx.resilience import plan, ulfm
from hpc_rlx.resilience.hooks import RankLossHook, Survivors, rank_loss_hooks
from hpc_rlx.resilience.mode import FailureMode

class FailureHandling:
    """One run's `comm.on_failure`. Collective to `start` (under `shrink`: the ranks' hosts)."""

    def __init__(self, spec, comm, earlier=None):
        self.failure_mode = FailureMode.of(spec.comm)
        self.mode = self.failure_mode.name
        # `earlier`: what failed starts left (`resilience.startup.EarlierStarts`), else None
        self.failures: list[dict] = list(earlier.failures) if earlier else []
        # rank in the current comm -> MPI_COMM_WORLD rank
        self.world_ranks = list(earlier.world_ranks) if earlier else list(range(comm.size))
        # rank in the current comm -> the shard it trains (None: a spare, comm.on_failure=spare)
        training = self.failure_mode.training_ranks(comm.size)
        self.roles: list = list(range(training)) + [None] * (comm.size - training)
        self.hosts: list[str] | None = None
        self.lock = None            # the run directory's lock, once this rank took it over
        self.watchdog = None        # the stall watchdog over the survivors, once rebuilt
        self.latest = comm          # the newest communicator of the survivors
        # what a recovery goes back to (`keep`): the agreed model's array and a copy of this
        # rank's optimizer state then; None where no agreement was marked (lockstep policies)
        self.restore: tuple | None = None

    @property
    def active(self) -> bool:
        return self.failure_mode.active

    @property
    def has_spares(self) -> bool:
        """Whether the run keeps spare ranks (comm.on_failure=spare)."""
        return self.failure_mode.has_spares

    def check_launch(self) -> None:
        """This rank's refusal of `shrink` where ULFM is not active (run under `agree`)."""
        if not self.active:
            return
        why = ulfm.problem()
        if why is not None:
            raise ConfigError(f"comm.on_failure={self.mode} needs MPI's fault tolerance (ULFM), which "
                              f"this job does not have: {why}; launch with Open MPI 5's `{ulfm.WORKS}`, or use "
                              f"comm.on_failure=abort")

    def start(self, comm) -> None:
        """Collective where active: the refusal where ULFM is not, and the ranks' hosts."""
        if self.active:     # the same spec on every rank: all take this branch or none
            collective.agree(comm, self.check_launch)     # shrink only where ULFM is active
            self.hosts = comm.allgather(hostname())

    def keep(self, agreed, optimizer) -> None:
        """Where active: the restore point a recovery goes back to, marked where every rank
        holds the same model (a windowed sync): `agreed`, the array that holds that model until
        the next one, and this rank's optimizer state now (copied)."""
        if self.active:
            state = optimizer.state_dict()
            self.restore = (agreed, {"arrays": {k: np.array(v, copy=True) for k, v in state["arrays"].items()},
                                     "scalars": dict(state["scalars"])})

    def roll_back(self, worker) -> None:
        """Back to the restore point, the same way on every survivor (the window in flight
        dropped); nothing where every step ends agreed."""
        if self.restore is not None:
            agreed, optimizer = self.restore
            worker.params[...] = agreed
            worker.optimizer.load_state_dict(optimizer)     # copied in

    @property
    def spares(self) -> int:
        """The spare ranks left (comm.on_failure=spare)."""
        return sum(role is None for role in self.roles)

    def describe(self) -> str:
        spares = f"; {self.spares} spare rank(s): {rank_span(self.world_ranks[-self.spares:])}" if self.spares else ""
        return f"failures: {self.failure_mode.describe()}{spares}"

    def _watch(self, comm, worker, stall) -> None:
        """Collective: the stall watchdog again, over the survivors (comm.stall_*; a new key,
        its side channel rooted at the survivors' rank 0)."""
        self.watchdog = watchdog.StallWatchdog.from_spec(worker.spec, comm, lambda: worker.step, stall=stall)
        watchdog.install(self.watchdog)

    def close(self) -> None:
        """The end of the run: stop the watchdog a recovery started (not collective)."""
        if self.watchdog is not None:
            self.watchdog.close()

    def end_note(self, world_size: int) -> str:
        """What the run's last line adds: the failures it trained through (else nothing)."""
        if not self.failures:
            return ""
        dead = sum(len(f["ranks"]) for f in self.failures)
        return (f"; {dead} rank{'s' if dead > 1 else ''} failed during the run, {world_size} trained "
                f"to the end (comm.on_failure={self.mode}; summary.json failures)")

    def handles(self, exc: BaseException, comm, others: tuple = ()) -> bool:
        """Whether `exc` is a dead rank of `comm` (or of `others`, derived from it) that this
        run survives."""
        return self.active and ulfm.failure_known(exc, comm, others=others)

    # ---- one recovery ------------------------------------------------------------------
    def recover(self, comm, worker, policy, totals, hooks=None,
                components: tuple[RankLossHook, ...] = ()) -> "Recovered":
        """Collective over the survivors of `comm`, after `handles` took an error. A rank that
        dies during the recovery is shrunk away too, and the recovery starts over (one record
        for all). `hooks`: this rank's debug.* (`injection.DebugHooks`): a failure injected into
        the recovery, the stall plan for the watchdog over the survivors. `components`
        (`hooks.RankLossHook`, the worker first) rebuild over the survivors, in order; of the
        policy, only what it declares is read (`own_optimizer_state`, `name`)."""
        t0 = time.perf_counter()
        world_before, writer = worker.world, self.world_ranks[0]
        shared_off = worker.bucket.abandon_node_memory()
        self.roll_back(worker)         # a windowed policy: the window in flight is dropped
        watchdog.current().close("a rank failed")     # its side channel knew the old ranks
        dead: list[tuple[int, str]] = []
        replaced: list[tuple[int, str, int]] = []
        while True:
            try:
                new = self._shrink(comm, dead, replaced)
                if hooks is not None:
                    hooks.fail_at("recovery")     # debug.fail_point=recovery: a second failure here
                adopted = self._continue(new, worker, writer, dead)
                totals = _adopt(new, adopted, worker, policy.own_optimizer_state, totals)
                survivors = Survivors(new, len(self.roles) - self.spares, adopted.source,
                                      new_writer=writer not in self.world_ranks and new.rank == 0)
                for component in components:
                    component.rebuild(survivors)
                self._watch(new, worker, None if hooks is None else hooks.stall)
                break
            except CollectiveError:
                raise
            except Exception as exc:    # noqa: BLE001 - another rank died: shrink again, else re-raised
                if not ulfm.failure_known(exc, self.latest):
                    raise
                comm = self.latest
        record = plan.failure_record(adopted.step, [r for r, _ in dead], [h for _, h in dead],
                                     time.perf_counter() - t0, worker.world,
                                     self.spares if self.has_spares else None, [r for r, _, _ in replaced])
        self.failures.append(record)
        notes = [plan.failure_line(record, world_before, self.mode, replaced)]
        writer_failed = writer not in self.world_ranks
        if writer_failed:
            notes.append(f"rank {new.rank} on {hostname()} (rank {self.world_ranks[0]} of the job) writes "
                         f"the run directory from here on")
        if policy.own_optimizer_state:
            notes.append(f"policy={policy.name}: the window in flight is dropped; the survivors go on from the "
                         f"sync of step {adopted.step} with rank 0's inner optimizer state, as a resume on "
                         f"{worker.world} ranks would")
        if shared_off:
            notes.append("the node's shared-memory sum is off for the rest of the run (its window is "
                         "abandoned after the failure); the bucket is summed by MPI's Allreduce")
        return Recovered(new, totals, record, tuple(notes), writer_failed=writer_failed)

    def _shrink(self, comm, dead: list, replaced: list):
        """The survivors' communicator, renumbered where a spare took a dead rank's shard (the
        ranks that train first, by shard, then the spares); the dead ranks (job rank, host)
        added to `dead`, the spares that took a shard (job rank, host, shard) to `replaced`.
        `latest` is the newest communicator, whose order `world_ranks`, `hosts` and `roles`
        follow (the shrunk one, should a rank die during the renumbering)."""
        shrunk = self.latest = ulfm.shrink(comm).comm
        survivors = survivors_of(comm, shrunk)
        lost, self.world_ranks, self.hosts = plan.follow_survivors(self.world_ranks, self.hosts or ["?"] * comm.size,
                                                                   survivors)
        dead += lost
        world = sum(role is not None for role in self.roles)
        self.roles = [self.roles[r] for r in survivors]
        placed = plan.places(self.roles, world)
        replaced += [(self.world_ranks[i], self.hosts[i], s) for i, s in placed.replaced]
        if placed.keys == tuple(range(shrunk.size)):
            self.roles = list(placed.roles)
            return shrunk
        new = self.latest = shrunk.Split(0, placed.keys[shrunk.rank])
        ulfm.replaced(shrunk, new)      # the renumbered one is the one to follow
        order = sorted(range(shrunk.size), key=lambda i: placed.keys[i])
        self.world_ranks = [self.world_ranks[i] for i in order]
        self.hosts = [self.hosts[i] for i in order]
        self.roles = [placed.roles[i] for i in order]
        return new

    def _continue(self, new, worker, writer: int, dead: list) -> plan.Adoption:
        """Collective: whether the survivors can go on (the run directory, their positions) and
        from which state; a `RankFailure` on every survivor where they cannot."""
        visible = (Path(worker.spec.run_dir) / names.METRICS).is_file()
        lost = writer not in self.world_ranks
        why = new.bcast(plan.takeover_problem(lost, visible, hostname(), unreadable=_unreadable_source(worker.spec))
                        if new.rank == 0 else None, root=0)
        positions = new.allgather((int(worker.step), int(worker.epoch)))
        who = ", ".join(f"rank {r} on {h}" for r, h in dead)
        try:
            if why is None:
                return plan.adoption([s for s, _ in positions], [e for _, e in positions])
        except ValueError as e:      # the same positions on every survivor: the same error
            why = f"{e}; not survivable yet"
        raise CollectiveError(f"{who} failed at step {worker.step}: {why} (comm.on_failure={self.mode}); "
                              f"resume=auto in the same hydra.run.dir continues from the newest "
                              f"checkpoint", kind="RankFailure")


@dataclass(frozen=True)
class Recovered:
    """What a recovery leaves the run: the survivors' communicator, the epoch's totals to go on
    with, the failure's record, the lines to log, and whether rank 0 (the writer) died."""
    comm: object
    totals: object
    record: dict
    notes: tuple[str, ...]
    writer_failed: bool


class Survives:
    """The loop's side of `comm.on_failure` (`runtime.train.Run` is one): a part of training
    run through `_survive` is redone over the survivors after a dead rank, from the state they
    continue from. Uses the run's failure handling and its context (`ctx`: comm, worker,
    policy, checkpoints, outputs), which a recovery replaces with the survivors' one."""

    def _survive(self, call, totals):
        """(`call()`, the epoch's totals to go on with)."""
        while True:
            try:
                return call(), totals
            except Exception as exc:
                if not self.failure.active:      # comm.on_failure=abort: as it always was
                    raise
                if not self.failure.handles(exc, self.comm, self.worker.bucket.communicators):
                    raise
                totals = self._recover(totals)

    def _recover(self, totals):
        with phase("recovery from a failed rank"):
            done = self.failure.recover(self.comm, self.worker, self.policy, totals, self.hooks,
                                        components=rank_loss_hooks(self.ctx))
        self.ctx = self._survivors_context(done)
        self.current_totals = done.totals
        if done.writer_failed and self.rank == 0:
            self._take_over()
        for note in done.notes:
            self.log(note)
        if self.outputs:
            self.outputs.event({"event": "failure", **done.record})
        self.display.event({"event": "failure", **done.record})
        return done.totals

    def _survivors_context(self, done: Recovered):
        """The run's context for the survivors, in place of this one: their communicator and
        this rank's number in it; where rank 0 (the writer) died, the survivors' rank 0 writes
        the run directory from here on (the log, the progress display, steps.jsonl,
        metrics.jsonl)."""
        ctx, rank = self.ctx, done.comm.rank
        if not (done.writer_failed and rank == 0):
            return replace(ctx, comm=done.comm, rank=rank)
        outputs = RunOutputs(self.spec, self.worker, self.log, self.lanes.names).taken_over()
        return replace(ctx, comm=done.comm, rank=rank, is_root=True, outputs=outputs,
                       display=RunDisplay(self.spec, True, self.t_start))

    def restore_point(self, agreed) -> None:
        """`policies.base.Loop.restore_point`: where the run survives a dead rank, what a
        recovery goes back to (`FailureHandling.keep`)."""
        self.failure.keep(agreed, self.worker.optimizer)

    def _take_over(self) -> None:
        """Rank 0 died; this rank, the survivors' rank 0 (whose checkpoints took over as they
        rebuilt), starts the display's epoch again and takes the run lock."""
        worker = self.worker
        self.display.open_step_log(worker.steps_per_epoch, worker.step)
        self.display.epoch_start(worker, self._where(), self.current_totals)
        self.failure.lock = RunDirLock.acquire(self.spec.run_dir, hostname())   # the dead rank's is gone


def _unreadable_source(spec) -> str | None:
    """Under data.distribution=scatter, a data file this rank cannot read (rank 0 reads them):
    the first file of each set (a directory or a glob is not itself a file to read)."""
    d = spec.data
    if d.distribution != "scatter":
        return None
    files, val, _ = plan_files(d)
    return next((p for p in dict.fromkeys((files.opened(0), val.opened(0))) if not os.access(p, os.R_OK)), None)


def survivors_of(old, new) -> list[int]:
    """The old ranks of the members of `new`, in `new`'s order (from the groups: the same on
    every survivor, unlike each one's own list of failed ranks)."""
    g_old, g_new = old.Get_group(), new.Get_group()
    try:
        return [int(r) for r in g_new.Translate_ranks(list(range(new.size)), g_old)]
    finally:
        g_old.Free()
        g_new.Free()


def _adopt(comm, adopted: plan.Adoption, worker, own_optimizer_state: bool, totals):
    """The survivors behind take the state of `adopted.source` (parameters, optimizer state,
    position, the epoch's totals and history); where the policy's optimizer state is each
    rank's own (a windowed policy's local steps) every survivor then takes rank 0's, as a
    resume on another world size does. Returns the totals to go on with. What a rank
    receives is taken only once all of it has arrived: where the sender dies half-way, the
    rank keeps its own state, and the next round of the recovery adopts again."""
    src = adopted.source
    mine = comm.rank == src
    if adopted.behind:
        params = worker.params if mine else np.empty_like(worker.params)
        comm.Bcast(params, root=src)
        optimizer = _optimizer_state_of(comm, worker, src)
        meta, their_totals, history = comm.bcast(
            (worker.state.checkpoint_meta(), totals, worker.history) if mine else None, root=src)
        if not mine:
            worker.params[...] = params
            worker.optimizer.load_state_dict(optimizer)
            worker.state.restore(meta, worker.steps_per_epoch, f"survivor {src}'s state")
            worker.history = list(history)
        totals = their_totals
    if own_optimizer_state:
        inner = _optimizer_state_of(comm, worker, 0)
        if inner is not None:
            worker.optimizer.load_state_dict(inner)
    return totals


def _optimizer_state_of(comm, worker, root: int) -> dict | None:
    """`root`'s optimizer state, received into new arrays on every other survivor (`root`:
    None)."""
    state = worker.optimizer.state_dict()
    arrays = {name: value if comm.rank == root else np.empty_like(value) for name, value in state["arrays"].items()}
    for name in sorted(arrays):
        comm.Bcast(arrays[name], root=root)
    scalars = comm.bcast(state["scalars"] if comm.rank == root else None, root=root)
    return None if comm.rank == root else {"arrays": arrays, "scalars": scalars}
