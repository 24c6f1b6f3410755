"""Which launcher started this process, and whether its output reaches a terminal.

A progress bar (carriage returns, escape codes) belongs on an interactive terminal only. The
process's own `isatty()` is not enough to tell:

- Open MPI gives every rank a pseudo-terminal, so `isatty()` is true under `mpirun` even when
  mpirun's output goes to a file (`mpirun ... > log`, a Slurm batch log); and its output
  forwarding holds a partial line until its newline (measured with Open MPI 5.0), so a bar
  could not redraw anyway: under Open MPI `auto` means lines;
- MPICH's hydra hands every rank a pipe, so `isatty()` is false even in an interactive shell,
  where hydra forwards a bar to the terminal as it is written: under MPICH the launcher's own
  stdout decides. The first ancestor process that is a launcher (`mpirun`, `mpiexec`, ...) is
  found through /proc and its fd 1 looked at; when that cannot be read, the answer is lines.

A Slurm job step without a pseudo-terminal (`sbatch`, `srun` without `--pty`) always gets lines.
`decide_display` is the rule; `launcher_stdout_is_terminal` reads /proc.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

# Process names of MPI launchers whose stdout is the job's output.
LAUNCHER_NAMES = frozenset({"mpirun", "mpiexec", "mpiexec.hydra", "prterun", "orterun", "prte"})


def detect_launcher(env: Mapping[str, str]) -> str | None:
    """`openmpi`, `mpich` (hydra and other PMI-1 launchers) or None (a plain process), from
    the variables each launcher sets in its ranks' environment."""
    if any(k.startswith("OMPI_COMM_WORLD_") for k in env) or "PMIX_RANK" in env:
        return "openmpi"
    if "PMI_RANK" in env or "HYDI_CONTROL_FD" in env or "PMI_FD" in env:
        return "mpich"
    return None


def in_slurm_step_without_terminal(env: Mapping[str, str]) -> bool:
    """A Slurm batch job or job step whose output goes to a file or a pipe (no `srun --pty`)."""
    return "SLURM_JOB_ID" in env and "SLURM_PTY_PORT" not in env


def decide_display(mode: str, env: Mapping[str, str], stdout_is_tty: bool,
                   launcher_tty: bool | None) -> str:
    """`bar` or `lines` for train.progress=MODE (auto|bar|lines).

    `stdout_is_tty`: this process's stdout; `launcher_tty`: the launcher's stdout (None when
    it is unknown). The rule for `auto`:
    1. a Slurm job step without a pseudo-terminal: lines;
    2. under Open MPI: lines (see the module's docstring);
    3. under MPICH (or another PMI launcher): a bar only if the launcher's stdout is a terminal;
    4. otherwise (a plain `python -m hpc_rlx`): a bar if stdout is a terminal.
    """
    if mode in ("bar", "lines"):
        return mode
    if in_slurm_step_without_terminal(env):
        return "lines"
    launcher = detect_launcher(env)
    if launcher == "openmpi":
        return "lines"
    if launcher is not None:
        return "bar" if launcher_tty else "lines"
    return "bar" if stdout_is_tty else "lines"


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def is_terminal_path(target: str) -> bool:
    """Whether a /proc/PID/fd link target is a terminal device."""
    return target.startswith(("/dev/pts/", "/dev/tty", "/dev/console"))


def launcher_stdout_is_terminal(max_depth: int = 12) -> bool | None:
    """Whether the nearest launcher ancestor's stdout is a terminal; None if there is no
    launcher among the ancestors or its fd 1 cannot be read."""
    pid = os.getppid()
    for _ in range(max_depth):
        if pid is None or pid <= 1:
            return None
        if _name(pid) in LAUNCHER_NAMES:
            try:
                return is_terminal_path(os.readlink(f"/proc/{pid}/fd/1"))
            except OSError:
                return None
        pid = _parent_pid(pid)
    return None


def display_for(mode: str, stream=None) -> str:
    """`bar` or `lines` for this process (see `decide_display`)."""
    stream = stream or sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    env = os.environ
    launcher_tty = launcher_stdout_is_terminal() if (mode == "auto" and detect_launcher(env) == "mpich") else None
    return decide_display(mode, env, tty, launcher_tty)
