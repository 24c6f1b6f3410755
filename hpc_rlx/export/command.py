"""`python -m hpc_rlx.export RUN_DIR [--onnx OUT.onnx] [--state-dict OUT.safetensors]
[--adapters DIR] [--checkpoint latest|best|PATH]`: a run's trained model as an inference ONNX
file and/or a safetensors state dict (a LoRA run's merged), and a LoRA run's adapters in PEFT's
layout. `python -m hpc_rlx.export --check MODEL.onnx [--freeze GLOB ...]
[--train-only GLOB ...]`: whether a file imports for training, and what trains, before a job
is submitted. Errors go to stderr with exit status 2."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import numpy as np

from hpc_rlx.base.errors import HpcRlxError
from hpc_rlx.export.adapters import export_adapters, merge_adapters
from hpc_rlx.export.ir_to_onnx import ir_to_onnx, needed_by
from hpc_rlx.export.onnx_source import is_imported, original_onnx, original_state_dict
from hpc_rlx.export.onnx_writer import optional_onnx, require_onnx, save_model
from hpc_rlx.export.safetensors_file import read_float_tensors, write_safetensors
from hpc_rlx.export.trained import ExportError, TrainedModel, load_trained, model_output
from hpc_rlx.export.verify import check_with_runtime
from hpc_rlx.graph.frozen import freeze_params
from hpc_rlx.graph.lora import add_adapters, describe as describe_adapters, lora_settings
from hpc_rlx.graph.onnx.importer import import_onnx
from hpc_rlx.graph.param_names import user_names

PROG = "python -m hpc_rlx.export"
EXIT_ERROR = 2


def export_onnx(trained: TrainedModel, path, output: str | None = None, check: bool = True) -> str:
    """Write the inference ONNX file (after ONNX Runtime agreed with hpc_rlx's forward on a random
    batch, when it is installed and ``check``); returns a line saying what was written."""
    onnx = require_onnx()
    input_names = {}
    if is_imported(trained.graph) and output is None:
        model, out_name = original_onnx(onnx, trained)
        meta = trained.graph.meta["onnx"]
        node = meta.get("output_node") or out_name
        input_names = {"x": meta.get("input") or "x"}
    else:
        node = out_name = model_output(trained.graph, output)
        model = ir_to_onnx(onnx, trained, out_name)
    what = f"ONNX opset {max(o.version for o in model.opset_import if o.domain in ('', 'ai.onnx'))}, " \
           f"output {out_name!r}"
    if check and node not in trained.graph.types:
        what += ", not checked (the graph names no node for the output)"
    elif check:
        diff = check_with_runtime(model, trained, node, input_names, needed_by(trained.graph, node))
        what += (", not checked (onnxruntime is not installed)" if diff is None
                 else f", checked in ONNX Runtime against hpc_rlx (max relative difference {diff:.1e})")
    save_model(onnx, model, path)
    return what


def state_dict(trained: TrainedModel, base=None, notes: list | None = None) -> dict:
    """name -> float32 array: every parameter and buffer, under the names and in the layout of
    the model the run started from (the graph's own names for a builder model). ``base``: a
    safetensors file of the PyTorch module's original weights, for the parameters of an
    imported model that dynamo's optimizer folded or dropped; ``notes`` collects what
    could not go back."""
    if is_imported(trained.graph):
        return original_state_dict(trained, optional_onnx(), None if base is None else read_float_tensors(base),
                                   notes)
    if base is not None:
        raise ExportError("--base is for a model imported from ONNX (model=onnx); this run's model was not")
    return {p.name: np.asarray(trained.params[p.name], dtype=np.float32) for p in trained.graph.params}


def export_state_dict(trained: TrainedModel, path, base=None) -> int:
    notes: list = []
    tensors = state_dict(trained, base, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    write_safetensors(path, tensors, {"format": "pt", "hpc_rlx_model": trained.graph.name,
                                      "hpc_rlx_source": str(trained.source)})
    return len(tensors)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Export a run's trained model: an inference ONNX file (ONNX Runtime, "
        "any ONNX consumer) and/or a safetensors state dict (PyTorch load_state_dict).")
    p.add_argument("run_dir", nargs="?", help="the run directory (model.h5, graph.json, checkpoints/)")
    p.add_argument("--check", metavar="MODEL.onnx", help="import this ONNX file as model=onnx would and "
                   "say what it holds, or every node it cannot import; no run directory needed")
    p.add_argument("--onnx", metavar="OUT.onnx", help="write the inference ONNX model here")
    p.add_argument("--state-dict", metavar="OUT.safetensors", help="write the parameters and "
                   "batch-norm running statistics here (float32, the original model's names)")
    p.add_argument("--adapters", metavar="DIR", default=None,
                   help="a LoRA run's adapters (and model.train_only modules) in PEFT's layout: "
                   "peft.PeftModel.from_pretrained(base_model, DIR) loads them")
    p.add_argument("--base", metavar="ORIGINAL.safetensors", default=None,
                   help="the PyTorch module's original weights: with --state-dict, a parameter dynamo's "
                   "optimizer sliced (a position table) goes back whole, its untrained rest from here")
    p.add_argument("--checkpoint", metavar="latest|best|PATH", default=None,
                   help="export this checkpoint instead of the final model.h5")
    p.add_argument("--output", metavar="NODE", default=None,
                   help="the graph node to export as the ONNX output (default: what the loss reads)")
    p.add_argument("--no-check", action="store_true",
                   help="skip running the ONNX file in ONNX Runtime against hpc_rlx's forward")
    p.add_argument("--freeze", metavar="GLOB", nargs="+", default=[],
                   help="with --check: the parameters model.freeze=[GLOB,...] would freeze")
    p.add_argument("--train-only", metavar="GLOB", nargs="+", default=[],
                   help="with --check: the only parameters that train, as model.train_only=[GLOB,...]")
    p.add_argument("--inputs", metavar="NAME", nargs="+", default=[],
                   help="with --check: the model's inputs, as data.x=[NAME,...] names them (e.g. input_ids "
                   "attention_mask); their row shapes are the file's declared ones")
    p.add_argument("--lora-rank", metavar="R", type=int, default=0,
                   help="with --check: LoRA adapters of rank R on the --lora-targets weights, as model.lora.rank")
    p.add_argument("--lora-targets", metavar="GLOB", nargs="+", default=[],
                   help="with --check: the weights that get adapters, as model.lora.targets=[GLOB,...]")
    return p


def declared_inputs(path, names) -> list | None:
    """data.x's [(name, row shape, dtype)] for `--check --inputs`: each named input's row shape
    as the file declares it (ExportError when a row dimension is not fixed there)."""
    if not names:
        return None
    onnx = require_onnx()
    graph = onnx.load(str(path), load_external_data=False).graph
    declared = {i.name: i.type.tensor_type for i in graph.input}
    out = []
    for name in names:
        if name not in declared:
            raise ExportError(f"--inputs: {path} has no input {name!r} (its inputs: {', '.join(declared)})")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in declared[name].shape.dim][1:]
        if any(d is None for d in dims):
            raise ExportError(f"--inputs: input {name!r} of {path} declares no fixed row shape; check it with "
                              f"a training run's first lines instead")
        kind = "float64" if declared[name].elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) else "int64"
        out.append((name, tuple(dims), kind))
    return out


def check_onnx_file(path, freeze=(), train_only=(), inputs=(), lora_rank=0, lora_targets=()) -> list[str]:
    """What `--check` prints for an ONNX file that imports (raises GraphError otherwise), with
    the parameters `model.freeze` / `model.train_only` globs would freeze and the LoRA adapters
    `model.lora.*` would add (ConfigError if they match nothing or leave nothing to train)."""
    imported = import_onnx(path, inputs=declared_inputs(path, list(inputs)))
    lora = lora_settings({"rank": lora_rank, "targets": list(lora_targets)})
    g = freeze_params(add_adapters(imported.graph, lora), list(freeze), list(train_only))
    meta = imported.graph.meta["onnx"]
    ops = Counter(n.op for n in g.nodes)
    x = g.input("x")
    lines = [f"{path}: imports for training ({meta['exporter']} exporter, opset {meta['opset']}, "
             f"{meta['form']} form)",
             (f"inputs {', '.join(repr(n) for n in inputs)}: packed into one {x.dtype} row of {x.shape[1]}; "
              if inputs else f"input {meta['input']!r}: {x.dtype} {list(x.shape)} (null: the batch); ") +
             f"{g.num_params:,} trainable parameters in {sum(p.trainable and not p.frozen for p in g.params)} "
             f"tensors",
             "ops: " + ", ".join(f"{op} x{k}" for op, k in sorted(ops.items()))]
    lines += [f"warning: {w}" for w in imported.warnings]
    if lora is not None:
        lines.append(describe_adapters(g))
    # every parameter the import will train, by its PyTorch name: one that PyTorch keeps fixed
    # (requires_grad=False) is an initializer like the others in the file and shows up here
    names = user_names(g)
    lines.append("trains: " + ", ".join(f"{names[p.name]} ({int(np.prod(p.shape)):,})" for p in g.params
                                        if p.trainable and not p.frozen))
    frozen = [f"{names[p.name]} ({int(np.prod(p.shape)):,})" for p in g.params if p.frozen]
    if frozen:      # model.freeze / model.train_only: used as they are, never changed
        lines.append("frozen: " + ", ".join(frozen))
    return lines


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.check:
        if args.run_dir or args.onnx or args.state_dict or args.adapters:
            print(f"{PROG}: error: --check takes the ONNX file alone (and --freeze or --train-only)", file=sys.stderr)
            return EXIT_ERROR
        try:
            require_onnx()
            print("\n".join(check_onnx_file(args.check, args.freeze, args.train_only, args.inputs,
                                             args.lora_rank, args.lora_targets)))
        except HpcRlxError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        return 0
    if not args.run_dir:
        print(f"{PROG}: error: give the run directory to export from (or --check MODEL.onnx)", file=sys.stderr)
        return EXIT_ERROR
    if args.freeze or args.train_only or args.inputs or args.lora_rank or args.lora_targets:
        print(f"{PROG}: error: --freeze, --train-only, --inputs and --lora-* go with --check MODEL.onnx (a run's "
              f"frozen parameters and adapters are in its graph)", file=sys.stderr)
        return EXIT_ERROR
    if args.base and not args.state_dict:
        print(f"{PROG}: error: --base goes with --state-dict (the weights it completes)", file=sys.stderr)
        return EXIT_ERROR
    if not args.onnx and not args.state_dict and not args.adapters:
        print(f"{PROG}: error: nothing to write: give --onnx OUT.onnx, --state-dict OUT.safetensors "
              f"and/or --adapters DIR", file=sys.stderr)
        return EXIT_ERROR
    try:
        if args.onnx:
            require_onnx()  # before any work: a missing install is the first thing to hear
        run = load_trained(args.run_dir, args.checkpoint, warn=lambda m: print(m, file=sys.stderr))
        print(f"model '{run.graph.name}' from {run.source}")
        trained = merge_adapters(run)       # a LoRA run's: W + (alpha/r)·B·A, as the original model has it
        if args.adapters:       # first: a run without adapters is refused before anything is written
            written = export_adapters(run, args.adapters, state_dict(trained, args.base))
            print(f"LoRA adapters in PEFT's layout: {', '.join(written)}")
        if args.onnx:
            print(f"{export_onnx(trained, args.onnx, args.output, not args.no_check)}: {args.onnx}")
        if args.state_dict:
            count = export_state_dict(trained, args.state_dict, args.base)
            what = "merged LoRA, " if trained is not run else ""
            print(f"state dict ({count} tensors, {what}float32): {args.state_dict}")
    except HpcRlxError as e:  # ExportError and the graph's, checkpoint's errors
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    return 0
