"""`model.sync_batch_norm`: what it runs with, and its start-up line (the sums themselves:
`graph/ops/norm.py` and `runtime/batch_sync.py`)."""

from __future__ import annotations

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.policies.registry import POLICIES


def check_sync_batch_norm(cfg: dict, world_size: int) -> bool:
    """Whether the run normalises with the global batch's statistics; a combination it cannot
    run with is one ConfigError. A batch-norm layer's sums are collectives inside the forward
    and the backward, so every rank must run each step's micro-batches in step with the others
    (GPU lanes: not built; the other device layers: their own lanes). Under comm.on_failure=shrink
    or spare, `resilience.mode.check_on_failure` refuses it (a rank lost inside such a sum)."""
    if not cfg["model"].get("sync_batch_norm"):
        return False
    why = None
    if int(cfg["parallel"]["pipeline_stages"]) > 1:
        why = "with parallel.pipeline_stages > 1 (a stage's lanes and replicas do not share its sums)"
    elif world_size > 1 and not POLICIES[cfg["policy"]["name"]].steps_are_batches:
        why = (f"with policy={cfg['policy']['name']} on {world_size} ranks: its ranks take different "
               f"numbers of steps, and a batch-norm sum waits for every rank (use policy=sync)")
    elif cfg["device"]["kind"] in ("cuda", "all"):
        why = f"on GPU lanes yet (device={cfg['device']['kind']}; use device=cpu)"
    if why:
        raise ConfigError(f"model.sync_batch_norm=true does not run {why}")
    return True


def batch_norm_channels(graph) -> list[int]:
    """The channels of each batch-norm layer that trains with batch statistics, in graph order."""
    return [int(graph.types[n.inputs[1]].shape[0]) for n in graph.nodes
            if n.op == "batch_norm" and graph.norm_attrs[n.name].get("training", True)]


def describe(graph, world_size: int, lanes: int) -> str:
    """The start-up line: sync batch norm is on, and what it costs per micro-batch."""
    channels = batch_norm_channels(graph)
    if not channels:
        return "model.sync_batch_norm: the model has no batch-norm layer that trains: nothing to sum"
    values = sum(2 * c + 1 for c in channels) + sum(2 * c for c in channels)
    where = f"{lanes} lane(s) x {world_size} rank(s)"
    return (f"model.sync_batch_norm: {len(channels)} batch-norm layer(s) normalise with the statistics of "
            f"the global batch ({where}): per micro-batch, one Allreduce per layer in the forward and, "
            f"where its input needs a gradient, one in the backward; at most {values} float64 values "
            f"({values * 8} bytes) in all, each a wait for every lane and rank")
