"""Hydra launcher: every sweep point is its own Slurm batch job, an MPI job of N ranks.

    python -m hpc_rlx -m hydra/launcher=slurm optim.lr=0.1,0.05 policy=sync,cadence
    python -m hpc_rlx -m hydra/launcher=slurm hydra.launcher.nodes=2 hydra.launcher.partition=gpu ...

Each point is submitted as ``sbatch slurm/train.sh hydra.run.dir=<sweep dir>/<num> <overrides>``,
so it gets the batch script's environment setup, srun/mpirun detection, BLAS thread limits and
preemption handling, and a requeued point resumes from the checkpoints in its own directory.
The launching process waits for all points (polling squeue/scontrol) and reports each one's
final state; the sweep summary table is then written from the points' ``summary.json``.
"""


import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hpc_rlx.runtime.signals import python_interrupts
from hydra_plugins.hpc_rlx_slurm import slurm_jobs

log = logging.getLogger(__name__)


@dataclass
class SlurmLauncherConf:
    _target_: str = "hydra_plugins.hpc_rlx_slurm.launcher.SlurmLauncher"
    # batch script run for each point; null = this project's slurm/train.sh
    script: Optional[str] = None
    # resources of ONE point; these override the script's #SBATCH header
    nodes: int = 1
    ntasks_per_node: int = 4
    cpus_per_task: int = 1
    gpus_per_node: Optional[int] = None
    time: Optional[str] = "01:00:00"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    mem: Optional[str] = None
    constraint: Optional[str] = None
    # Slurm job name; {num} is the point's number in the sweep
    job_name: str = "hpc_rlx-{num}"
    # further sbatch options, verbatim, e.g. ["--exclusive", "--reservation=ml"]
    sbatch_args: List[str] = field(default_factory=list)
    # extra environment variables for the jobs, e.g. {HPC_RLX_LAUNCHER: mpirun}
    env: Dict[str, str] = field(default_factory=dict)
    # at most this many points queued or running at once (null = submit them all)
    max_running: Optional[int] = None
    poll_interval_s: float = 5.0
    # stop waiting after this long, cancelling what is left (null = wait as long as it takes)
    timeout_min: Optional[float] = None
    cancel_on_interrupt: bool = True
    # the value a point returns to the sweeper: this key of summary.json's "final" record
    return_metric: str = "val_loss"


ConfigStore.instance().store(group="hydra/launcher", name="hpc_rlx_slurm",
                             node=SlurmLauncherConf, provider="hpc_rlx")

# Hydra overrides of the launching command that describe the sweep itself, not a point's run.
_SWEEP_ONLY = ("hydra/launcher", "hydra.launcher", "hydra/sweeper", "hydra.sweeper",
               "hydra.sweep", "hydra.run", "hydra.mode", "hydra.job.num", "hydra.job.id")


class SweepPointFailed(RuntimeError):
    """A sweep point's Slurm job did not finish with a result; the message says why."""


@dataclass
class _Point:
    num: int
    overrides: List[str]
    directory: Path
    job_name: str
    command: List[str]
    config: DictConfig
    job_id: Optional[str] = None
    state: Optional[slurm_jobs.JobState] = None
    last_seen: str = ""

    @property
    def log_path(self) -> Path:
        return self.directory / f"slurm-{self.job_id}.out"

    def label(self) -> str:
        shown = " ".join(filter_overrides(self.overrides)) or "(defaults)"
        return f"#{self.num} ({shown})"


def passthrough_hydra_overrides(overrides: Sequence[str]) -> List[str]:
    """The launching command's Hydra overrides that still apply inside each point's job."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if not key.startswith(_SWEEP_ONLY):
            kept.append(item)
    return kept


def default_script() -> Path:
    """slurm/train.sh of the source tree this plugin lives in, else of the working directory."""
    candidates = [Path(__file__).resolve().parents[2] / "slurm" / "train.sh",
                  Path.cwd() / "slurm" / "train.sh"]
    for path in candidates:
        if path.is_file():
            return path
    raise SweepPointFailed("hydra/launcher=slurm: no batch script found at "
                           + " or ".join(str(c) for c in candidates)
                           + "; set hydra.launcher.script=/path/to/train.sh")


class SlurmLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.params = OmegaConf.to_container(OmegaConf.create(params), resolve=True)
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    # ------------------------------------------------------------------ points
    def _script(self, cwd: Path) -> str:
        script = self.params.get("script")
        if not script:
            return str(default_script())
        path = Path(script).expanduser()
        path = path if path.is_absolute() else cwd / path
        if not path.is_file():
            raise SweepPointFailed(f"hydra.launcher.script={script}: no such file ({path})")
        return str(path)

    def _point(self, num: int, overrides: Sequence[str], script: str, cwd: Path) -> _Point:
        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{num}"
            sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(sweep_config)
        directory = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
        directory = directory if directory.is_absolute() else cwd / directory
        p = self.params
        try:
            job_name = str(p["job_name"]).format(num=num)
        except (KeyError, IndexError, ValueError):
            job_name = str(p["job_name"])
        args = [f"hydra.run.dir={slurm_jobs.hydra_value(str(directory))}"]
        args += passthrough_hydra_overrides(list(self.config.hydra.overrides.hydra))
        args += list(overrides)
        command = slurm_jobs.sbatch_command(
            script=script, script_args=args, job_name=job_name,
            output=str(directory / "slurm-%j.out"), chdir=str(cwd), nodes=p["nodes"],
            ntasks_per_node=p["ntasks_per_node"], cpus_per_task=p["cpus_per_task"],
            time=p.get("time"), gpus_per_node=p.get("gpus_per_node"), partition=p.get("partition"),
            account=p.get("account"), qos=p.get("qos"), mem=p.get("mem"),
            constraint=p.get("constraint"), extra=p.get("sbatch_args") or ())
        return _Point(num, list(overrides), directory, job_name, command, sweep_config)

    # ------------------------------------------------------------------ launch
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        cwd = Path(str(self.config.hydra.runtime.cwd))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir = sweep_dir if sweep_dir.is_absolute() else cwd / sweep_dir
        sweep_dir.mkdir(parents=True, exist_ok=True)
        script = self._script(cwd)
        points = [self._point(initial_job_idx + i, ov, script, cwd) for i, ov in enumerate(job_overrides)]
        env = slurm_jobs.job_environment(os.environ, self.params.get("env"))
        p = self.params
        log.info(f"Submitting {len(points)} sweep points as Slurm jobs of {p['nodes']} node(s) x "
                 f"{p['ntasks_per_node']} ranks, script {script}, sweep dir {sweep_dir}")
        self._run_all(points, env)
        returns = [self._job_return(pt) for pt in points]
        failed = [r for r in returns if r.status != JobStatus.COMPLETED]
        if failed:
            log.error(f"{len(failed)} of {len(points)} sweep points failed")
            self._write_summary(sweep_dir)
        return returns

    def _run_all(self, points: List[_Point], env: Dict[str, str]) -> None:
        p = self.params
        max_running = p.get("max_running") or len(points)
        poll_s = max(0.2, float(p.get("poll_interval_s") or 5.0))
        deadline = None
        if p.get("timeout_min"):
            deadline = time.monotonic() + 60.0 * float(p["timeout_min"])
        waiting = list(points)
        active: Dict[str, _Point] = {}
        python_interrupts()    # Ctrl-C must reach the `except` below, which cancels the jobs
        try:
            while waiting or active:
                while waiting and len(active) < max_running:
                    self._submit(waiting.pop(0), env, active)
                for job_id, state in slurm_jobs.poll(list(active), env).items():
                    pt = active[job_id]
                    if state.state != pt.last_seen:
                        pt.last_seen = state.state
                        extra = f" ({state.reason})" if state.reason and state.reason != "None" else ""
                        log.info(f"Slurm job {job_id}, sweep point {pt.label()}: {state.state}{extra}")
                    if state.done:
                        pt.state = state
                        del active[job_id]
                if not (waiting or active):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    log.error(f"hydra.launcher.timeout_min={p['timeout_min']} reached: cancelling "
                              f"jobs {', '.join(active) or '(none)'}; {len(waiting)} points never submitted")
                    slurm_jobs.cancel(list(active), env)
                    for pt in list(active.values()) + waiting:
                        pt.state = slurm_jobs.JobState(pt.job_id or "-", "TIMEOUT",
                                                       reason="launcher timeout_min reached")
                    return
                time.sleep(poll_s)
        except (KeyboardInterrupt, slurm_jobs.SlurmCommandError):
            if active and p.get("cancel_on_interrupt", True):
                log.error(f"cancelling Slurm jobs {', '.join(active)}")
                slurm_jobs.cancel(list(active), env)
            raise

    def _submit(self, pt: _Point, env: Dict[str, str], active: Dict[str, _Point]) -> None:
        pt.directory.mkdir(parents=True, exist_ok=True)
        # the sweep summary reads each point's overrides from here
        (pt.directory / "overrides.txt").write_text(" ".join(pt.overrides) + "\n")
        pt.job_id = slurm_jobs.submit(pt.command, env)
        active[pt.job_id] = pt
        log.info(f"\t#{pt.num} : {' '.join(filter_overrides(pt.overrides))} -> Slurm job {pt.job_id}, "
                 f"log {pt.log_path}")

    # ------------------------------------------------------------------ results
    def _job_return(self, pt: _Point) -> JobReturn:
        ret = JobReturn()
        ret.overrides = pt.overrides
        ret.cfg = pt.config
        ret.hydra_cfg = pt.config
        ret.working_dir = str(pt.directory)
        ret.task_name = pt.job_name
        state = pt.state or slurm_jobs.JobState(pt.job_id or "-", "UNKNOWN")
        summary_path = pt.directory / "summary.json"
        summary = None
        if summary_path.is_file():
            try:
                summary = json.loads(summary_path.read_text())
            except (OSError, ValueError):
                summary = None
        ok_state = state.state == "COMPLETED" or (state.state == "UNKNOWN" and summary is not None)
        if ok_state and summary is not None:
            ret.status = JobStatus.COMPLETED
            ret.return_value = (summary.get("final") or {}).get(self.params.get("return_metric", "val_loss"))
            return ret
        why = (f"Slurm job {state.job_id} ended {state.state}"
               + (f" with exit code {state.exit_code}" if state.exit_code else "")
               + (f" ({state.reason})" if state.reason and state.reason != "None" else ""))
        if ok_state:
            why += f", but wrote no {summary_path}"
        ret.status = JobStatus.FAILED
        ret.return_value = SweepPointFailed(
            f"sweep point {pt.label()}: {why}\nlog {pt.log_path}:\n{slurm_jobs.tail(pt.log_path)}")
        return ret

    @staticmethod
    def _write_summary(sweep_dir: Path) -> None:
        # A failed point stops Hydra before its end-of-sweep callbacks run: write the table here.
        try:
            from hpc_rlx.observe.sweep import write_summary
        except ImportError:
            return
        try:
            out = write_summary(sweep_dir)
            log.info(f"sweep summary (with the failed points): {out}")
        except OSError as exc:
            log.error(f"could not write the sweep summary in {sweep_dir}: {exc}")
