"""Which model a run directory holds, and the refusal when a run brings another one.

A checkpoint records its model graph's fingerprint (`h5file.check_compatible`); a run
directory without checkpoints (checkpoint=off) has its `graph.json`, which describes the
`model.h5`, `config.yaml` and `metrics.jsonl` beside it. A run with another graph would
replace the first model's files and mix two models' epochs in one metrics file: both cases
are refused with the same message.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.base.errors import CheckpointError, GraphError
from hpc_rlx.graph.ir import Graph

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
