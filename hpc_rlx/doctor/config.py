"""The training config as the doctor sees it: the same overrides, composition and validation
as `python -m hpc_rlx`, reduced to the settings the doctor checks."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hpc_rlx.config import CONFIG_DIR
from hpc_rlx.config.overrides import config_problem
from hpc_rlx.config.spec import validate_config
from hpc_rlx.base.errors import ConfigError


def training_settings(overrides: list[str]) -> dict:
    """The training settings the doctor checks (threads, devices, data) for these config overrides, composed and validated
    as `python -m hpc_rlx OVERRIDES` would; ConfigError with the training run's message."""
    problem = config_problem(overrides)   # the entry point's own message for a bad override
    if problem:
        raise ConfigError(problem)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="hpc_rlx"):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    cfg = validate_config(cfg)
    data = cfg["data"]
    # the files every reading rank opens; a dataset that is prepared on first use is not checked
    files = [] if data.get("prepare") else [p for p in (data["path"], data.get("val_path")) if p]
    return {"threads_per_rank": cfg["train"]["threads_per_rank"],
            "cpu_lanes": cfg["device"]["cpu_lanes"],
            # what each rank's lanes will be: device=cuda on a rank without a GPU stops the run
            "device_kind": cfg["device"]["kind"],
            "gpus_per_rank": cfg["device"]["gpus_per_rank"],
            "data_files": files,
            "data_distribution": data["distribution"]}


def split_run_dir(overrides: list[str]) -> tuple[list[str], str | None]:
    """hydra.run.dir=... is where the run would write: the doctor checks that directory."""
    rest, run_dir = [], None
    for o in overrides:
        if o.startswith("hydra.run.dir="):
            run_dir = o.split("=", 1)[1]
        else:
            rest.append(o)
    return rest, run_dir
