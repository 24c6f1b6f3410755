"""The README's Running section as pasted: activate first, the `hpc-rlx` command under mpirun,
and the bash completion it documents."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.jobs import PYTHON, REPO, launch_prefix, mpi_env

README = REPO / "README.md"
HPC_RLX = Path(PYTHON).with_name("hpc-rlx")
COMPLETION = 'eval "$(hpc-rlx -sc install=bash)"'


def running_section() -> str:
    text = README.read_text()
    start = text.index("\n## Running\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def venv_env() -> dict:
    """What `. .venv/bin/activate` gives: the venv's bin first on PATH."""
    env = mpi_env()
    env["PATH"] = f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(Path(PYTHON).parent.parent)
    return env


def code_lines(text: str) -> list[str]:
    """The lines inside the fenced code blocks, in order."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            out.append(line)
    return out


def test_running_section_activates_the_environment_before_the_first_mpirun():
    lines = code_lines(running_section())
    activate = next((i for i, line in enumerate(lines)
                     if re.fullmatch(r"\s*(\.|source) \.venv/bin/activate\s*", line)), None)
    first_mpirun = next(i for i, line in enumerate(lines) if line.lstrip().startswith("mpirun"))
    assert activate is not None, "the Running section never says `. .venv/bin/activate`"
    assert activate < first_mpirun, (lines[activate], lines[first_mpirun])


def test_readme_documents_the_console_script_and_its_completion():
    section = running_section()
    assert re.search(r"^mpirun -n \d+ hpc-rlx ", section, flags=re.M), "no `mpirun -n N hpc-rlx` command"
    assert COMPLETION in section
    assert "python -m hpc_rlx --shell-completion" in section      # and why it does not complete


@pytest.mark.mpi
def test_hpc_rlx_runs_a_tiny_job_under_mpirun(tmp_path, digits_h5):
    assert HPC_RLX.is_file(), f"{HPC_RLX} missing: pip install -e . declares it"
    line = next(ln for ln in running_section().splitlines() if re.match(r"mpirun -n \d+ hpc-rlx ", ln))
    args = line.split("#")[0].split()[4:]          # the README's overrides, as pasted
    cmd = launch_prefix(2) + ["hpc-rlx"] + args + [f"hydra.run.dir={tmp_path / 'run'}",
                                                    "report.plots=false", f"data.path={digits_h5}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=venv_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "run" / "summary.json")
    assert summary.is_file() and '"world_size": 2' in summary.read_text()


def _complete(line: str, setup: str) -> list[str]:
    """Run bash's completion function for `line` the way bash calls it on TAB."""
    script = f"""
{setup}
COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}; read -ra COMP_WORDS <<< "$COMP_LINE"
COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); COMPREPLY=()
hydra_bash_completion
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=venv_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [w for w in proc.stdout.split() if w]


def test_hpc_rlx_prints_hydras_completion_script_and_bash_completes_with_it():
    # the README's own line, as pasted
    setup = next((ln.split("#")[0].strip() for ln in code_lines(running_section()) if "-sc install=bash" in ln), None)
    assert setup == COMPLETION, setup
    proc = subprocess.run([str(HPC_RLX), "-sc", "install=bash"], cwd=REPO, env=venv_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "hydra_bash_completion" in proc.stdout and proc.stdout.rstrip().endswith("hpc-rlx")
    assert _complete("hpc-rlx optim=", setup) == ["optim=adamw", "optim=lamb", "optim=lars", "optim=lion", "optim=sgd"]
    assert "optim.lr=" in _complete("hpc-rlx optim.l", setup)
    # what the README says does not work: the script `python -m hpc_rlx` prints completes nothing
    assert _complete("python -m hpc_rlx optim=",
                     'eval "$(python -m hpc_rlx --shell-completion install=bash)"') == []
