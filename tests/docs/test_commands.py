"""Every command shown in a fenced code block of README.md and docs/*.md either runs in a test,
which takes the text from the page, or is marked as an example.

`RUN_BY_TESTS` names, for each block of commands (by its page and its first command), the tests
that run it. A block that is neither marked ```` ```bash example ```` nor listed here fails with
its page and line; so does a listed block that is gone from its page, a listed test that does
not exist, and an example block that gives no reason not to run (a placeholder such as
`<your-file.h5>`, or a command that cannot run here: an install, a real cluster, a GPU).
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.docs import test_doc_examples
from tests.docs.doc_blocks import REPO, Block, blocks, pages

EXAMPLES = "tests/docs/test_doc_examples.py"
README_RUNNING = "tests/docs/test_readme_running.py"

RUN_BY_TESTS: dict[tuple[str, str], list[str]] = {
    ("README.md", ". .venv/bin/activate"): [
        f"{EXAMPLES}::test_readme_running_section",
        f"{README_RUNNING}::test_running_section_activates_the_environment_before_the_first_mpirun"],
    # the default job as a command, the CNN, the sweep and the doctor here; the hpc-rlx line
    # also as the console script's test; the sbatch line on the local Slurm cluster
    ("README.md", "mpirun -n 2 hpc-rlx train.epochs=1"): [
        f"{EXAMPLES}::test_readme_running_section",
        f"{README_RUNNING}::test_hpc_rlx_runs_a_tiny_job_under_mpirun",
        "tests/cluster/test_slurm.py::test_sbatch_train_sh_as_shipped_runs_on_a_two_cpu_node"],
    ("README.md", 'eval "$(hpc-rlx -sc install=bash)"'): [
        f"{README_RUNNING}::test_hpc_rlx_prints_hydras_completion_script_and_bash_completes_with_it"],
    ("docs/checkpoints.md", "mpirun -n 2 python -m hpc_rlx hydra.run.dir=outputs/mine train.max_steps=10"): [
        f"{EXAMPLES}::test_resume_in_the_same_run_directory"],
    ("docs/data.md", "python -m hpc_rlx.data convert table.csv --label target --out data/table.h5"): [
        f"{EXAMPLES}::test_convert_csv_and_npz_then_train"],
    ("docs/data.md", "python -m hpc_rlx.data prepare digits --out data/digits.h5"): [
        f"{EXAMPLES}::test_prepare_the_bundled_datasets"],
    ("docs/pipeline.md", "mpirun -n 2 python -m hpc_rlx parallel.pipeline_stages=2 parallel.microbatches=4"): [
        f"{EXAMPLES}::test_pipeline_stages"],
    ("docs/policies.md", "mpirun -n 2 python -m hpc_rlx policy=cadence 'debug.slowdown={1: 3.0}'"): [
        f"{EXAMPLES}::test_a_slow_rank_under_cadence"],
    ("README.md", ".venv/bin/python hf_bert.py"): [
        f"{EXAMPLES}::test_a_hugging_face_model_through_onnx_and_back"],
    ("docs/finetuning.md", ".venv/bin/python hf_lora.py"): [
        f"{EXAMPLES}::test_fine_tuning_with_lora_and_an_attention_mask"],
    ("docs/pytorch.md", ".venv/bin/python net.py"): [
        f"{EXAMPLES}::test_pytorch_model_through_onnx_and_back"],
    ("docs/pytorch.md", ".venv/bin/mpirun -n 2 .venv/bin/python -m hpc_rlx hydra.run.dir=runs/mlp"): [
        f"{EXAMPLES}::test_export_a_trained_run"],
    ("docs/pytorch.md", ".venv/bin/mpirun -n 2 .venv/bin/python -m hpc_rlx model=graph model.path=logreg.json"): [
        f"{EXAMPLES}::test_a_graph_written_with_graph_builder"],
    ("docs/mlperf_hpc.md", ".venv/bin/python cut_universes.py universes/train cosmo/train 32"): [
        f"{EXAMPLES}::test_mlperf_hpc_cosmoflow_end_to_end"],
    ("docs/mlperf_hpc.md", ".venv/bin/python cosmoflow.py"): [
        f"{EXAMPLES}::test_mlperf_hpc_cosmoflow_end_to_end"],
    ("docs/mlperf_hpc.md", ".venv/bin/python deepcam.py"): [
        f"{EXAMPLES}::test_mlperf_hpc_deepcam_end_to_end"],
}

# why an example block does not run in a test: a placeholder, or something this machine is not
PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\n]*>")
NOT_HERE = {
    r"scripts/install\.sh": "installs packages (network, root)",
    r"\bpip install\b": "installs packages (network)",
    r"\bpytest\b": "the test suite itself (CI runs it)",
    r"^module load\b": "a cluster's module system",
    r"\bsrun\b|\bsbatch\b.*(-N\s*\d|--nodes)|hydra/launcher=slurm": "a real Slurm cluster",
    r"-hosts\b|--host\b": "other hosts",
    r"gpu_check\.sh|\bcuda\b|device=(cuda|all)": "a GPU",
}


def command_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page) if b.is_commands]


def why_not_run(b: Block) -> str | None:
    if PLACEHOLDER.search(b.text):
        return "a placeholder"
    for pattern, why in NOT_HERE.items():
        if any(re.search(pattern, c) for c in b.commands()):
            return why
    return None


def test_every_command_block_runs_in_a_test_or_is_an_example():
    missing = [f"{b.page}:{b.line}: {b.first_command!r} is neither run by a test (RUN_BY_TESTS) "
               f"nor marked ```bash example" for b in command_blocks()
               if not b.is_example and b.key not in RUN_BY_TESTS]
    assert not missing, "\n".join(missing)


def test_every_listed_block_is_still_on_its_page():
    present = {b.key for b in command_blocks() if not b.is_example}
    gone = [f"{page}: no block of commands starts with {first!r} (RUN_BY_TESTS is out of date)"
            for page, first in RUN_BY_TESTS if (page, first) not in present]
    assert not gone, "\n".join(gone)


def test_blocks_are_told_apart_by_their_first_command():
    keys = [b.key for b in command_blocks() if not b.is_example]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_every_listed_test_exists():
    missing = []
    for tests in RUN_BY_TESTS.values():
        for test in tests:
            path, _, name = test.partition("::")
            file = REPO / path
            names = ({n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
                     if file.is_file() else set())
            if name not in names:
                missing.append(test)
    assert not missing, missing


def test_the_examples_module_runs_what_is_listed_for_it():
    """test_doc_examples.py names the blocks each of its tests runs; the registry agrees."""
    listed = {(key, t.partition("::")[2]) for key, tests in RUN_BY_TESTS.items() for t in tests
              if t.startswith(EXAMPLES)}
    ran = {(key, test) for test, keys in test_doc_examples.RUNS.items() for key in keys}
    assert listed == ran, (sorted(listed - ran), sorted(ran - listed))


@pytest.mark.parametrize("b", [b for b in command_blocks() if b.is_example], ids=lambda b: f"{b.page}:{b.line}")
def test_an_example_block_says_why_it_does_not_run(b):
    assert why_not_run(b), (f"{b.where()} is marked as an example but holds no placeholder (<...>) and "
                            f"nothing that cannot run here; run it in a test instead (RUN_BY_TESTS)")


def test_the_parser_finds_blocks_info_strings_and_commands(tmp_path, monkeypatch):
    import tests.docs.doc_blocks as mod
    monkeypatch.setattr(mod, "REPO", tmp_path)
    (tmp_path / "p.md").write_text(
        "text\n\n```bash example\nmpirun -n <ranks> python -m hpc_rlx\n```\n\n"
        "1. item\n   ```bash\n   python -m a \\\n       --flag   # comment\n   # only a comment\n\n"
        "   python -m b\n   ```\n\n````text\n```\nnot a fence end\n````\n\n```\nx\n```\n")
    found = mod.blocks("p.md")
    assert [(b.line, b.info, b.language, b.is_example, b.is_commands) for b in found] == [
        (3, "bash example", "bash", True, True), (8, "bash", "bash", False, True),
        (16, "text", "text", False, False), (21, "", "", False, True)]
    assert found[1].commands() == ["python -m a --flag   # comment", "python -m b"]
    assert found[1].first_command == "python -m a --flag"
    assert found[2].text == "```\nnot a fence end"
