"""A LoRA run's exports (`model.lora.*`, graph/lora.py): the merged model, which `--onnx` and
`--state-dict` write as a full fine-tune's, and PEFT's adapter layout (`--adapters DIR`:
`adapter_model.safetensors` + `adapter_config.json`), which `peft.PeftModel.from_pretrained(base,
DIR)` loads onto the original model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from hpc_rlx.export.safetensors_file import write_safetensors
from hpc_rlx.export.trained import ExportError, TrainedModel
from hpc_rlx.graph.lora import adapter_ir_names, adapters_of, merged, module_name, without_adapters
from hpc_rlx.graph.param_names import user_names

PREFIX = "base_model.model."      # PEFT's keys: the wrapped model's names under this prefix
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def merge_adapters(trained: TrainedModel) -> TrainedModel:
    """The run's model with each adapted weight W + (alpha/r)·B·A and no adapters: what the
    original model's `load_state_dict` and an inference ONNX file take (itself without LoRA)."""
    if adapters_of(trained.graph.meta) is None:
        return trained
    return TrainedModel(without_adapters(trained.graph), merged(trained.graph.meta, trained.params),
                        trained.source, trained.run_dir)


def _modules_to_save(trained: TrainedModel) -> list[str]:
    """The modules of the base parameters that trained beside the adapters (`model.train_only`),
    each whole: PEFT's `modules_to_save` saves and trains a module with all its parameters."""
    names = user_names(trained.graph)
    lora_names = set(adapter_ir_names(trained.graph.meta))
    base = [p for p in trained.graph.params if p.name not in lora_names and p.trainable]
    trained_modules = {module_of(names[p.name]) for p in base if not p.frozen}
    for module in sorted(trained_modules):
        left = [names[p.name] for p in base if p.frozen and module_of(names[p.name]) == module]
        if left:
            raise ExportError(f"--adapters: model.train_only trained part of module {module!r} ("
                              f"{left[0]} stayed frozen); PEFT's modules_to_save saves whole modules: "
                              f"train every parameter of {module!r} (e.g. model.train_only=['{module}.*']), "
                              f"or export the merged model with --state-dict")
    return sorted(trained_modules)


def module_of(name: str) -> str:
    """The module a parameter belongs to (its name without the last part)."""
    return name.rpartition(".")[0] or name


def export_adapters(trained: TrainedModel, directory, state_dict) -> list[str]:
    """Write PEFT's adapter layout into `directory`; returns the files written. `state_dict`:
    the merged model's state dict (name -> float32, PyTorch layout), the source of the
    `modules_to_save` values."""
    record = adapters_of(trained.graph.meta)
    if record is None:
        raise ExportError(f"--adapters: the run in {trained.run_dir} has no LoRA adapters (model.lora.rank=0); "
                          f"export its model with --state-dict or --onnx")
    layouts = {r["layout"] for r in record["adapters"]}
    if len(layouts) > 1:
        raise ExportError("--adapters: the adapted weights mix PyTorch's (out, in) Linear and (in, out) Conv1D "
                          "layouts, which one PEFT config (fan_in_fan_out) cannot describe")
    saved_modules = _modules_to_save(trained)
    tensors = {}
    for r in record["adapters"]:
        module = module_name(r["name"])
        tensors[f"{PREFIX}{module}.lora_A.weight"] = np.asarray(trained.params[r["a"]], np.float32)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = np.asarray(trained.params[r["b"]], np.float32)
    for key, value in state_dict.items():
        if module_of(key) in saved_modules:
            tensors[PREFIX + key] = value
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
        "r": int(record["rank"]), "lora_alpha": record["alpha"], "lora_dropout": record["dropout"],
        "target_modules": sorted(module_name(r["name"]) for r in record["adapters"]),
        "fan_in_fan_out": layouts == {"in_out"}, "bias": "none", "modules_to_save": saved_modules or None,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / WEIGHTS, tensors, {"format": "pt"})
    tmp = directory / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, directory / CONFIG)     # whole or absent, as the weights file
    return [str(directory / WEIGHTS), str(directory / CONFIG)]
