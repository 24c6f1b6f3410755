"""What sharded state and node-shared parameters run with (`comm.shard`,
`comm.node_shared_params`): checked on rank 0 while the spec is built, one line each."""

from __future__ import annotations

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.comm.registry import AUTO, sharded_refusal
from hpc_rlx.policies.registry import POLICIES


def check_node_shared_params(cfg: dict) -> None:
    """``comm.node_shared_params=true``: one copy per node holds only where every rank of a
    node has the same parameters after each step and steps a slice of them in place."""
    c = cfg["comm"]
    if not c.get("node_shared_params"):
        return
    policy, stages = cfg["policy"]["name"], int(cfg["parallel"]["pipeline_stages"])
    refusal = (
        f"policy={policy}: its ranks hold different parameters between syncs; use policy=sync"
        if not POLICIES[policy].shards_optimizer_state else
        "comm.shard=none: each rank would step all of the node's one copy; set comm.shard=optimizer"
        if c.get("shard", "none") != "optimizer" else
        f"device={cfg['device']['kind']}: GPU lanes keep their own copy; use device=cpu"
        if cfg["device"]["kind"] != "cpu" else
        f"parallel.pipeline_stages={stages}: not with pipeline stages" if stages > 1 else
        next((f"comm.{key}={c[key]}: the node's shared-memory path does not serve it"
              for key in ("deterministic", "wire_dtype", "overlap") if c.get(key)), None) or
        (f"comm.reduction={c['reduction']}: a named path gathers the parameters its own way, not into "
         f"the node's one copy" if c.get("reduction", AUTO) != AUTO and sharded_refusal(c["reduction"]) is None
         else None))
    if refusal is not None:
        raise ConfigError(f"comm.node_shared_params=true does not run with {refusal}")


def check_shard(cfg: dict) -> None:
    """``comm.shard=optimizer``: what the sharded step supports so far."""
    check_node_shared_params(cfg)
    c = cfg["comm"]
    if c.get("shard", "none") == "none":
        return
    policy = cfg["policy"]["name"]
    refusal = None if POLICIES[policy].shards_optimizer_state else (
        f"policy={policy}: its ranks hold different parameters between syncs (local steps), so "
        f"each needs its whole optimizer state; use policy=sync")
    if refusal is None and c.get("overlap"):
        refusal = "comm.overlap=true: not yet; the reduce-scatter runs after backward"
    if refusal is None:
        refusal = sharded_refusal(c.get("reduction", AUTO))
    if refusal is not None:
        raise ConfigError(f"comm.shard=optimizer does not run with {refusal}")
