"""`data.x`: one dataset name, or a list of them for a model with several inputs
(`data.x=[input_ids, attention_mask]`): what is read, and what a list needs at start-up."""

from __future__ import annotations

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.data.model_inputs import packed_sources
from hpc_rlx.data.resolve import data_sources


def input_sources(cfg: dict):
    """Rank 0: the data's `Sources` (with several inputs, described packed: `data/model_inputs.py`)
    and [(dataset, row shape, dtype)] of the inputs (None for one). A list of one name reads as
    that name."""
    d = cfg["data"]
    if isinstance(d["x"], list) and len(d["x"]) == 1:
        d["x"] = d["x"][0]
    if not isinstance(d["x"], list):
        return data_sources(d), None
    names = list(d["x"])
    if len(set(names)) != len(names) or d["y"] in names:
        raise ConfigError(f"data.x={names}: each dataset may be named once, and not the labels (data.y={d['y']})")
    refused = [(cfg["model"]["name"] != "onnx", f"model={cfg['model']['name']} (an ONNX file takes them: model=onnx)"),
               (int(cfg["parallel"]["pipeline_stages"]) > 1,
                f"parallel.pipeline_stages={cfg['parallel']['pipeline_stages']} (only the first stage would "
                f"read them: use 1)")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"data.x={names}: several model inputs are not supported with {what}")
    return packed_sources(names, lambda name: data_sources({**d, "x": name}))
