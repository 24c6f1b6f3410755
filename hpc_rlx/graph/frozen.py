"""Frozen parameters: `model.freeze=[globs]` (these do not train) or `model.train_only=[globs]`
(only these train), by the names users know the parameters by (`param_names.py`: an imported
model's PyTorch names, otherwise the graph's own). Pure: no arrays, no MPI.

A frozen parameter is the third kind beside a trainable one and a buffer (`params.py`): the
forward uses it as it is; it gets no gradient, no optimizer state and no place in the bucket,
and is never changed. A buffer is never frozen: batch-norm running statistics keep updating in
training, as in PyTorch, where ``requires_grad=False`` does not stop them (only ``eval()`` does).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph.lora import adapter_ir_names
from hpc_rlx.graph.param_names import names_by_meta, unmatched_glob, user_names

__all__ = ["check_freeze_keys", "frozen_by", "with_frozen", "freeze_params", "frozen_user_names", "describe"]


def _listed(names, limit: int = 6) -> str:
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_freeze_keys(freeze, train_only) -> None:
    """The two keys' types, and not both at once (ConfigError naming the keys)."""
    for key, globs in (("model.freeze", freeze), ("model.train_only", train_only)):
        if not isinstance(globs, (list, tuple)) or not all(isinstance(g, str) and g for g in globs):
            raise ConfigError(f"{key} must be a list of parameter-name globs, got {globs!r}")
    if freeze and train_only:
        raise ConfigError(f"model.freeze={list(freeze)} and model.train_only={list(train_only)} are both set: "
                          f"set one (model.train_only freezes every parameter its globs do not match)")


def frozen_by(graph, freeze=(), train_only=()) -> list[str]:
    """The IR names of the parameters the keys freeze (with those the graph marks frozen
    already, unless `train_only` names them), in the graph's order. A glob that matches no
    trainable parameter, or a setting that leaves none to train: one ConfigError naming names."""
    check_freeze_keys(freeze, train_only)
    names = user_names(graph)
    candidates = [p for p in graph.params if p.trainable]
    known = [names[p.name] for p in candidates]
    for key, globs in (("model.freeze", freeze), ("model.train_only", train_only)):
        for glob in globs:
            if not any(fnmatchcase(n, glob) for n in known):
                raise unmatched_glob(key, glob, known)

    def frozen(p) -> bool:
        name = names[p.name]
        if train_only:
            return not any(fnmatchcase(name, g) for g in train_only)
        return p.frozen or any(fnmatchcase(name, g) for g in freeze)
    out = [p.name for p in candidates if frozen(p)]
    if candidates and len(out) == len(candidates):
        key = f"model.freeze={list(freeze)}" if freeze else "the graph"
        raise ConfigError(f"{key} freezes every trainable parameter ({_listed([names[n] for n in out])}), which "
                          f"leaves nothing to train; leave at least one out of its globs, or name the ones "
                          f"that train with model.train_only=[globs]")
    return out


def with_frozen(graph, frozen) -> object:
    """The graph (a new one, of the same class) with exactly the parameters in `frozen` (IR
    names) marked frozen; the graph itself when that changes nothing."""
    frozen = set(frozen)
    if all(p.frozen == (p.name in frozen) for p in graph.params):
        return graph
    d = graph.to_dict()
    for p in d["params"]:
        p.pop("frozen", None)
        if p["name"] in frozen:
            p["frozen"] = True
    return type(graph).from_dict(d)


def freeze_params(graph, freeze=(), train_only=()):
    """Rank 0, once: the graph with the parameters `model.freeze` / `model.train_only` select
    marked frozen (unchanged when both are empty)."""
    check_freeze_keys(freeze, train_only)
    adapters = set(adapter_ir_names(graph.meta))
    if adapters:
        return with_frozen(graph, _lora_frozen(graph, freeze, train_only, adapters))
    if not freeze and not train_only and not any(p.frozen for p in graph.params):
        return graph
    return with_frozen(graph, frozen_by(graph, freeze, train_only))


def _lora_frozen(graph, freeze, train_only, adapters: set) -> list[str]:
    """Under LoRA every base parameter is frozen but those `model.train_only` names (PEFT's
    `modules_to_save`); the adapters train."""
    if freeze:
        raise ConfigError(f"model.freeze={list(freeze)} with model.lora.rank > 0: LoRA freezes every base "
                          f"parameter already; name the base parameters that train beside the adapters "
                          f"with model.train_only=[globs]")
    names = user_names(graph)
    base = [p for p in graph.params if p.trainable and p.name not in adapters]
    for glob in train_only:
        if not any(fnmatchcase(names[p.name], glob) for p in base):
            raise unmatched_glob("model.train_only", glob, [names[p.name] for p in base])
    return [p.name for p in base if not any(fnmatchcase(names[p.name], g) for g in train_only)]


def frozen_user_names(graph_dict: dict) -> list[str]:
    """The frozen parameters' user-facing names, from a graph's JSON form (a TrainSpec's, or a
    stage's), in order; [] without any."""
    ir = [p["name"] for p in graph_dict.get("params", ()) if p.get("frozen")]
    return names_by_meta(graph_dict.get("meta") or {}, ir) if ir else []


def describe(layout, graph) -> str | None:
    """The start-up line of a model with frozen parameters (None without)."""
    if not layout.frozen_names:
        return None
    names, tensors = user_names(graph), len(layout.frozen_names) + len(layout.trainable_names)
    frozen = layout.size - layout.grad_size
    return (f"frozen parameters: {len(layout.frozen_names)} of {tensors} parameter tensors frozen "
            f"({frozen:,} values: no gradient, no optimizer state, not in the bucket), "
            f"{layout.trainable_size:,} values train; the bucket's payload is {layout.grad_size:,} values "
            f"instead of {layout.size:,}; frozen: {_listed([names[n] for n in layout.frozen_names])}")
