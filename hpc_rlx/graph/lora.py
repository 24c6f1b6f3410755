"""LoRA adapters, added to a graph after import (`model.lora.*`). Pure: no arrays but the
initial values and the merge, no MPI, no files.

Each target weight W, a 2-D parameter read only as the weight of `linear` nodes (ONNX MatMul
and Gemm import as those), gets two new parameters, A of shape (r, in) and B of shape (out, r)
in PyTorch's (and PEFT's) orientation whatever W's own layout, and every node that reads W
computes PEFT's forward::

    y = linear(x, W, bias) + (alpha / r) * linear(linear(dropout(x), A), B)

A starts as PEFT's `kaiming_uniform_(a=sqrt(5))` (uniform in ±1/sqrt(in)) and B at zero, so
the model starts as it was imported. The base weights are frozen (`graph/frozen.py`): the
bucket, the optimizer and the wire carry the adapters and `model.train_only`'s parameters.

The graph's ``meta["lora"]`` records the setting and, per adapted weight, its adapters, the
name users know it by and W's layout; `merged` folds trained adapters back into W for the
exports, and the user-facing names of the adapters (`<module>.lora_A.weight`) are PEFT's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from fnmatch import fnmatchcase

import numpy as np

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph.param_names import LORA_META, unmatched_glob, user_names
from hpc_rlx.graph.params import draw_init

__all__ = ["LoraSettings", "lora_settings", "add_adapters", "adapters_of", "adapter_ir_names",
           "initial_adapters", "merged", "without_adapters", "module_name", "describe"]

_MAX_NAME = 128     # the IR's name limit (graph/ir.py)
SIDE_NODES = ("lora_dropout", "lora_a", "lora_b", "lora_scaled")     # an adapted node's side path


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    targets: tuple

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


def lora_settings(lora: dict | None) -> LoraSettings | None:
    """The `model.lora` section as settings; None when LoRA is off (rank 0). A rank without
    targets is one ConfigError."""
    lora = lora or {}
    if not lora.get("rank"):
        return None
    targets = tuple(lora.get("targets") or ())
    if not targets:
        raise ConfigError(f"model.lora.rank={lora['rank']} needs model.lora.targets=[globs] naming the "
                          f"weights to adapt, e.g. '[*query,*value]' (BERT) or '[*c_attn]' (GPT-2)")
    return LoraSettings(int(lora["rank"]), lora.get("alpha", 8), float(lora.get("dropout") or 0.0), targets)


def module_name(weight_name: str) -> str:
    """The module a weight belongs to: its name without the trailing `.weight`."""
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def _matches(name: str, glob: str) -> bool:
    return fnmatchcase(name, glob) or fnmatchcase(module_name(name), glob)


def _targets(graph, settings: LoraSettings, names: dict, uses: dict) -> list:
    """The IR names of the weights `model.lora.targets` selects, each checked to be a 2-D
    trainable weight read only by `linear` nodes (ConfigError naming the key otherwise)."""
    params = [p for p in graph.params if p.trainable and not p.frozen]
    known = [names[p.name] for p in params]
    for glob in settings.targets:
        hits = [p for p in params if _matches(names[p.name], glob)]
        if not hits:
            raise unmatched_glob("model.lora.targets", glob, [module_name(n) for n in known])
        if all(len(p.shape) < 2 for p in hits):
            raise ConfigError(f"model.lora.targets: {glob!r} matches only 1-D parameters ({names[hits[0].name]!r}"
                              f"{', ...' if len(hits) > 1 else ''}); LoRA adapts 2-D weights read by MatMul/Gemm")
    # a glob's 1-D matches (the module's bias, a norm's weight) are not weights to adapt
    chosen = [p for p in params if len(p.shape) >= 2 and any(_matches(names[p.name], g) for g in settings.targets)]
    for p in chosen:
        others = [(op, node) for op, node, pos in uses.get(p.name, ()) if (op, pos) != ("linear", 1)]
        if len(p.shape) > 2 or others or not uses.get(p.name):
            why = (f"has shape {tuple(p.shape)}" if len(p.shape) != 2 else
                   f"is read by the {others[0][0]} node {others[0][1]!r}" if others else "is read by no node")
            raise ConfigError(f"model.lora.targets={list(settings.targets)}: {names[p.name]!r} {why}; LoRA adapts "
                              f"2-D weights read only by MatMul/Gemm: narrow the globs (e.g. '*query' for "
                              f"'*.query.weight')")
        if settings.rank > min(p.shape):
            raise ConfigError(f"model.lora.rank={settings.rank} is above the smaller dimension of "
                              f"{names[p.name]!r} ({p.shape[0]} x {p.shape[1]}): choose a rank of at most "
                              f"{min(p.shape)}")
    return [p.name for p in chosen]


def _named(base: str, suffix: str) -> str:
    """`base.suffix`, within the IR's name limit: a very long name is cut and made unique again
    by a digest of the whole."""
    name = f"{base}.{suffix}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    return f"{base[:_MAX_NAME - len(suffix) - 10]}.{digest}.{suffix}"


def _adapter_names(weight: str) -> tuple[str, str]:
    return _named(weight, "lora_A"), _named(weight, "lora_B")


def _rewrite(node: dict, a: str, b: str, settings: LoraSettings, shapes: dict) -> list:
    """The nodes that replace one `linear` node reading an adapted weight: its output keeps the
    node's name, so every consumer reads the sum."""
    name, x = node["name"], node["inputs"][0]
    x_shape, out_shape = shapes[x], node["shape"]
    part = {p: _named(name, p) for p in SIDE_NODES + ("lora_base",)}
    base = dict(node, name=part["lora_base"])
    side, nodes = x, [base]
    if settings.dropout:
        side = part["lora_dropout"]
        nodes.append({"name": side, "op": "dropout", "inputs": [x], "attrs": {"p": settings.dropout},
                      "shape": x_shape, "dtype": node["dtype"]})
    low = list(x_shape[:-1]) + [settings.rank]
    nodes += [
        {"name": part["lora_a"], "op": "linear", "inputs": [side, a], "attrs": {"weight_layout": "out_in"},
         "shape": low, "dtype": node["dtype"]},
        {"name": part["lora_b"], "op": "linear", "inputs": [part["lora_a"], b],
         "attrs": {"weight_layout": "out_in"}, "shape": out_shape, "dtype": node["dtype"]},
        {"name": part["lora_scaled"], "op": "scale", "inputs": [part["lora_b"]],
         "attrs": {"value": settings.scale}, "shape": out_shape, "dtype": node["dtype"]},
        {"name": name, "op": "add", "inputs": [base["name"], part["lora_scaled"]], "attrs": {},
         "shape": out_shape, "dtype": node["dtype"]},
    ]
    return nodes


def add_adapters(graph, settings: LoraSettings | None):
    """Rank 0, once: the graph with adapters on the weights `settings.targets` selects (the
    graph itself when LoRA is off)."""
    if settings is None:
        return graph
    if graph.meta.get(LORA_META):
        raise ConfigError("model.lora: the model already has LoRA adapters")
    names = user_names(graph)
    d = graph.to_dict()
    uses: dict[str, list] = {}
    for n in d["nodes"]:
        for pos, arg in enumerate(n["inputs"]):
            uses.setdefault(arg, []).append((n["op"], n["name"], pos))
    targets = _targets(graph, settings, names, uses)
    shapes = {i["name"]: i["shape"] for i in d["inputs"]} | {n["name"]: n["shape"] for n in d["nodes"]}
    shapes |= {p["name"]: p["shape"] for p in d["params"]}
    nodes, records, user = [], [], {}
    adapter_of = {w: _adapter_names(w) for w in targets}
    layouts: dict[str, str] = {}
    rewritten: dict[str, list] = {}
    for n in d["nodes"]:
        if n["op"] == "linear" and n["inputs"][1] in adapter_of:
            layouts.setdefault(n["inputs"][1], n["attrs"].get("weight_layout", "in_out"))
            rewritten.setdefault(n["inputs"][1], []).append(n["name"])
            nodes += _rewrite(n, *adapter_of[n["inputs"][1]], settings, shapes)
        else:
            nodes.append(n)
    for w in targets:
        a, b = adapter_of[w]
        rows, cols = shapes[w]
        n_in, n_out = (rows, cols) if layouts[w] == "in_out" else (cols, rows)
        d["params"] += [{"name": a, "shape": [settings.rank, n_in], "dtype": "float",
                         "init": {"scheme": "fan_in_uniform", "fan_in": n_in}},
                        {"name": b, "shape": [n_out, settings.rank], "dtype": "float", "init": {"scheme": "zeros"}}]
        module = module_name(names[w])
        user |= {a: f"{module}.lora_A.weight", b: f"{module}.lora_B.weight"}
        # in_out: W is stored (in, out), as GPT-2's Conv1D is (PEFT's fan_in_fan_out)
        records.append({"weight": w, "name": names[w], "a": a, "b": b, "layout": layouts[w], "nodes": rewritten[w]})
    d["nodes"] = nodes
    d["meta"] = dict(d.get("meta") or {}, **{LORA_META: {
        "rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout,
        "targets": list(settings.targets), "adapters": records, "names": user}})
    return type(graph).from_dict(d)


def adapters_of(meta: dict | None) -> dict | None:
    """A graph meta's LoRA record (`add_adapters`), or None without adapters; a pipeline
    stage's is in the meta of the graph it was cut from (``meta["source"]``)."""
    meta = meta or {}
    record = ((meta.get("source") or {}) if "stage" in meta else meta).get(LORA_META)
    return record if isinstance(record, dict) and record.get("adapters") else None


def adapter_ir_names(meta: dict | None) -> list[str]:
    """The adapters' IR names, A then B per adapted weight; [] without LoRA."""
    record = adapters_of(meta)
    return [n for r in record["adapters"] for n in (r["a"], r["b"])] if record else []


def initial_adapters(graph, seed: int) -> dict:
    """The adapters' initial values (float64, by IR name), drawn as `init_params` draws them
    from `train.seed`: a run that starts from an ONNX file's weights gets these."""
    wanted = set(adapter_ir_names(graph.meta)) & {p.name for p in graph.params}     # a stage holds some
    streams = graph.param_seeds or range(len(graph.params))
    return {p.name: draw_init(p.init, tuple(p.shape), np.random.default_rng([int(seed), i]))
            for i, p in zip(streams, graph.params) if p.name in wanted}


def merged(meta: dict | None, values: dict) -> dict:
    """The parameters with each adapted weight W replaced by W + (alpha/r)·B·A in W's own
    layout, and the adapters left out: what the exports write (`values` itself without LoRA)."""
    record = adapters_of(meta)
    if record is None:
        return values
    scale = float(record["alpha"]) / int(record["rank"])
    adapters = set(adapter_ir_names(meta))
    out = {k: v for k, v in values.items() if k not in adapters}
    for r in record["adapters"]:
        w = np.asarray(values[r["weight"]])
        delta = scale * (np.asarray(values[r["b"]], np.float64) @ np.asarray(values[r["a"]], np.float64))
        out[r["weight"]] = (w + (delta.T if r["layout"] == "in_out" else delta)).astype(w.dtype)
    return out


def without_adapters(graph):
    """The graph as it was before `add_adapters`: the adapters, their nodes and the record
    removed (what an export of merged weights writes from; the graph itself without LoRA)."""
    record = adapters_of(graph.meta)
    if record is None:
        return graph
    d = graph.to_dict()
    drop = set(adapter_ir_names(graph.meta))
    rewritten = {n for r in record["adapters"] for n in r["nodes"]}
    side = {_named(n, part) for n in rewritten for part in SIDE_NODES}
    # the merged weights train again as a whole model would: no frozen marks
    d["params"] = [{k: v for k, v in p.items() if k != "frozen"} for p in d["params"] if p["name"] not in drop]
    base_of = {_named(n, "lora_base"): n for n in rewritten}
    d["nodes"] = [dict(n, name=base_of[n["name"]]) if n["name"] in base_of else n
                  for n in d["nodes"] if n["name"] not in side and n["name"] not in rewritten]
    d["meta"] = {k: v for k, v in d["meta"].items() if k != LORA_META}
    return type(graph).from_dict(d)


def describe(graph) -> str | None:
    """The start-up line of a model with LoRA adapters (None without)."""
    record = adapters_of(graph.meta)
    if record is None:
        return None
    sizes = {p.name: int(np.prod(p.shape)) for p in graph.params}
    adapted = [r["name"] for r in record["adapters"]]
    values = sum(sizes.get(n, 0) for n in adapter_ir_names(graph.meta))     # a pipeline stage holds some
    shown = ", ".join(adapted[:4]) + (f", and {len(adapted) - 4} more" if len(adapted) > 4 else "")
    return (f"LoRA: rank {record['rank']}, alpha {record['alpha']} (scale {float(record['alpha']) / record['rank']:g}), "
            f"dropout {record['dropout']:g}: adapters on {len(adapted)} weight(s) ({shown}), "
            f"{values:,} adapter values")
