"""The names users know a model's parameters by: an imported ONNX model's PyTorch state-dict
keys (recorded by the import in the graph's ``meta.onnx``), otherwise the graph's own names (a
builder's or a graph file's, as `model.h5` stores them). What `optim.no_decay` and
`optim.lr_mult`, `model.freeze` and `model.train_only` select by, and what `export
--state-dict` writes."""

from __future__ import annotations

import difflib
from typing import Sequence

from hpc_rlx.base.errors import ConfigError

__all__ = ["LORA_META", "pytorch_name", "user_names", "names_by_meta", "trainable_user_names", "unmatched_glob"]


LORA_META = "lora"      # a graph meta's LoRA record (graph/lora.py): the adapters' names among it


def pytorch_name(meta: dict, ir_name: str) -> str | None:
    """The PyTorch state-dict key of IR parameter `ir_name` from an import's ``meta.onnx``
    (None: the import recorded no source for it). A transposed copy the importer recognised is
    trained under its PyTorch name; the others under their initializer's."""
    source = (meta.get("params") or {}).get(ir_name)
    if source is None:
        return None
    return (meta.get("torch_names") or {}).get(ir_name) or \
        (ir_name if ir_name in (meta.get("transposed") or {}) else source)


def names_by_meta(meta, ir_names) -> list[str]:
    """The user-facing names of `ir_names`, from a graph's ``meta`` dict (its ``onnx`` entry;
    LoRA adapters by the names its ``lora`` entry gives them)."""
    meta = meta if isinstance(meta, dict) else {}
    adapters = (meta.get(LORA_META) or {}).get("names") or {}
    onnx = meta.get("onnx")
    if not isinstance(onnx, dict) or not isinstance(onnx.get("params"), dict):
        return [adapters.get(n, n) for n in ir_names]
    return [adapters.get(n) or pytorch_name(onnx, n) or n for n in ir_names]


def user_names(graph) -> dict[str, str]:
    """IR parameter name -> the name a user selects it by."""
    ir = [p.name for p in graph.params]
    return dict(zip(ir, names_by_meta(graph.meta, ir)))


def trainable_user_names(graph) -> list[str]:
    """The trained parameters' user-facing names (neither buffers nor frozen), in the graph's order."""
    names = user_names(graph)
    return [names[p.name] for p in graph.params if p.trainable and not p.frozen]


def unmatched_glob(key: str, glob: str, names: Sequence[str]) -> ConfigError:
    """`<key>: <glob> matches no trainable parameter`, naming the closest of ``names``."""
    close = difflib.get_close_matches(glob, list(names), n=3, cutoff=0.3) or list(names)[:3]
    return ConfigError(f"{key}: {glob!r} matches no trainable parameter; the closest names: "
                       f"{', '.join(repr(n) for n in close)} ({len(names)} in all)")
