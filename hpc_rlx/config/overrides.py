"""Checking the command line's overrides once, on rank 0, before Hydra starts on every rank:
a bad override or an unusable run directory is one message instead of one per rank. The
doctor checks training overrides the same way."""

from __future__ import annotations

import re

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpc_rlx.config import CONFIG_DIR
from hpc_rlx.config.hints import flatten_keys, group_option_keys, suggest_keys
from hpc_rlx.config.schema import BY_PATH, GROUPS
from hpc_rlx.config.run_dir_check import check_run_dir_writable


def config_problem(argv: list[str]) -> str | None:
    """Rank 0 composes the config once before Hydra starts on every rank, so a bad override
    or an unusable run directory is one message instead of one per rank. None: all fine, or a
    case this check leaves to Hydra (flags such as --multirun, --help, --cfg)."""
    if any(a.startswith("-") for a in argv):
        return None
    def _compose(overrides):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="hpc_rlx"):
            return compose("config", overrides=overrides, return_hydra_config=True)

    try:
        cfg = _compose(argv)
    except MissingConfigException as e:
        missing = str(getattr(e, "missing_cfg_file", "") or "")
        options = list(getattr(e, "options", None) or [])
        if "/" in missing and options:
            group, name = missing.rsplit("/", 1)
            return (f"unknown option {name!r} for config group '{group}' "
                    f"({group}={name}); available: {', '.join(options)}")
        return _first_lines(str(e))
    except HydraException as e:
        text = str(e)
        m = re.match(r"Could not override '([^']+)'", text)
        if m:
            return _unknown_key(m.group(1), argv, _compose)
        return _first_lines(text)
    except OmegaConfBaseException as e:
        return _first_lines(str(e))
    except Exception:  # noqa: BLE001 - anything else is Hydra's to report
        return None
    # '+key=value' would add a key nothing reads: unknown keys are errors here.
    plain = [a for a in argv if not a.startswith("+")]
    for a in argv:
        if a.startswith("+") and not a.startswith("++") and "=" in a:
            key = a[1:].split("=", 1)[0]
            if "/" not in key and not key.startswith("hydra"):
                return _unknown_key(key, plain, _compose, added=a)
    try:
        unset = unset_values(cfg)
    except Exception:  # noqa: BLE001 - the spec's own checks report what is left
        unset = None
    if unset:
        return unset
    try:
        run_dir = str(cfg.hydra.run.dir)
    except Exception:  # noqa: BLE001
        return None
    try:
        check_run_dir_writable(run_dir)
    except Exception as e:  # noqa: BLE001
        return f"{e} (set hydra.run.dir to a writable directory)"
    return None


def unset_values(cfg) -> str | None:
    """Keys the chosen group options leave for the user (`???`, e.g. `data.path` of
    `data=file`) and the command line did not set, or None."""
    missing = sorted(k for section in cfg if section != "hydra"
                     and OmegaConf.is_config(cfg[section]) for k in OmegaConf.missing_keys(cfg[section]))
    if not missing:
        return None
    wants = []
    for path in missing:
        group, _, _ = path.partition(".")
        selector = GROUPS.get(group, (None,))[0]
        option = OmegaConf.select(cfg, f"{group}.{selector}", default=None) if selector else None
        declared = BY_PATH.get(path)
        what = f" ({declared.doc})" if declared is not None else ""
        wants.append(f"{group}={option} needs {path}=<value>{what}" if option
                     else f"{path} needs a value{what}")
    return "; ".join(wants) + ": set it on the command line"


def _first_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()][:n]
    return "\n".join(lines)


def _unknown_key(key: str, argv: list[str], compose, added: str | None = None) -> str:
    """'unknown config key' with the closest real keys, from a config composed without it."""
    override = added or next((a for a in argv if a.split("=", 1)[0].lstrip("+~") == key), key)
    known: list[str] = []
    choices: dict = {}
    try:
        rest = [a for a in argv if a.split("=", 1)[0].lstrip("+~") != key]
        cfg = compose(rest)
        flat = OmegaConf.to_container(cfg, resolve=False)
        choices = flat.pop("hydra", {}).get("runtime", {}).get("choices", {})
        known = flatten_keys(flat)
    except Exception:  # noqa: BLE001 - suggestions are a bonus
        pass
    try:
        other_options = group_option_keys(CONFIG_DIR)
        close = suggest_keys(key, known, other_options)
    except Exception:  # noqa: BLE001
        other_options, close = {}, []
    if key in other_options and key not in known:
        # the key is right, the selected option lacks it (model.num_classes with model=onnx)
        group = key.split(".", 1)[0]
        selected = f"{group}={choices[group]}" if choices.get(group) else f"the {group} selected now"
        return (f"config key {key!r} (from {override!r}) is not read with {selected}, "
                f"only with {' or '.join(other_options[key])}")
    hint = f"; did you mean {' or '.join(close)}?" if close else "."
    return (f"unknown config key {key!r} (from {override!r}){hint} "
            f"hpc_rlx rejects keys it does not read: see configs/config.yaml and configs/<group>/")
