"""Which model a run directory holds, and the refusal when a run brings another one.

A checkpoint records its model graph's fingerprint (`h5file.check_compatible`); a run
directory without checkpoints (checkpoint=off) has its `graph.json`, which describes the
`model.h5`, `config.yaml` and `metrics.jsonl` beside it. A run with another graph would
replace the first model's files and mix two models' epochs in one metrics file: both cases
are refused with the same message.

A checkpoint of a run with frozen parameters (`model.freeze`, `model.train_only`) records
them (`frozen_record`); a resume that freezes another set is refused naming the difference,
before the graph fingerprints (which count the frozen marks) are compared.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.base.errors import CheckpointError, GraphError
from hpc_rlx.graph.frozen import frozen_user_names
from hpc_rlx.graph.ir import Graph
from hpc_rlx.graph.lora import adapters_of

NEW_DIR_HINT = "train the new model in a new run directory (hydra.run.dir=...)"


def different_graph(where: str, recorded: str, have: str, current: str, again: str) -> CheckpointError:
    """`<where> was written for a different model graph (...)`: the one message of both cases."""
    return CheckpointError(
        f"{where} was written for a different model graph ({recorded} graph {have}, current graph "
        f"{current}); {again} with the model config it was trained with, or {NEW_DIR_HINT}")


def check_run_dir_graph(run_dir, fingerprint: str) -> None:
    """Rank 0, before the run writes its outputs: refuse a run directory whose graph.json is
    another model's. No graph.json (a new directory, or a run that failed before training):
    nothing to match."""
    path = Path(run_dir) / names.GRAPH
    if not path.is_file():
        return
    try:
        have = Graph.from_dict(json.loads(path.read_text())).fingerprint()
    except (OSError, ValueError, TypeError, KeyError, AttributeError, GraphError) as e:
        # unreadable: it cannot be told apart from another model, and model.h5 is at stake
        raise CheckpointError(f"run directory {run_dir} holds a {names.GRAPH} that cannot be read "
                              f"({type(e).__name__}: {e}), so this run cannot tell whether it trains "
                              f"the same model; {NEW_DIR_HINT}") from None
    if have != fingerprint:
        raise different_graph(f"run directory {run_dir}", names.GRAPH, have, fingerprint, "run")


def frozen_record(graph_dict: dict) -> dict:
    """The checkpoint meta's entry of the frozen parameters, by their user-facing names; {}
    without any, so a run without them writes the meta it always wrote."""
    frozen = frozen_user_names(graph_dict)
    lora = adapters_of(graph_dict.get("meta"))
    adapters = {"lora": {"rank": lora["rank"], "alpha": lora["alpha"],
                         "adapted": [r["name"] for r in lora["adapters"]]}} if lora else {}
    return {"frozen": frozen, **adapters} if frozen else adapters


def _lora_line(lora) -> str:
    if not lora:
        return "none"
    return f"rank {lora['rank']}, alpha {lora['alpha']} on {_names(list(lora['adapted']))}"


def _names(names) -> str:
    return ", ".join(names[:8]) + (f", and {len(names) - 8} more" if len(names) > 8 else "") if names else "none"


def check_frozen(where: str, meta: dict, record: dict) -> None:
    """Refuse a checkpoint whose frozen parameters are not this run's (`record`: `frozen_record`
    of this run's graph): the optimizer state, the bucket and what is trained would differ."""
    if (meta.get("lora") or None) != (record.get("lora") or None):
        raise CheckpointError(
            f"checkpoint {where} was trained with other LoRA adapters (model.lora.*): the checkpoint's "
            f"{_lora_line(meta.get('lora'))}; this run's {_lora_line(record.get('lora'))}. Resume with the "
            f"model.lora keys it was trained with, or start a new run directory (model.init_from=<its run "
            f"directory>/model.h5 takes its weights, adapters included)")
    had, now = list(meta.get("frozen") or []), list(record.get("frozen") or [])
    if set(had) == set(now):
        return
    only_then, only_now = [n for n in had if n not in now], [n for n in now if n not in had]
    raise CheckpointError(
        f"checkpoint {where} was trained with {len(had)} frozen parameter(s), this run freezes {len(now)} "
        f"(model.freeze / model.train_only): frozen only in the checkpoint: {_names(only_then)}; frozen only "
        f"in this run: {_names(only_now)}. Resume with the setting it was trained with, or start a fine-tune "
        f"from its weights in a new run directory with model.init_from=<its run directory>/model.h5")
