"""What a job may run with when a dead rank must not end it (`comm.on_failure`, `comm.spares`):
checked on rank 0 while the spec is built, one line each. Pure: whether MPI's fault tolerance
(ULFM) is active is asked of every rank at start-up (`runtime/recovery.py`).

`abort` (the default) runs with everything. `shrink` and `spare` run, so far, where the survivors can
rebuild all they hold from the state every rank has and the survivors' communicator:
`policy=sync` on CPU lanes (any data distribution and cache, the bucket summed by any path but
the sharded one, overlapped or not). The rest is refused until it is rebuilt too.
"""

from __future__ import annotations

from hpc_rlx.errors import ConfigError
from hpc_rlx.policies.registry import POLICIES

ON_FAILURE = ("abort", "shrink", "spare")


def shrink_refusal(cfg: dict) -> str | None:
    """Why `comm.on_failure=shrink` cannot run with `cfg` yet, in words, or None (pure)."""
    c = cfg["comm"]
    policy = cfg["policy"]["name"]
    stages = int(cfg["parallel"]["pipeline_stages"])
    device = cfg["device"]["kind"]
    lockstep = POLICIES[policy].steps_are_batches and not POLICIES[policy].bucket_rank_fields
    if not lockstep:     # local steps between syncs, per-rank slots sized by the world
        return (f"policy={policy}: its windows and per-rank slots are not rebuilt over the "
                f"survivors yet; use policy=sync")
    if stages > 1:
        return (f"parallel.pipeline_stages={stages}: a dead rank takes a stage's only copy with "
                f"it; use parallel.pipeline_stages=1")
    if device != "cpu":
        return f"device={device}: GPU lanes are not rebuilt after a failure yet; use device=cpu"
    if c.get("node_shared_params"):
        return ("comm.node_shared_params=true: a node's one copy of the parameters lives in a "
                "shared window that is not rebuilt yet; use comm.node_shared_params=false")
    if c.get("shard", "none") != "none":
        return (f"comm.shard={c['shard']}: a rank holds the only copy of its slice of the "
                f"optimizer state; use comm.shard=none")
    if cfg["trace"].get("enabled"):
        return "trace.enabled=true: the trace is not gathered over the survivors yet; use trace.enabled=false"
    return None


def check_on_failure(cfg: dict, world_size: int | None = None) -> None:
    """Refuse what `comm.on_failure` and `comm.spares` cannot run with (one line each);
    `world_size`: the job's ranks, spares included (None: not checked against it)."""
    c = cfg["comm"]
    mode, spares = c.get("on_failure", "abort"), int(c.get("spares") or 0)
    if spares and mode != "spare":
        raise ConfigError(f"comm.spares={spares} applies to comm.on_failure=spare, got "
                          f"comm.on_failure={mode}")
    if mode == "spare" and spares < 1:
        raise ConfigError("comm.on_failure=spare needs comm.spares >= 1 (the ranks, launched on top of "
                          "the training ones, that wait to take a dead rank's place)")
    if mode == "spare" and world_size is not None and spares >= world_size:
        raise ConfigError(f"comm.spares={spares} leaves no rank to train on {world_size} ranks: launch "
                          f"{spares} more than the ranks that train (mpirun -n N+{spares})")
    if mode in ("shrink", "spare"):
        why = shrink_refusal(cfg)
        if why is not None:
            raise ConfigError(f"comm.on_failure={mode} does not run with {why}")


def training_ranks(c: dict, world_size: int) -> int:
    """The ranks that train: the job's, less `comm.spares` under `comm.on_failure=spare`
    (`c`: the comm section)."""
    return world_size - (int(c.get("spares") or 0) if c.get("on_failure") == "spare" else 0)
