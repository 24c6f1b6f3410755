"""Which run directory a run under Slurm uses: the job's own, or a fresh one (rank 0 only).

The rule itself is `hpc_rlx.config.fingerprint.choose_job_dir`; this module reads what it needs from
the environment (the job id, the restart count), the composed config and the checkpoints of
the job's earlier directories. `slurm/train.sh` asks the same question before it launches::

    python -m hpc_rlx.rundirs [OVERRIDES...]      # prints outputs/slurm-<jobid>[.<n>]
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

from hpc_rlx.checkpoint import CheckpointManager, checkpoints_dir
from hpc_rlx.checkpoint.h5file import read_meta
from hpc_rlx.config import CONFIG_DIR
from hpc_rlx.config.fingerprint import UNKNOWN, choose_job_dir, config_fingerprint, job_dir_number
from hpc_rlx.config.schema import default
from hpc_rlx.base.errors import CheckpointError

log = logging.getLogger(__name__)

RUNS_ROOT = "outputs"        # hydra.run.dir's default is outputs/${rlx_run_id:}
SWEEPS_ROOT = "multirun"     # hydra.sweep.dir's default is multirun/${rlx_run_id:}
LAST_CHOICE: str | None = None   # why slurm_run_id chose what it did (for hpc_rlx's debug log)


def slurm_base(env=os.environ) -> str | None:
    """slurm-<jobid>[_<array task>], or None outside a Slurm job."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    task = env.get("SLURM_ARRAY_TASK_ID")
    return f"slurm-{job}_{task}" if task else f"slurm-{job}"


def requeued(env=os.environ) -> bool:
    try:
        return int(env.get("SLURM_RESTART_COUNT") or 0) > 0
    except ValueError:
        return False


def recorded_fingerprint(run_dir: Path):
    """The config fingerprint in the newest readable checkpoint of `run_dir`, or UNKNOWN."""

    manager = CheckpointManager(checkpoints_dir(run_dir))
    for step in reversed(manager.steps()):
        try:
            meta = read_meta(manager.path_for(step))
        except CheckpointError as e:
            log.debug("run-dir choice: %s", e)
            continue
        return meta.get("config_fingerprint") or UNKNOWN
    return UNKNOWN


def job_dirs(root: Path, base: str) -> dict:
    """{name: recorded fingerprint} of the job's directories under `root`."""
    try:
        names = [p.name for p in root.iterdir() if p.is_dir()]
    except OSError:
        return {}
    return {n: recorded_fingerprint(root / n) for n in names if job_dir_number(n, base) is not None}


def compose_config(overrides: list[str]) -> dict:
    """The resolved task config (no hydra section) for these command-line overrides."""
    # Hydra loads here, not at import: the ranks other than 0 import this module but never compose
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="hpc_rlx"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def graph_text(cfg: dict) -> str | None:
    """model=graph or onnx: the model file's content (the ONNX file's sha256), part of what the
    fingerprint covers: a changed model file is a new run, not a resume."""
    model = cfg.get("model") or {}
    path = model.get("path") if model.get("name") in ("graph", "onnx") else None
    if not path:
        return None
    try:
        if model.get("name") == "onnx":
            return "onnx sha256 " + hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
        return Path(path).expanduser().read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def fingerprint_of(cfg: dict) -> str:
    return config_fingerprint(cfg, graph_text=graph_text(cfg))


def slurm_run_id(argv: list[str], env=os.environ, root: str = RUNS_ROOT) -> str | None:
    """The run id (directory name under outputs/) for a run under Slurm, None outside Slurm.

    With flags (-m, --help, ...) or an explicit hydra.run.dir the job's base name is returned
    unchanged: a sweep has its own directories, and an explicit directory is the user's choice
    (resume=auto continues it). A config that does not compose also gets the base name; the
    run then reports the problem itself.
    """
    base = slurm_base(env)
    if base is None:
        return None
    if any(a.startswith("-") or a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" for a in argv):
        return base
    try:
        cfg = compose_config(argv)
    except Exception as e:  # noqa: BLE001 - the run composes again and reports it properly
        log.debug("run-dir choice: the config does not compose (%s); using %s", e, base)
        return base
    try:
        mine = fingerprint_of(cfg)
        existing = job_dirs(Path(root), base)
    except Exception as e:  # noqa: BLE001 - unreadable outputs/: the run reports what it meets
        log.debug("run-dir choice: cannot read the job's directories (%s); using %s", e, base)
        return base
    resume_auto = str(cfg.get("resume", default("resume"))).strip() == "auto"
    name, why = choose_job_dir(base, existing, mine, requeued(env), resume_auto)
    global LAST_CHOICE
    LAST_CHOICE = (f"{name}: {why} (this config {mine}; the job's directories "
                   f"{ {k: str(v) for k, v in existing.items()} })")
    log.debug("run-dir choice: %s", LAST_CHOICE)
    return name


def explicit_run_dir(argv: list[str]) -> str | None:
    for a in argv:
        key, _, value = a.partition("=")
        if key.lstrip("+") == "hydra.run.dir" and value:
            return value.strip("'\"")
    return None


def new_run_root(argv: list[str], rid: str) -> Path | None:
    """Before anything is written: the outermost directory this run will create for its run
    directory (e.g. outputs/ on a fresh checkout), or None if it exists or this is a sweep."""
    if any(a.startswith("-") for a in argv):
        return None
    return _outermost_new(Path(explicit_run_dir(argv) or f"{RUNS_ROOT}/{rid}").expanduser().absolute())


def _outermost_new(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist yet (None: `path` exists)."""
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def claim_timestamp_dir(argv: list[str], base: str) -> tuple[str, Path | None]:
    """Rank 0 outside Slurm: the run id `base` (rank 0's clock), or `base-<k>` if another run
    has it, and the outermost directory this run created (see `new_run_root`).

    The run directory is created here with an exclusive mkdir, so two runs started in the same
    second get two directories: a check followed by a later create would let both pass.
    A sweep claims its multirun/ directory the same way; a named hydra.run.dir claims nothing
    (its lock, `hpc_rlx.observe.run_lock`, keeps two jobs out of it)."""
    sweep = any(a in ("-m", "--multirun") for a in argv)
    if sweep:
        named = any(a.split("=", 1)[0].lstrip("+") == "hydra.sweep.dir" for a in argv)
    else:   # other flags (--help, --cfg) run no job
        named = explicit_run_dir(argv) is not None or any(a.startswith("-") for a in argv)
    if named:
        return base, new_run_root(argv, base)
    parent = Path(SWEEPS_ROOT if sweep else RUNS_ROOT).absolute()
    created = _outermost_new(parent)
    k, rid = 1, base
    while True:
        try:
            (parent / rid).mkdir(parents=True)
            break
        except FileExistsError:
            rid, k = f"{base}-{k}", k + 1
        except OSError:      # unwritable: Hydra reports it with the path
            return rid, None
    return rid, created or parent / rid


# What startup writes before training: Hydra's job log (<job name>.log), the write probe and
# the run directory's lock file.
_STARTUP_FILES = (".log", ".lock")


def remove_unused_run_dir(root: Path | None) -> bool:
    """A run that failed before training leaves no directory behind: remove `root` (from
    `new_run_root`) if it holds nothing but startup's files. Never raises."""
    if root is None or not root.is_dir():
        return False
    try:
        for path in root.rglob("*"):
            if path.is_file() and not path.name.endswith(_STARTUP_FILES) and \
                    not path.name.startswith(".write-test-"):
                return False
        shutil.rmtree(root)
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    explicit = explicit_run_dir(argv)
    if explicit:
        print(explicit)
        return 0
    rid = slurm_run_id(argv)
    if rid is None:
        print("hpc_rlx.rundirs: not in a Slurm job (no SLURM_JOB_ID); runs outside Slurm get a "
              "timestamped directory", file=sys.stderr)
        return 2
    print(f"{RUNS_ROOT}/{rid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
