"""Reading an ONNX file for the importer: the model itself, its opset, which exporter wrote
it, and what each initializer becomes.

Initializers become (by ``plan_initializers``):

- ``param``: a float initializer of at least one dimension: a trainable IR parameter under
  its (sanitised) name;
- ``buffer``: the running mean and variance a BatchNormalization reads: a non-trainable IR
  parameter that training updates;
- ``const``: integer and boolean initializers, float scalars, buffers of the PyTorch module
  that are not batch-norm statistics, values the exporter's optimizer computed from
  constants only, and float initializers read only as an op's settings (Resize's roi and
  scales, the dynamo exporter's ``F.interpolate`` scales): folded into the graph;
- ``transposed``: a 2-D initializer the dynamo exporter's optimizer computed as the transpose
  of one PyTorch weight (value_info metadata ``pkg.onnxscript.optimizer.folded_from``) and
  that feeds MatMul's B input: the parameter keeps the PyTorch name and layout, and the
  initializer is read as its transpose. The TorchScript exporter's constant folding does the
  same without saying so; an initializer equal to the transpose of another (a tied output
  head) is tied to it the same way.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field

import numpy as np

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.onnx.scopes import module_of

MIN_OPSET = 13
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
FX_NODE = "pkg.torch.onnx.fx_node"
REWRITE_RULE = "pkg.onnxscript.rewriter.rule_name"
_INTERMEDIATE = re.compile(r"^(val_\d+|_?[a-z_]+(_\d+)?)$")
# (op, input position) pairs that are an op's settings, not data: a float initializer read only
# there is a constant, never a trainable parameter
_SETTINGS = {("Resize", 1), ("Resize", 2), ("Resize", 3), ("Pad", 1), ("Pad", 2), ("Pad", 3), ("Clip", 1),
             ("Clip", 2), ("Dropout", 1)}
_SIGNATURE_TARGET = re.compile(r"^\w+: (PARAMETER|BUFFER) target='([^']+)'( persistent=False)?", re.M)


def load_model(source):
    """The ModelProto of a path or of the file's bytes; GraphError for anything unreadable."""
    import onnx

    what = f"ONNX file {str(source)!r}" if not isinstance(source, (bytes, bytearray)) else "ONNX bytes"
    try:
        if isinstance(source, (bytes, bytearray)):
            model = onnx.load_model_from_string(bytes(source))
        else:
            model = onnx.load(str(source))
    except FileNotFoundError:
        raise GraphError(f"{what}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - protobuf and onnx raise several types for a bad file
        raise GraphError(f"{what} is not a valid ONNX model: {type(exc).__name__}: {exc}") from None
    graph = model.graph
    if not model.HasField("graph") or not graph.node or not graph.output:
        raise GraphError(f"{what} is not a valid ONNX model: it has no graph, nodes or outputs")
    return model


def opset_of(model) -> int:
    """The default-domain opset, checked against what the importer supports."""
    import onnx.defs

    newest = onnx.defs.onnx_opset_version()
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise GraphError("the ONNX model imports no default-domain opset")
    opset = max(versions)
    if not MIN_OPSET <= opset <= newest:
        raise GraphError(f"the ONNX model uses opset {opset}; hpc_rlx imports opsets {MIN_OPSET} to {newest} "
                         f"(re-export with opset_version between them)")
    return opset


def exporter_of(model) -> str:
    """'dynamo' (torch.onnx.export(dynamo=True)), 'torchscript' (dynamo=False) or 'other'."""
    if any(p.key.startswith("pkg.torch") for p in list(model.metadata_props) + list(
            getattr(model.graph, "metadata_props", []))):
        return "dynamo"
    if any(p.key.startswith("pkg.torch") for n in model.graph.node for p in n.metadata_props):
        return "dynamo"
    if model.producer_name == "pytorch":
        return "torchscript"
    return "other"


def node_meta(node, key: str) -> str | None:
    return next((p.value for p in node.metadata_props if p.key == key), None)


def fx_batch_norm(node):
    """(training, momentum, eps) from the dynamo exporter's record of the PyTorch batch-norm
    call behind ``node``, or None. ``_native_batch_norm_legit_functional(x, w, b, mean, var,
    training, momentum, eps)`` and ``_native_batch_norm_legit_no_training(x, w, b, mean, var,
    momentum, eps)``."""
    text = node_meta(node, FX_NODE) or ""
    m = re.search(r"target=torch\.ops\.aten\.(\w*batch_norm\w*)\.\w+\]\(args = \((.*)\), kwargs", text)
    if not m:
        return None
    args = [a.strip() for a in m.group(2).split(",")]
    if "no_training" in m.group(1) and len(args) >= 7:
        return False, float(args[5]), float(args[6])
    if len(args) >= 8 and args[5] in ("True", "False"):
        return args[5] == "True", float(args[6]), float(args[7])
    return None


@dataclass
class InitPlan:
    values: dict = field(default_factory=dict)       # initializer name -> np.ndarray
    kind: dict = field(default_factory=dict)         # initializer name -> param/buffer/const/transposed
    source: dict = field(default_factory=dict)       # transposed initializer -> the name it transposes
    torch_name: dict = field(default_factory=dict)   # initializer (or source) name -> PyTorch name
    fused: set = field(default_factory=set)          # initializers batch norm was folded into
    state_consts: set = field(default_factory=set)   # float buffers of the module's state read as constants
    slice_of: dict = field(default_factory=dict)     # initializer -> the one PyTorch parameter it is a part of
    aliases: dict = field(default_factory=dict)      # PyTorch name -> the PyTorch name of the tensor it is tied to
    removed: list = field(default_factory=list)      # PyTorch parameters the exporter's optimizer dropped


def _read_values(model) -> dict:
    from onnx import numpy_helper

    values = {}
    for t in model.graph.initializer:
        if t.data_location == 1 and not t.raw_data:  # TensorProto.EXTERNAL, not loaded
            raise GraphError(f"initializer {t.name!r} lives in an external data file that was not loaded: "
                             f"import the .onnx file by its path, next to its data file")
        try:
            values[t.name] = numpy_helper.to_array(t)
        except Exception as exc:  # noqa: BLE001 - onnx raises several types for a damaged tensor
            raise GraphError(f"initializer {t.name!r} cannot be read: {exc}") from None
    return values


def _value_meta(model) -> dict:
    return {vi.name: {p.key: p.value for p in vi.metadata_props} for vi in model.graph.value_info}


def _signature_text(model) -> str:
    props = list(model.metadata_props) + list(getattr(model.graph, "metadata_props", []))
    return next((p.value for p in props if p.key == SIGNATURE), "")


def signature_targets(model) -> set:
    """The PyTorch parameter and buffer names the dynamo exporter's graph signature lists, but
    for buffers that are not part of the state dict (persistent=False: Llama's rotary
    frequencies), which are constants of the model, not state."""
    text = _signature_text(model)
    return {m.group(2) for m in _SIGNATURE_TARGET.finditer(text) if not m.group(3)}


def _sources(meta: dict) -> list:
    try:
        found = ast.literal_eval(meta.get(FOLDED_FROM, "[]"))
    except (ValueError, SyntaxError):
        return []
    return [s for s in found if isinstance(s, str)]


def plan_initializers(model, warnings: list) -> InitPlan:
    plan = InitPlan(values=_read_values(model))
    vmeta, targets = _value_meta(model), signature_targets(model)
    uses, consumers = {}, {}
    for node in model.graph.node:
        for pos, name in enumerate(node.input):
            uses.setdefault(name, []).append((node.op_type, pos))
            consumers.setdefault(name, []).append(node)
        if "FuseBatchNorm" in (node_meta(node, REWRITE_RULE) or ""):
            plan.fused.update(i for i in node.input[1:] if i in plan.values)
    torchscript = exporter_of(model) == "torchscript"
    if torchscript:  # constant folding writes new initializers "onnx::<op>_<n>"
        plan.fused.update(n for n in plan.values if n.startswith("onnx::Conv_") and
                          all(op == "Conv" and pos > 0 for op, pos in uses.get(n, [])))
    bn_stats = {n for n, u in uses.items() if any(op == "BatchNormalization" and pos in (3, 4) for op, pos in u)}
    derived, folded_state = [], []
    for name, value in plan.values.items():
        meta = vmeta.get(name, {})
        kind = meta.get(INPUT_KIND)
        sources = _sources(meta)
        state = [s for s in sources if s in targets or (not targets and not _INTERMEDIATE.match(s))]
        if value.dtype.kind != "f" or value.ndim == 0 or (uses.get(name) and set(uses[name]) <= _SETTINGS):
            plan.kind[name] = "const"
        elif name in bn_stats:
            plan.kind[name] = "buffer"
        elif kind in ("BUFFER", "CONSTANT_TENSOR") or (sources and not state):
            plan.kind[name] = "const"
            if kind == "BUFFER" and name in targets:  # in the state dict: the export writes it back
                plan.state_consts.add(name)
        elif len(sources) == 1 and state and value.ndim == 2 and uses.get(name) and all(
                u in (("MatMul", 1),) for u in uses[name]):
            plan.kind[name], plan.source[name] = "transposed", sources[0]
            plan.torch_name[sources[0]] = sources[0]
        elif torchscript and name.startswith("onnx::MatMul_") and value.ndim == 2 and \
                _linear_weight(plan, consumers, name):
            source = _linear_weight(plan, consumers, name)
            plan.kind[name], plan.source[name], plan.torch_name[source] = "transposed", source, source
        else:
            plan.kind[name] = "param"
            if state:
                (folded_state if any("running_" in s for s in state) else derived).append((name, state))
            elif name not in plan.fused and (kind == "PARAMETER" or (
                    model.producer_name == "pytorch" and not name.startswith("onnx::"))):
                plan.torch_name[name] = name
    _tie_transposed_copies(plan, uses)
    for name, state in derived:
        if len(state) == 1:  # a slice of one parameter (pos[:, :t], rows gathered at fixed positions)
            plan.slice_of[name] = state[0]
            warnings.append(
                f"initializer {name!r} was computed from PyTorch parameter {state[0]!r} by the exporter's "
                f"optimizer (a slice such as pos[:, :t], or rows gathered at fixed positions): it trains as its "
                f"own parameter. The file keeps neither the rest of {state[0]!r} nor where the part lies: "
                f"`python -m hpc_rlx.export --state-dict OUT --base ORIGINAL.safetensors` (the module's original "
                f"weights) writes a slice back into {state[0]!r}, the rest unchanged; rows gathered out of order "
                f"or repeated cannot go back and stay under {name!r}, as without --base")
        else:
            warnings.append(f"initializer {name!r} was computed from {state} by the exporter's optimizer: it "
                            f"trains as its own parameter and cannot be written back into them, since it mixes "
                            f"several (export with optimize=False to keep PyTorch's parameters)")
    fused = sorted(plan.fused | {n for n, _ in folded_state})
    if fused and torchscript:
        warnings.append(f"TorchScript constant folding rewrote the convolution weights {fused}: batch norm after "
                        f"those convolutions (if any) was fused into them and trains as a fixed scale and shift; "
                        f"export with do_constant_folding=False (or training=TrainingMode.TRAINING) to train it")
    elif fused:
        warnings.append(f"batch norm was fused into convolution weights {fused} by the exporter's optimizer: it "
                        f"trains as a fixed scale and shift folded into them; export with optimize=False to train "
                        f"batch norm")
    _missing_state(model, plan, targets, vmeta, warnings)
    return plan


def record_folded(plan: InitPlan, meta: dict) -> None:
    """What an export needs of dynamo's folds, in the import's ``meta`` (its kept ``params`` and
    ``torch_names``): ``slices`` {IR parameter: the PyTorch parameter it is a part of},
    ``aliases`` {PyTorch name: the IR parameter it is tied to}, ``removed`` [PyTorch names]."""
    slices = {ir: plan.slice_of[init] for ir, init in meta["params"].items() if init in plan.slice_of}
    held = {torch: ir for ir, torch in meta["torch_names"].items()}
    aliases = {alias: held[name] for alias, name in plan.aliases.items() if name in held}
    for key, value in (("slices", slices), ("aliases", aliases), ("removed", list(plan.removed))):
        if value:
            meta[key] = value


def _linear_weight(plan: InitPlan, consumers: dict, name: str) -> str | None:
    """The PyTorch weight a TorchScript-folded MatMul operand transposes, named after the bias
    the product is added to ("blocks.0.fc1.bias" -> "blocks.0.fc1.weight"): an nn.Linear."""
    nodes = consumers.get(name, [])
    if len(nodes) != 1 or nodes[0].op_type != "MatMul" or list(nodes[0].input).index(name) != 1:
        return None
    for add in consumers.get(nodes[0].output[0], []):
        bias = [i for i in add.input if i != nodes[0].output[0]]
        if add.op_type == "Add" and len(bias) == 1 and bias[0].endswith(".bias") and bias[0] in plan.values \
                and plan.values[bias[0]].shape == plan.values[name].shape[1:]:
            return bias[0][: -len("bias")] + "weight"
    return None


def _digest(a: np.ndarray) -> tuple:
    return a.shape, a.dtype.str, hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def _tie_transposed_copies(plan: InitPlan, uses: dict) -> None:
    """A float matrix that only feeds MatMul's B input and equals another parameter's
    transpose is a folded copy of it (TorchScript constant folding of a tied head)."""
    params = [n for n, k in plan.kind.items() if k == "param" and plan.values[n].ndim == 2]
    by_value: dict = {}
    for name in params:
        by_value.setdefault(_digest(plan.values[name]), []).append(name)
    for name in params:
        v = plan.values[name]
        if not all(u == ("MatMul", 1) for u in uses.get(name, [("", 0)])) or np.unique(v).size < 2:
            continue
        for other in by_value.get(_digest(v.T), []):
            if other != name and plan.kind[other] == "param" and np.array_equal(plan.values[other], v.T):
                plan.kind[name], plan.source[name] = "transposed", other
                break


def _missing_state(model, plan: InitPlan, targets: set, vmeta: dict, warnings: list) -> None:
    """Dynamo's optimizer merges initializers of equal value (freshly initialised layer-norm
    weights, zero biases): the merged parameters would then train as one."""
    if exporter_of(model) != "dynamo":
        return
    folded = {src for name in plan.values for src in _sources(vmeta.get(name, {}))}
    present = set(plan.values) | set(plan.source.values()) | folded
    float_targets = {t for t in targets if not t.endswith("num_batches_tracked")}
    missing = sorted(t for t in float_targets - present if t not in plan.fused)
    plan.aliases, untold = tied_names(model, plan, missing)
    missing = [t for t in missing if t not in plan.aliases and t not in untold]
    # with batch norm fused into convolutions, the original values of its parameters do not
    # belong beside the fused weights: only then are they not written back from `export --base`
    plan.removed = [] if plan.fused else list(missing)
    uses: dict = {}
    for node in model.graph.node:
        for pos, name in enumerate(node.input):
            if plan.kind.get(name) == "param":
                uses.setdefault(name, []).append((node.op_type, pos))
    shared = sorted(n for n, u in uses.items() if len(set(u)) < len(u))
    if missing:
        # what the untying (graph/onnx/untie.py) could not give back: values no node reads any
        # more, such as zero biases whose additions the optimizer removed
        warnings.append(f"the PyTorch module's {missing} are not in the file: the exporter's optimizer removed "
                        f"them (a bias of zeros, say, whose addition it dropped), so they do not train and the "
                        f"exported state dict lacks them"
                        + ("" if plan.fused else " unless `python -m hpc_rlx.export` is given the module's "
                           "original weights (--base), which hold their values")
                        + ": export with optimize=False to keep them")
    if untold:
        warnings.append(f"the PyTorch module's parameters {untold} are not in the file and no node records reading "
                        f"them: either PyTorch ties each to another parameter (the exporter keeps one name of a "
                        f"tied tensor) or the exporter's optimizer removed them, and the file does not say which, "
                        f"so the exported state dict lacks them (export with optimize=False to keep them)")
    if shared and not targets:
        warnings.append(f"parameters {shared} feed several nodes of the same kind: they train as one shared "
                        f"parameter each. Unless the module shares them, the exporter's optimizer merged "
                        f"initializers of equal value (dynamo's optimize=True does, e.g. for freshly initialised "
                        f"layer-norm weights): export with optimize=False")


def _placeholder(target: str) -> str:
    """The exported program's input name of a PyTorch parameter ('%p_a_b_weight' for 'a.b.weight')."""
    return "%p_" + target.replace(".", "_")


def tied_names(model, plan: InitPlan, missing: list) -> tuple[dict, list]:
    """({missing PyTorch name: the PyTorch name it is tied to}, the missing names left untold).

    The exporter keeps one name of a tied tensor (BART's shared, encoder and decoder token
    embeddings): a node of module M that reads parameter P where the graph signature lists
    M.<leaf> and the file does not is M.<leaf> tied to P. A missing name no node records at
    all (BART's model.shared.weight, which no forward reads by that path) is tied to the one
    parameter found tied that way with the same leaf name, where there is exactly one."""
    by_init = {n: plan.torch_name[n] for n, k in plan.kind.items() if k == "param" and n in plan.torch_name}
    by_init.update({n: plan.torch_name[s] for n, s in plan.source.items() if s in plan.torch_name})
    wanted, aliases, recorded = set(missing), {}, ""
    for node in model.graph.node:
        recorded += node_meta(node, FX_NODE) or ""
        module = module_of(node)
        for name in node.input if module else ():
            held = by_init.get(name)
            own = f"{module}.{held.rsplit('.', 1)[-1]}" if held else None
            if own in wanted and own != held:
                aliases[own] = held
    untold, text = [], _signature_text(model)
    for name in sorted(wanted - set(aliases)):
        if re.search(re.escape(_placeholder(name)) + r"\b", recorded) or f"PARAMETER target='{name}'" not in text:
            continue  # a node used it (the optimizer removed a bias of zeros), or a buffer: not a tie
        if plan.fused:  # batch norm fused away may leave its parameters unrecorded too: no guess
            untold.append(name)
            continue
        leaf = name.rsplit(".", 1)[-1]
        groups = sorted({held for held in aliases.values() if held.rsplit(".", 1)[-1] == leaf})
        if len(groups) == 1:
            aliases[name] = groups[0]
        else:
            untold.append(name)
    return aliases, untold
