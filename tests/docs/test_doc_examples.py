"""The commands of the pages' code blocks, run as written: each test takes a block's text from
its page (`doc_blocks.block`) and runs it in bash, in a fresh directory, with the environment
activated as the README says.

What a test changes, and nothing else: `mpirun -n N` becomes the launcher the tests use for
this MPI (`tests.support.mpi_launch`: Open MPI needs its flags as root and on 2 cores), and
every training command gets `CI_OVERRIDES` appended (Hydra's last value wins): one epoch, no
plots and no TensorBoard files, so that each job costs a few seconds of CPU. The data the
pages assume is there: `data/digits.h5` (the default job's file, prepared once per session),
and the input files a page names (`table.csv`, `mnist.npz`, ...) written by the test.

`tests/docs/test_commands.py` checks that every command block of the pages is run here (or in
another test it lists) or marked as an example.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.docs.doc_blocks import argv, block
from tests.support.jobs import PYTHON, mpi_env
from tests.support.mpi_launch import launch_prefix

CI_OVERRIDES = ["train.epochs=1", "report.plots=false", "report.tensorboard=false"]
TIMEOUT = 240

# test -> the blocks it runs, by (page, first command); test_commands.py checks them against
# its registry
RUNS = {
    "test_readme_running_section": [
        ("README.md", ". .venv/bin/activate"),
        ("README.md", "mpirun -n 2 hpc-rlx train.epochs=1")],
    "test_resume_in_the_same_run_directory": [
        ("docs/checkpoints.md", "mpirun -n 2 python -m hpc_rlx hydra.run.dir=outputs/mine train.max_steps=10")],
    "test_convert_csv_and_npz_then_train": [
        ("docs/data.md", "python -m hpc_rlx.data convert table.csv --label target --out data/table.h5")],
    "test_prepare_the_bundled_datasets": [
        ("docs/data.md", "python -m hpc_rlx.data prepare digits --out data/digits.h5")],
    "test_pipeline_stages": [
        ("docs/pipeline.md", "mpirun -n 2 python -m hpc_rlx parallel.pipeline_stages=2 parallel.microbatches=4")],
    "test_a_slow_rank_under_cadence": [
        ("docs/policies.md", "mpirun -n 2 python -m hpc_rlx policy=cadence 'debug.slowdown={1: 3.0}'")],
    "test_pytorch_model_through_onnx_and_back": [
        ("docs/pytorch.md", ".venv/bin/python net.py")],
    "test_a_hugging_face_model_through_onnx_and_back": [
        ("README.md", ".venv/bin/python hf_bert.py")],
    "test_fine_tuning_with_lora_and_an_attention_mask": [
        ("docs/finetuning.md", ".venv/bin/python hf_lora.py")],
    "test_export_a_trained_run": [
        ("docs/pytorch.md", ".venv/bin/mpirun -n 2 .venv/bin/python -m hpc_rlx hydra.run.dir=runs/mlp")],
    "test_a_graph_written_with_graph_builder": [
        ("docs/pytorch.md", ".venv/bin/mpirun -n 2 .venv/bin/python -m hpc_rlx model=graph model.path=logreg.json")],
    "test_mlperf_hpc_cosmoflow_end_to_end": [
        ("docs/mlperf_hpc.md", ".venv/bin/python cut_universes.py universes/train cosmo/train 32"),
        ("docs/mlperf_hpc.md", ".venv/bin/python cosmoflow.py")],
    "test_mlperf_hpc_deepcam_end_to_end": [
        ("docs/mlperf_hpc.md", ".venv/bin/python deepcam.py")],
}
# lines of the README's Running block that other tests run: the console script
# (tests/docs/test_readme_running.py) and the Slurm batch job (tests/cluster/test_slurm.py)
RUN_ELSEWHERE = (re.compile(r"^mpirun -n \d+ hpc-rlx "), re.compile(r"^sbatch slurm/train\.sh "))


def is_training(words: list[str]) -> bool:
    """`python -m hpc_rlx ...` or `hpc-rlx ...` (not its other modules, not a print-only flag)."""
    trains = "hpc-rlx" in words or any(a == "-m" and b == "hpc_rlx" for a, b in zip(words, words[1:]))
    return trains and not any(w in ("--help", "-h", "-sc", "--cfg", "--shell-completion") for w in words)


def as_run_here(command: str, launcher=launch_prefix) -> str:
    """`command` with the tests' launcher for `mpirun -n N` and CI_OVERRIDES for a training run."""
    words = argv(command)
    if words and words[0] in ("mpirun", ".venv/bin/mpirun"):
        assert words[1] == "-n" and words[2].isdigit(), f"a page's mpirun line must start `mpirun -n N`: {command}"
        words = launcher(int(words[2])) + words[3:]
    elif not is_training(words):
        return command                      # as written: pipes, $(...), eval
    if is_training(words):
        words = words + CI_OVERRIDES
    return shlex.join(words)


@pytest.fixture
def workdir(tmp_path, digits_h5) -> Path:
    """A fresh directory as the pages assume it: `.venv` (the environment the tests run in) and
    the default job's data file."""
    (tmp_path / ".venv").symlink_to(Path(PYTHON).parents[1], target_is_directory=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits.h5").symlink_to(digits_h5)
    return tmp_path


def run_commands(commands: list[str], cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run the commands one after another in bash (stopping at the first failure), after
    `. .venv/bin/activate`."""
    script = "\n".join(["set -euo pipefail", ". .venv/bin/activate"] + [as_run_here(c) for c in commands])
    env = mpi_env()
    env.pop("VIRTUAL_ENV", None)
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the page's commands did not finish in {timeout}s:\n{script}\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{script}\n--- stdout ---\n{proc.stdout[-4000:]}" \
                                 f"\n--- stderr ---\n{proc.stderr[-4000:]}"
    return proc


def page_commands(test: str) -> list[str]:
    return [c for key in RUNS[test] for c in block(*key).commands()]


def write_block(page: str, first_line: str, path: Path) -> Path:
    """A page's code block (Python, say) written to a file, as a reader would save it."""
    path.write_text(block(page, first_line).text + "\n")
    return path


def completed(run_dir: Path) -> dict:
    import json
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    return summary


@pytest.mark.mpi
def test_readme_running_section(workdir):
    """The README's Running block: activate, then each line but those other tests run."""
    commands = [c for c in page_commands("test_readme_running_section")
                if not any(p.match(c) for p in RUN_ELSEWHERE)]
    assert [argv(c)[:4] for c in commands] == [[".", ".venv/bin/activate"],
                                                 ["mpirun", "-n", "2", "python"],
                                                 ["mpirun", "-n", "2", "python"],
                                                 ["python", "-m", "hpc_rlx.doctor"]], commands
    proc = run_commands(commands, workdir)
    runs = sorted((workdir / "outputs").iterdir())
    assert len(runs) == 1 and completed(runs[0])["world_size"] == 2
    sweeps = list((workdir / "multirun").glob("*/sweep_summary.json"))
    assert len(sweeps) == 1 and len(list(sweeps[0].parent.glob("*/summary.json"))) == 4, proc.stdout[-2000:]
    assert "No problems found" in proc.stdout or "warning" in proc.stdout.lower(), proc.stdout[-2000:]


@pytest.mark.mpi
def test_resume_in_the_same_run_directory(workdir):
    run_commands(page_commands("test_resume_in_the_same_run_directory"), workdir)
    run_dir = workdir / "outputs" / "mine"
    summary = completed(run_dir)
    assert summary["epochs_completed"] == 1
    assert (run_dir / "config.segment-2.yaml").is_file(), sorted(p.name for p in run_dir.iterdir())


@pytest.mark.mpi
def test_convert_csv_and_npz_then_train(workdir):
    import numpy as np
    rng = np.random.default_rng(0)
    rows = ["f0,f1,f2,target"] + [f"{a:.3f},{b:.3f},{c:.3f},{int(a > 0) + int(b > 0)}"
                                   for a, b, c in rng.standard_normal((200, 3))]
    (workdir / "table.csv").write_text("\n".join(rows) + "\n")
    np.savez(workdir / "mnist.npz", x=rng.integers(0, 255, (64, 1, 8, 8), dtype=np.uint8),
             y=rng.integers(0, 10, 64))
    np.savez(workdir / "all.npz", x_train=rng.standard_normal((64, 5)).astype(np.float32),
             y_train=rng.integers(0, 3, 64), x_test=rng.standard_normal((16, 5)).astype(np.float32))
    proc = run_commands(page_commands("test_convert_csv_and_npz_then_train"), workdir)
    for name in ("table", "mnist", "train"):
        assert (workdir / "data" / f"{name}.h5").is_file(), proc.stdout
    runs = list((workdir / "outputs").iterdir())
    assert len(runs) == 1 and completed(runs[0])["world_size"] == 2


def test_prepare_the_bundled_datasets(workdir):
    (workdir / "data" / "digits.h5").unlink()        # the page writes it
    run_commands(page_commands("test_prepare_the_bundled_datasets"), workdir)
    import h5py
    for name in ("digits", "synth", "text"):
        with h5py.File(workdir / "data" / f"{name}.h5", "r") as f:
            assert len(f["x"]) == len(f["y"]) > 0


@pytest.mark.mpi
def test_pipeline_stages(workdir):
    run_commands(page_commands("test_pipeline_stages"), workdir)
    runs = sorted((workdir / "outputs").iterdir())
    assert len(runs) == 2
    for run in runs:
        completed(run)
    assert "fc1" in (runs[1] / "config.yaml").read_text()


@pytest.mark.mpi
def test_a_slow_rank_under_cadence(workdir):
    run_commands(page_commands("test_a_slow_rank_under_cadence"), workdir)
    (run,) = (workdir / "outputs").iterdir()
    completed(run)


@pytest.mark.mpi
def test_pytorch_model_through_onnx_and_back(workdir):
    """net.py from the page, the page's three commands, then the page's PyTorch code loading
    the trained weights back."""
    for module in ("torch", "onnx", "onnxscript", "onnxruntime", "safetensors"):
        pytest.importorskip(module)
    write_block("docs/pytorch.md", "# net.py: a small convolutional net for the default 8x8 digits",
                workdir / "net.py")
    back = write_block("docs/pytorch.md", "# back in PyTorch: every parameter and running statistic is there",
                       workdir / "load_back.py")
    proc = run_commands(page_commands("test_pytorch_model_through_onnx_and_back")
                        + [f".venv/bin/python {back.name}"], workdir)
    completed(workdir / "runs" / "net")
    assert (workdir / "trained.onnx").is_file() and (workdir / "trained.safetensors").is_file()
    # what load_state_dict reported: nothing unexpected, only buffers the file never had
    report = proc.stdout.strip().splitlines()[-1]
    assert report == "<All keys matched successfully>" or (
        "unexpected_keys=[]" in report
        and re.search(r"missing_keys=\[('[\w.]*num_batches_tracked',? ?)*\]", report)), report


@pytest.mark.mpi
@pytest.mark.slow
def test_a_hugging_face_model_through_onnx_and_back(workdir):
    """The README's Hugging Face example: hf_bert.py and tokens.py from the page, its commands,
    then loading the trained weights back into the transformers model: every key matches."""
    for module in ("torch", "onnx", "onnxscript", "safetensors", "transformers"):
        pytest.importorskip(module)
    for first_line, name in (
            ("# hf_bert.py: BERT from its config class (random weights; from_pretrained exports the same way)",
             "hf_bert.py"),
            ("# tokens.py: token ids and their labels in HDF5 (a tokenizer's output goes here)", "tokens.py"),
            ("# back in transformers: the trained BERT", "load_back.py")):
        write_block("README.md", first_line, workdir / name)
    proc = run_commands(page_commands("test_a_hugging_face_model_through_onnx_and_back")
                        + [".venv/bin/python load_back.py"], workdir)
    assert "bert.onnx: imports for training" in proc.stdout, proc.stdout
    completed(workdir / "runs" / "bert")
    assert proc.stdout.strip().splitlines()[-1] == "<All keys matched successfully>", proc.stdout[-2000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_fine_tuning_with_lora_and_an_attention_mask(workdir):
    """docs/finetuning.md end to end: a BERT of (input_ids, attention_mask) exported, padded data,
    the check, a LoRA run on 2 ranks, the exports, and the adapters loaded back with PEFT onto the
    original weights equal the merged state dict, which loads with every key."""
    for module in ("torch", "onnx", "onnxscript", "safetensors", "transformers", "peft"):
        pytest.importorskip(module)
    for first_line, name in (
            ("# hf_lora.py: a BERT classifier that reads token ids and an attention mask", "hf_lora.py"),
            ("# padded.py: padded token ids, their attention mask and labels in HDF5 (a tokenizer's output)",
             "padded.py"),
            ("# load_adapters.py: the fine-tuned model back in transformers and PEFT", "load_adapters.py")):
        write_block("docs/finetuning.md", first_line, workdir / name)
    proc = run_commands(page_commands("test_fine_tuning_with_lora_and_an_attention_mask")
                        + [".venv/bin/python load_adapters.py"], workdir)
    assert "LoRA: rank 4, alpha 8 (scale 2), dropout 0: adapters on 4 weight(s)" in proc.stdout, proc.stdout
    assert "trains: model.classifier.weight (128), model.classifier.bias (4)" in proc.stdout, proc.stdout
    completed(workdir / "runs" / "lora")
    log = (workdir / "runs" / "lora" / "hpc_rlx.log").read_text()
    assert "the bucket's payload is 1,156 values instead of 53,476" in log, log
    # the merged model's ONNX file, run in ONNX Runtime against hpc_rlx's forward by the export
    assert re.search(r"checked in ONNX Runtime against hpc_rlx \(max relative difference [0-9.e+-]+\): merged.onnx",
                     proc.stdout), proc.stdout[-2000:]
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (workdir / "adapters" / name).is_file(), name
    *_, loaded, difference = proc.stdout.strip().splitlines()
    assert loaded == "<All keys matched successfully>", proc.stdout[-2000:]
    assert difference.startswith("max difference: ") and float(difference.split(": ")[1]) < 1e-5, difference


@pytest.mark.mpi
def test_export_a_trained_run(workdir):
    pytest.importorskip("onnx")
    run_commands(page_commands("test_export_a_trained_run"), workdir)
    completed(workdir / "runs" / "mlp")
    for name in ("mlp.onnx", "mlp.safetensors", "best.onnx"):
        assert (workdir / name).is_file(), name


@pytest.mark.mpi
def test_a_graph_written_with_graph_builder(workdir):
    script = write_block("docs/pytorch.md", "from hpc_rlx.graph import GraphBuilder", workdir / "logreg.py")
    run_commands([f".venv/bin/python {script.name}"] + page_commands("test_a_graph_written_with_graph_builder"),
                 workdir)
    (run,) = (workdir / "outputs").iterdir()
    assert completed(run)["world_size"] == 2


@pytest.mark.mpi
@pytest.mark.slow
def test_mlperf_hpc_cosmoflow_end_to_end(workdir):
    """docs/mlperf_hpc.md's CosmoFlow: universes cut into one-sample files by the page's script,
    its model exported, checked, trained on 2 ranks and loaded back into PyTorch."""
    for module in ("torch", "onnx", "onnxscript", "onnxruntime", "safetensors"):
        pytest.importorskip(module)
    import h5py
    import numpy as np
    rng = np.random.default_rng(0)
    for split, names in (("train", ["univ_a", "univ_b"]), ("validation", ["univ_c"])):
        (workdir / "universes" / split).mkdir(parents=True)
        for name in names:                     # 64^3 universes: 8 samples of 32^3 each
            params = rng.uniform(-1, 1, 4)
            with h5py.File(workdir / "universes" / split / f"{name}.hdf5", "w") as f:
                f["full"] = rng.poisson(np.exp(1.5 + params), (64, 64, 64, 4)).astype(np.int16)
                f["unitPar"] = params
    for first_line, name in (("# cut_universes.py: one HDF5 file per sub-volume, x (size, size, size, 4) int16 "
                              "and y (4,) float32", "cut_universes.py"),
                             ("# cosmoflow.py: CosmoFlow with its input normalisation inside", "cosmoflow.py"),
                             ("# back in PyTorch: the trained CosmoFlow", "load_back.py")):
        write_block("docs/mlperf_hpc.md", first_line, workdir / name)
    proc = run_commands(page_commands("test_mlperf_hpc_cosmoflow_end_to_end") + [".venv/bin/python load_back.py"],
                        workdir)
    assert len(list((workdir / "cosmo" / "train").glob("*.h5"))) == 16
    assert "cosmoflow.onnx: imports for training" in proc.stdout, proc.stdout
    summary = completed(workdir / "runs" / "cosmoflow")
    assert summary["world_size"] == 2
    assert "val_mae" in (workdir / "runs" / "cosmoflow" / "metrics.jsonl").read_text()
    assert (workdir / "cosmoflow-trained.onnx").is_file()
    assert proc.stdout.strip().splitlines()[-1] == "<All keys matched successfully>", proc.stdout[-2000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_mlperf_hpc_deepcam_end_to_end(workdir):
    """docs/mlperf_hpc.md's DeepCAM: one-sample files as downloaded (climate/data, labels_0 and
    stats.h5 beside the directories), the page's model exported, checked, trained on 2 ranks
    with class weights and LAMB, and loaded back into PyTorch."""
    for module in ("torch", "onnx", "onnxscript", "onnxruntime", "safetensors"):
        pytest.importorskip(module)
    from tests.support.mlperf_hpc import write_deepcam
    write_deepcam(workdir / "deepcam", train=16, val=4)       # 4 steps of 4: the warm-up and the milestone fit
    for first_line, name in (("# deepcam.py: a small DeepLabv3+ with DeepCAM's normalisation and transpose inside",
                              "deepcam.py"),
                             ("# back in PyTorch: the trained DeepLabv3+", "load_back.py")):
        write_block("docs/mlperf_hpc.md", first_line, workdir / name)
    proc = run_commands(page_commands("test_mlperf_hpc_deepcam_end_to_end") + [".venv/bin/python load_back.py"],
                        workdir)
    assert "deepcam.onnx: imports for training" in proc.stdout, proc.stdout
    assert completed(workdir / "runs" / "deepcam")["world_size"] == 2
    assert "val_iou" in (workdir / "runs" / "deepcam" / "metrics.jsonl").read_text()
    assert proc.stdout.strip().splitlines()[-1] == "<All keys matched successfully>", proc.stdout[-2000:]


def test_as_run_here_changes_only_the_launcher_and_the_length_of_training():
    launcher = lambda n: ["LAUNCHER", "-n", str(n)]  # noqa: E731
    line = "mpirun -n 2 python -m hpc_rlx 'debug.slowdown={1: 3.0}'   # rank 1 slower"
    assert argv(as_run_here(line, launcher)) == ["LAUNCHER", "-n", "2", "python", "-m", "hpc_rlx",
                                                 "debug.slowdown={1: 3.0}", *CI_OVERRIDES]
    line = ".venv/bin/mpirun -n 2 .venv/bin/python -m hpc_rlx.export runs/x --onnx x.onnx"
    assert argv(as_run_here(line, launcher))[3:] == argv(line)[3:]          # not a training run
    for line in ('eval "$(hpc-rlx -sc install=bash)"', "python -m hpc_rlx.data info data/x.h5",
                 ". .venv/bin/activate"):
        assert as_run_here(line, launcher) == line
    assert argv(as_run_here("python -m hpc_rlx.doctor", launcher)) == ["python", "-m", "hpc_rlx.doctor"]
