"""LoRA adapters (model.lora.*) in real mpirun jobs, on the seeded SmallMlp exported from PyTorch:
fc1 adapted (r=2), fc2 trained whole (model.train_only, PEFT's modules_to_save). On 2 ranks it
trains as PEFT + torch.optim.AdamW do (float64, to 1e-10) from the same initial adapters; the
sharded optimizer, a resume of that on 1 rank, and two pipeline stages train the same model;
the base weights never move; the bucket carries the adapters and fc2 only (wire_bytes); the
exports load back (PEFT's from_pretrained with no key missing or unexpected, the merged state
dict, ONNX Runtime); and the bad starts are one error each."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.mpi.runtime.test_onnx_training import full_batch_steps, max_rel_diff, params_of, small_mlp_job_files
from tests.support.jobs import explain, mpirun, read_metrics, train_job

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.mpi, pytest.mark.slow]      # 6 jobs and 3 exports: about 30 s on 2 cores

N, TRAIN, STEPS, LR, WD, RANK, ALPHA = 48, 40, 5, 0.01, 0.1, 2, 3
LORA = [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.targets=[fc1]",
        "model.train_only=[fc2.*]"]
COMMON = ["model=onnx", "data=file", "train.dtype=float64", f"train.epochs={STEPS}", f"train.batch_size={TRAIN}",
          "data.val_fraction=0.1667", "data.shuffle=false", "optim=adamw", f"optim.lr={LR}",
          f"optim.weight_decay={WD}", "optim.schedule=constant", "report.tensorboard=false",
          "comm.shared_memory=false"]     # MPI's Allreduce: wire_bytes is the ring's volume of the bucket
ADAPTERS = ("fc1.weight.lora_A", "fc1.weight.lora_B")


def _run(tmp_path, name: str, n: int, overrides: list[str]):
    proc = train_job(n, tmp_path / name, overrides, timeout=180)
    assert proc.returncode == 0, f"{name}: " + explain(proc)
    return tmp_path / name


def _initial_adapters(run_dir) -> dict:
    from hpc_rlx.graph import Graph
    from hpc_rlx.graph.lora import initial_adapters
    return initial_adapters(Graph.from_dict(json.loads((run_dir / "graph.json").read_text())), 0)


def _peft_model(module, initial: dict | None = None):
    """`module` (float64) under PEFT's LoRA as the run has it; the adapters set to `initial`."""
    model = peft.get_peft_model(module.double(), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["fc1"], modules_to_save=["fc2"]))
    if initial is not None:
        with torch.no_grad():
            model.base_model.model.fc1.lora_A["default"].weight.copy_(torch.from_numpy(initial[ADAPTERS[0]]))
            model.base_model.model.fc1.lora_B["default"].weight.copy_(torch.from_numpy(initial[ADAPTERS[1]]))
    return model


def test_lora_trains_as_peft_in_every_layout_and_exports_what_peft_loads(tmp_path):
    module, onnx_file, x, y, data = small_mlp_job_files(tmp_path, N)
    base_weights = {k: v.detach().double().numpy().copy() for k, v in module.state_dict().items()}
    base = COMMON + [f"model.path={onnx_file}", f"data.path={data}"]
    two = _run(tmp_path, "two", 2, base + LORA + ["checkpoint=off"])
    full = _run(tmp_path, "full", 2, base + ["checkpoint=off"])
    pipe = _run(tmp_path, "pipe", 2, base + LORA + ["parallel.pipeline_stages=2", "checkpoint=off"])
    part = _run(tmp_path, "sharded", 2, base + LORA + ["comm.shard=optimizer", "train.epochs=3",
                                                       "checkpoint.every_epochs=1"])
    resumed = _run(tmp_path, "sharded", 1, base + LORA + ["resume=auto"])      # on another world size
    assert part == resumed

    # PEFT + AdamW from the run's own initial adapters, full-batch steps on the training rows
    peft_model = _peft_model(module, _initial_adapters(two))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    full_batch_steps(peft_model, opt, x[:TRAIN], y[:TRAIN], STEPS)
    state = {k: v.detach().numpy() for k, v in peft_model.state_dict().items()}
    want = {ADAPTERS[0]: state["base_model.model.fc1.lora_A.default.weight"],
            ADAPTERS[1]: state["base_model.model.fc1.lora_B.default.weight"],
            "fc2.weight": state["base_model.model.fc2.modules_to_save.default.weight"],
            "fc2.bias": state["base_model.model.fc2.modules_to_save.default.bias"]}
    for run in (two, pipe, resumed):
        got = params_of(run)
        trained = {k: (got[k].T if got[k].shape != want[k].shape else got[k]) for k in want}
        assert max_rel_diff(want, trained) <= 1e-10, (run.name, max_rel_diff(want, trained))
        for k in ("fc1.weight", "fc1.bias"):        # the base: bitwise what the file held
            value = got[k].T if got[k].shape != base_weights[k].shape else got[k]
            np.testing.assert_array_equal(value, base_weights[k], err_msg=f"{run.name}: {k} moved")
    # the bucket: the adapters and fc2, nothing of fc1; per step and rank, MPI's Allreduce of 2
    # ranks moves the bucket, so the two runs differ by exactly fc1's values less the adapters'
    wire = {r.name: sum(m["wire_bytes"] for m in read_metrics(r)) for r in (two, full)}
    full_values, lora_values = 64 * 32 + 32 + 32 * 10 + 10, RANK * 64 + 32 * RANK + 32 * 10 + 10
    assert wire["full"] - wire["two"] == STEPS * 2 * (full_values - lora_values) * 8, wire

    _exports_load_back(tmp_path, two, module)
    _bad_starts(tmp_path, base, full)


def _exports_load_back(tmp_path, run, module) -> None:
    out = mpirun(1, ["-m", "hpc_rlx.export", str(run), "--adapters", str(tmp_path / "adapters"),
                     "--state-dict", str(tmp_path / "merged.safetensors"), "--onnx", str(tmp_path / "merged.onnx")])
    assert out.returncode == 0, explain(out)
    from peft import PeftModel
    from safetensors.torch import load_file
    trained = params_of(run)
    loaded = PeftModel.from_pretrained(type(module)().double().eval(), str(tmp_path / "adapters"))
    check = peft.get_peft_model(type(module)().double(), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["fc1"], modules_to_save=["fc2"]))
    result = peft.set_peft_model_state_dict(check, load_file(tmp_path / "adapters" / "adapter_model.safetensors"))
    assert not result.unexpected_keys, result.unexpected_keys          # and nothing of PEFT's is left out:
    assert not [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k], result.missing_keys
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"], config["modules_to_save"],
            config["fan_in_fan_out"]) == (RANK, ALPHA, ["fc1"], ["fc2"], False)
    plain = type(module)().double().eval()
    fresh_fc1 = {k: v.clone() for k, v in plain.state_dict().items() if k.startswith("fc1")}
    result = plain.load_state_dict({k: v.double() for k, v in load_file(tmp_path / "merged.safetensors").items()})
    assert not result.missing_keys and not result.unexpected_keys
    assert not torch.equal(plain.fc1.weight, fresh_fc1["fc1.weight"])
    # PEFT's adapters on the *original* weights: load the export's base onto the fresh module first
    with torch.no_grad():
        loaded.base_model.model.fc1.weight.copy_(torch.from_numpy(np.ascontiguousarray(
            trained["fc1.weight"] if trained["fc1.weight"].shape == (32, 64) else trained["fc1.weight"].T)))
        loaded.base_model.model.fc1.bias.copy_(torch.from_numpy(trained["fc1.bias"]))
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((6, 1, 8, 8)))
    with torch.no_grad():
        a, b = loaded(x).numpy(), plain(x).numpy()
    # both files are float32: the adapters on the base, and the base with them merged, agree to its rounding
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max(), np.abs(a - b).max()
    import onnxruntime as ort
    session = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy().astype(np.float32)})[0]
    assert np.abs(got - b).max() <= 1e-4 * np.abs(b).max(), np.abs(got - b).max()


def _bad_starts(tmp_path, base, full) -> None:
    """A LoRA run from a model.h5 without adapters, and --adapters of a run without LoRA: one
    error each, exit 2."""
    bad = train_job(2, tmp_path / "bad", base + LORA + [f"model.init_from={full / 'model.h5'}"], timeout=120)
    lines = [ln for ln in bad.stderr.splitlines() if "error" in ln]
    assert bad.returncode != 0 and len(set(lines)) == 1, explain(bad)
    assert "model.init_from=" in lines[0] and "holds no LoRA adapters" in lines[0], lines[0]
    out = mpirun(1, ["-m", "hpc_rlx.export", str(full), "--adapters", str(tmp_path / "none")])
    assert out.returncode == 2 and "--adapters: the run in" in out.stderr and "has no LoRA adapters" in out.stderr, \
        explain(out)
    assert not (tmp_path / "none").exists()
