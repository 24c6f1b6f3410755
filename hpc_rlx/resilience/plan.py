"""The decisions of a recovery after a dead rank (`comm.on_failure=shrink|spare`), apart from the MPI
calls that carry them out (`resilience/in_run.py`). Pure: no MPI, no files.

Which state the survivors continue from. ULFM reports a failure unevenly: a survivor may
complete the step's Allreduce (every contribution arrived, the dead rank's included) and
apply the step, while another sees the same Allreduce fail. Survivors are therefore at most
one step apart: a step after that needs an Allreduce every survivor enters, and the ones
behind are in the recovery by then. They continue from **the furthest step** (adoption
forward): the survivor with the lowest rank among those furthest on broadcasts its
parameters, optimizer state and position to the ones behind. Why forward, not back:

- a completed step is a correct step (the exact global gradient of the ranks alive when it
  ran); throwing it away would redo it on fewer ranks, a different gradient, for nothing;
- going back would need the state before the step, a second copy of the parameters and
  optimizer state on every rank at every step; going forward needs only the state a survivor
  already holds.

Only the step in flight (the one no survivor completed) is redone, over the survivors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Adoption:
    """Which step every survivor continues from, and whose state it is."""
    step: int                   # the training position (`worker.step`) all continue from
    source: int                 # the survivor (rank in the survivors' communicator) it comes from
    behind: tuple[int, ...]     # survivors that take it by broadcast (empty: all are there)


def adoption(steps: Sequence[int], epochs: Sequence[int] | None = None) -> Adoption:
    """Forward adoption over the survivors' positions, `steps[r]` (and `epochs[r]`, epochs
    completed) for survivor `r` (pure). Survivors one step apart are in the same epoch: the
    last step of an epoch is followed by its validation, which every survivor enters. Survivors
    at one step in different epochs (a validation that completed on some only) are not
    adopted yet: ValueError."""
    if not steps:
        raise ValueError("no survivor")
    if epochs is not None and len(set(epochs)) > 1:
        raise ValueError(f"survivors are in different epochs ({min(epochs) + 1} and {max(epochs) + 1}) at "
                         f"steps {min(steps)}-{max(steps)}: a validation completed on some of them only")
    furthest = max(steps)
    if furthest - min(steps) > 1:
        raise ValueError(f"survivors more than one step apart ({min(steps)} to {furthest}): "
                         f"a step after a failure cannot complete on some of them only")
    source = list(steps).index(furthest)
    return Adoption(int(furthest), source, tuple(r for r, s in enumerate(steps) if s != furthest))


@dataclass(frozen=True)
class Places:
    """Who trains which shard after a failure (``comm.on_failure=spare``; `shrink` has no
    spares). Per survivor, in the shrunk communicator's order: ``roles[i]``, the shard it
    trains from now on (None: a spare), and ``keys[i]``, its rank in the renumbered
    communicator (the ranks that train first, by shard, then the spares)."""
    roles: tuple
    keys: tuple[int, ...]
    world: int                              # the ranks that train from now on
    spares: int                             # the spares left
    replaced: tuple[tuple[int, int], ...]   # (survivor, shard): a spare that took a dead rank's shard


def places(roles: Sequence[int | None], world: int) -> Places:
    """`roles[i]`: the shard survivor i trained (None: a spare), of `world` shards (pure).
    Each vacant shard, in order, goes to the next spare. Where too few spares are left, the
    ranks that train close up over fewer shards, in their shards' order (`shrink`: a resume on
    that many ranks); the spares stay spares."""
    held = {s for s in roles if s is not None}
    vacant = [s for s in range(world) if s not in held]
    spares = [i for i, s in enumerate(roles) if s is None]
    new = list(roles)
    replaced = tuple(zip(spares, vacant))
    for i, s in replaced:
        new[i] = s
    trainers = sorted((i for i, s in enumerate(new) if s is not None), key=lambda i: new[i])
    if len(trainers) < world:               # no spare for every vacant shard: close up
        for k, i in enumerate(trainers):
            new[i] = k
    left = [i for i in spares if new[i] is None]
    keys = [0] * len(new)
    for k, i in enumerate(trainers + left):
        keys[i] = k
    return Places(tuple(new), tuple(keys), len(trainers), len(left), replaced)


def failed_ranks(old_size: int, survivors: Sequence[int]) -> tuple[int, ...]:
    """Ranks of the old communicator that are not among `survivors` (their old ranks)."""
    alive = set(survivors)
    return tuple(r for r in range(old_size) if r not in alive)


def follow_survivors(world_ranks: Sequence[int], hosts: Sequence[str], survivors: Sequence[int]):
    """After a shrink (pure): the dead ranks as (job rank, host), and the job ranks and hosts of
    the survivors in the new communicator's order. `world_ranks[r]`, `hosts[r]`: the old
    communicator's rank r; `survivors`: the old ranks of the new communicator's members."""
    dead = [(world_ranks[r], hosts[r]) for r in failed_ranks(len(world_ranks), survivors)]
    return dead, [world_ranks[r] for r in survivors], [hosts[r] for r in survivors]


def takeover_problem(writer_failed: bool, run_dir_visible: bool, host: str, writer: int = 0,
                     unreadable: str | None = None) -> str | None:
    """Why the survivors' new rank 0 cannot take over after the rank that wrote the run
    directory (`writer`, which also reads and sends the rows under data.distribution=scatter)
    died, or None (also when the writer lives). `run_dir_visible`: whether the new rank 0 on
    `host` sees the files the writer had written there; `unreadable`: a data file the rows are
    scattered from that it cannot read (None: none, or each rank reads its own rows)."""
    if writer_failed and not run_dir_visible:
        return (f"rank {writer} wrote the run directory, which the survivors' rank 0 on {host} does "
                f"not see (no shared filesystem between their nodes), so no survivor can take it over")
    if writer_failed and unreadable:
        return (f"rank {writer} read the data and sent each rank its rows (data.distribution=scatter), "
                f"and the survivors' rank 0 on {host} cannot read {unreadable}, so no survivor can send them")
    return None


def failure_record(step: int, ranks: Sequence[int], hosts: Sequence[str], recovery_s: float,
                   world_size_after: int, spares_left: int | None = None,
                   replaced_by: Sequence[int] = ()) -> dict:
    """One failure, as `summary.json["failures"]` and the metrics event hold it. `ranks`: the
    dead ranks as the job's MPI_COMM_WORLD numbered them; under ``comm.on_failure=spare`` also
    the spares left and the job ranks of the spares that took their places."""
    record = {"step": int(step), "ranks": [int(r) for r in ranks], "hosts": list(hosts),
              "recovery_s": round(float(recovery_s), 4), "world_size_after": int(world_size_after)}
    if spares_left is not None:
        record.update(spares_left=int(spares_left), replaced_by=[int(r) for r in replaced_by])
    return record


def failure_line(record: dict, world_before: int, mode: str = "shrink",
                 replaced: Sequence[tuple[int, str, int]] = ()) -> str:
    """The log line of one recovered failure; `replaced`: (job rank, host, shard) of each
    spare that took a dead rank's place (``comm.on_failure=spare``)."""
    who = ", ".join(f"{r} on {h}" for r, h in zip(record["ranks"], record["hosts"]))
    n, after = len(record["ranks"]), record["world_size_after"]
    how = f"recovered in {record['recovery_s']:.2f} s"
    if mode == "spare":
        took = [f"spare rank {r} on {h} trains shard {s}" for r, h, s in replaced]
        left = record.get("spares_left", 0)
        if after == world_before:
            return (f"rank{'s' if n > 1 else ''} {who} failed: {'; '.join(took) or 'no shard lost'}; {after} ranks "
                    f"train on from step {record['step']}, {left} spare{'s' if left != 1 else ''} left "
                    f"(comm.on_failure=spare, {how})")
        return (f"rank{'s' if n > 1 else ''} {who} failed: {''.join(t + '; ' for t in took)}no spare left, "
                f"{after} of {world_before} ranks train on from step {record['step']} "
                f"(comm.on_failure=spare goes on as shrink, {how})")
    return (f"rank{'s' if n > 1 else ''} {who} failed: {after} of "
            f"{world_before} ranks train on from step {record['step']} "
            f"(comm.on_failure=shrink, {how})")
