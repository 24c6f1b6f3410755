"""Talking to Slurm from a login node: build an sbatch command, submit, poll, cancel.

No Hydra here. Job state comes from squeue/scontrol only, because many clusters (and the test
cluster) run no accounting database, so sacct cannot be relied on.
"""


import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

# A job in one of these states will not run again by itself.
TERMINAL = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "REVOKED",
})
# PREEMPTED is not terminal for a requeueable job: it comes back as PENDING with the same id.

# Environment of the submitting process that must not leak into the jobs: an enclosing job's or
# MPI launcher's identity would make the job's ranks believe they belong to another world.
_JOB_ENV_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID", "HYDRA_")
_JOB_ENV_KEEP = frozenset({"SLURM_CONF", "SLURM_MPI_TYPE", "SLURM_TIME_FORMAT"})

_SAFE_OVERRIDE_VALUE = re.compile(r"^[A-Za-z0-9_\-+./:@%]+$")


class SlurmCommandError(RuntimeError):
    """An sbatch/squeue/scontrol call failed; the message has the command and its stderr."""


@dataclass
class JobState:
    job_id: str
    state: str              # Slurm's state name, or "UNKNOWN" once the controller forgot the job
    exit_code: str = ""     # "rc:signal" as scontrol prints it, when known
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL or self.state == "UNKNOWN"


def hydra_value(text: str) -> str:
    """Quote a string for the Hydra override grammar when it needs it (paths with spaces...)."""
    if _SAFE_OVERRIDE_VALUE.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sbatch_command(*, script: str, script_args: Sequence[str], job_name: str, output: str,
                   chdir: str, nodes: int, ntasks_per_node: int, cpus_per_task: int,
                   time: str | None = None, gpus_per_node: int | None = None,
                   partition: str | None = None, account: str | None = None,
                   qos: str | None = None, mem: str | None = None,
                   constraint: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The sbatch line for one job. Options given here override the script's #SBATCH header.
    A job that survives a dead rank (``comm.on_failure=shrink|spare``) asks Slurm not to end
    its allocation when a node fails (``--no-kill``)."""
    cmd = ["sbatch", "--parsable", f"--job-name={job_name}", f"--output={output}",
           f"--chdir={chdir}", f"--nodes={int(nodes)}", f"--ntasks-per-node={int(ntasks_per_node)}",
           f"--cpus-per-task={int(cpus_per_task)}"]
    if any(a in ("comm.on_failure=shrink", "comm.on_failure=spare") for a in script_args):
        cmd.append("--no-kill")
    optional = {"time": time, "gpus-per-node": gpus_per_node, "partition": partition,
                "account": account, "qos": qos, "mem": mem, "constraint": constraint}
    for name, value in optional.items():
        if value is not None and str(value) != "":
            cmd.append(f"--{name}={value}")
    cmd.extend(str(a) for a in extra)
    cmd.append(script)
    cmd.extend(script_args)
    return cmd


def job_environment(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict:
    """The environment sbatch exports to the job: ours, less job/MPI identity, plus `extra`."""
    env = {k: v for k, v in base.items()
           if k in _JOB_ENV_KEEP or not k.startswith(_JOB_ENV_PREFIXES)}
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


def _run(cmd: Sequence[str], env: Mapping[str, str] | None, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), env=None if env is None else dict(env),
                              capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise SlurmCommandError(f"{cmd[0]} not found on PATH: is this a Slurm login node?") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmCommandError(f"{' '.join(cmd)} did not answer within {timeout:.0f} s") from exc


def submit(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60.0) -> str:
    """Run sbatch --parsable; return the job id."""
    res = _run(cmd, env, timeout)
    if res.returncode != 0:
        raise SlurmCommandError(f"sbatch refused the job (exit {res.returncode}): "
                                f"{res.stderr.strip() or res.stdout.strip()}\ncommand: {' '.join(cmd)}")
    # --parsable prints "id" or "id;cluster"
    job_id = res.stdout.strip().splitlines()[-1].split(";")[0].strip() if res.stdout.strip() else ""
    if not job_id.isdigit():
        raise SlurmCommandError(f"sbatch printed no job id: {res.stdout!r} {res.stderr!r}")
    return job_id


def parse_scontrol(text: str) -> dict:
    """`scontrol show job -o ID` prints Key=Value pairs on one line."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def parse_squeue(text: str) -> dict[str, tuple[str, str]]:
    """Lines of `squeue --format=%i|%T|%r`: {job id: (state, reason)}."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0]:
            out[parts[0]] = (parts[1].strip().upper(), parts[2].strip() if len(parts) > 2 else "")
    return out


def job_detail(job_id: str, env: Mapping[str, str] | None = None, timeout: float = 30.0) -> JobState:
    res = _run(["scontrol", "show", "job", "-o", job_id], env, timeout)
    if res.returncode != 0 or not res.stdout.strip():
        # Purged from the controller (MinJobAge): its outcome must come from its files.
        return JobState(job_id, "UNKNOWN", reason=res.stderr.strip())
    f = parse_scontrol(res.stdout)
    return JobState(job_id, f.get("JobState", "UNKNOWN").upper(), f.get("ExitCode", ""),
                    f.get("Reason", ""))


def poll(job_ids: Iterable[str], env: Mapping[str, str] | None = None,
         timeout: float = 60.0) -> dict[str, JobState]:
    """States of the given jobs; finished ones come with their exit code."""
    ids = sorted(set(job_ids), key=int)
    if not ids:
        return {}
    res = _run(["squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}",
                "--format=%i|%T|%r"], env, timeout)
    listed = parse_squeue(res.stdout) if res.returncode == 0 else {}
    states = {}
    for job_id in ids:
        if job_id in listed and listed[job_id][0] not in TERMINAL:
            state, reason = listed[job_id]
            states[job_id] = JobState(job_id, state, reason=reason)
        else:
            # finished, or squeue refused the list because one id is already purged
            states[job_id] = job_detail(job_id, env)
    return states


def cancel(job_ids: Iterable[str], env: Mapping[str, str] | None = None) -> None:
    ids = list(job_ids)
    if ids:
        _run(["scancel", *ids], env, 60.0)


def tail(path: str | os.PathLike, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:])
