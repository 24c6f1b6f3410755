"""What each rank holds alone, in a checkpoint: a policy's `rank_state` (a windowed policy's
inner optimizer state, the coded wire's residuals, with streaming syncs the rank's parameters
and the fragment in flight), gathered into rank 0's file and handed back rank by rank.

In the file, rank r's arrays are ``ranks/<r>/<name>`` and its scalars ``meta["rank_states"][r]``.
Rank 0 holds every rank's arrays while it writes (world size x what one rank keeps; the
messages are pickled, so one rank's state must stay under MPI's 2 GiB message size). A resume on
the same world size gives each rank its own back; on another, none (the policy falls back to
what every rank shares, see `policies/windowed_state.py`).
"""

from __future__ import annotations

import numpy as np

PREFIX = "ranks/"


def gather(comm, policy, worker) -> list | None:
    """Collective: every rank's `policy.rank_state(worker)` on rank 0 (None elsewhere, and
    everywhere for a policy that keeps none)."""
    state = policy.rank_state(worker)
    if state is None:           # the same on every rank: the policy decides, not the rank
        return None
    return comm.gather(state, root=0)


def into_file(states: list | None, arrays: dict, meta: dict) -> None:
    """Rank 0: the gathered states into the checkpoint's arrays and meta."""
    if not states:
        return
    for r, state in enumerate(states):
        for name, value in state["arrays"].items():
            arrays[f"{PREFIX}{r}/{name}"] = np.asarray(value)
    meta["rank_states"] = [state["scalars"] for state in states]


def split(arrays: dict) -> tuple[dict, dict]:
    """(what every rank receives, {rank: {name: array}}) of a checkpoint's arrays."""
    shared, per_rank = {}, {}
    for name, value in arrays.items():
        if name.startswith(PREFIX):
            r, _, rest = name[len(PREFIX):].partition("/")
            per_rank.setdefault(int(r), {})[rest] = value
        else:
            shared[name] = value
    return shared, per_rank


def hand_back(comm, per_rank: dict | None, meta: dict) -> dict | None:
    """Collective: rank r receives ``{"arrays", "scalars"}`` of rank r when the checkpoint was
    written on this world size with per-rank states, else None (on every rank alike)."""
    scalars = meta.get("rank_states")
    if not scalars or int(meta["world_size"]) != comm.size:
        return None
    parts = ([{"arrays": per_rank.get(r, {}), "scalars": scalars[r]} for r in range(comm.size)]
             if comm.rank == 0 else None)
    return comm.scatter(parts, root=0)
