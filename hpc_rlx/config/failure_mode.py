"""What a job may run with when a dead rank must not end it (`comm.on_failure`, `comm.spares`):
checked on rank 0 while the spec is built, one line each. Pure: whether MPI's fault tolerance
(ULFM) is active is asked of every rank at start-up (`resilience/in_run.py`).

`abort` (the default) runs with everything. `shrink` and `spare` run, so far, where the survivors can
rebuild all they hold from the state every rank has and the survivors' communicator: CPU
lanes (any data distribution and cache, the bucket summed by any path but the sharded one,
overlapped or not) under `policy=sync`, and under `cadence` and `async` (whole outer syncs;
with `spare`, where no rank keeps state of its own from one sync to the next). The rest is
refused until it is rebuilt too.
"""

from __future__ import annotations

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.policies.fragments import Streaming
from hpc_rlx.policies.registry import POLICIES

ON_FAILURE = ("abort", "shrink", "spare")


def shrink_refusal(cfg: dict, mode: str = "shrink") -> str | None:
    """Why `comm.on_failure=<mode>` (shrink or spare) cannot run with `cfg` yet, in words, or
    None (pure)."""
    c = cfg["comm"]
    policy = cfg["policy"]
    stages = int(cfg["parallel"]["pipeline_stages"])
    device = cfg["device"]["kind"]
    windowed = not POLICIES[policy["name"]].steps_are_batches
    if windowed and mode == "spare" and policy.get("reset_inner") is not True:
        return (f"policy={policy['name']} without policy.reset_inner=true: a rank's inner optimizer state is "
                f"its own (local steps), and a spare cannot hold the dead rank's; set policy.reset_inner=true "
                f"(none is kept from one sync to the next), or use comm.on_failure=shrink")
    if windowed and mode == "spare" and policy.get("outer_wire_dtype") not in (None, "null", "none"):
        return (f"policy.outer_wire_dtype={policy['outer_wire_dtype']}: the coded outer wire's residuals are "
                f"a rank's own, and a spare cannot hold the dead rank's; use policy.outer_wire_dtype=null, "
                f"or comm.on_failure=shrink")
    if windowed and _streams(policy):
        return ("policy.fragments / policy.fragment_delay (streaming outer syncs): the fragments in "
                "flight are not dropped over the survivors; use policy.fragments=1 "
                "policy.fragment_delay=0")
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


def _streams(policy: dict) -> bool:
    """Whether a windowed policy's outer syncs stream (`policy.fragments`, `policy.fragment_delay`)."""
    try:
        return Streaming(int(policy.get("fragments") or 1), int(policy.get("fragment_delay") or 0)).active
    except (TypeError, ValueError):
        return False        # a bad value: the policy's own check names it


def check_on_failure(cfg: dict, world_size: int | None = None) -> None:
    """Refuse what `comm.on_failure` and `comm.spares` cannot run with (one line each);
    `world_size`: the job's ranks, spares included (None: not checked against it)."""
    c = cfg["comm"]
    mode, spares = on_failure_of(c), int(c.get("spares") or 0)
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
        why = shrink_refusal(cfg, mode)
        if why is not None:
            raise ConfigError(f"comm.on_failure={mode} does not run with {why}")


def on_failure_of(c) -> str:
    """`comm.on_failure` of the comm section `c` (a config's dict or a spec's section): the one
    reader of the key; what it means is `resilience/mode.py`'s."""
    return c.get("on_failure", "abort")


def training_ranks(c, world_size: int) -> int:
    """The ranks that train: the job's, less `comm.spares` under `comm.on_failure=spare`
    (`c`: the comm section)."""
    return world_size - (int(c.get("spares") or 0) if on_failure_of(c) == "spare" else 0)
