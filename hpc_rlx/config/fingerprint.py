"""What makes two runs "the same training": a config fingerprint, and the run-directory rule
built on it. Pure functions of plain dicts and names (no files, no MPI).

Under Slurm every run of one job used to share ``outputs/slurm-<jobid>`` and ``resume=auto``
continued whatever ran there before, even with another learning rate. Now a run continues a
directory of its job only when it is that training continuing: a requeued job, or a checkpoint
whose fingerprint matches this config. Otherwise it gets a fresh ``slurm-<jobid>.<n>``.

The fingerprint covers the model (its config, and a graph file's content), the data files and
how they are split and shuffled, the optimizer and LR schedule (``optim``), the averaging
policy, and the batch size, seed and dtype. It leaves out what a continuation may change: the
world size, ``train.epochs``, ``train.max_steps``, threads, logging, checkpoint intervals,
devices and communication settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable

from hpc_rlx.policies.fragment_schedule import DEFAULT as DEFAULT_SCHEDULE

# keys of `train` and `data` that decide what is trained; whole `model`, `optim`, `policy`
_TRAIN_KEYS = ("batch_size", "seed", "dtype")
_DATA_KEYS = ("path", "val_path", "x", "y", "val_fraction", "leftover", "shuffle")
_PATH_KEYS = ("path", "val_path")


class Unknown:
    """A run directory whose fingerprint cannot be told: no checkpoint in it, or a checkpoint
    written before fingerprints were recorded."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = Unknown()


def _absolute(path, cwd: str | None):
    if not isinstance(path, str) or not path:
        return path
    path = os.path.expanduser(path)
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(cwd or os.getcwd(), path))


def fingerprint_record(cfg: dict, cwd: str | None = None, graph_text: str | None = None) -> dict:
    """The part of a resolved config (a plain dict, as composed) that the fingerprint hashes.

    Relative data paths count from `cwd` (default: the working directory), so the same file
    named two ways is the same data. graph_text: the content of `model.path` for model=graph.
    """
    data = dict((k, cfg.get("data", {}).get(k)) for k in _DATA_KEYS)
    if cfg.get("data", {}).get("one_sample_per_file"):
        # only when set: the fingerprints of configs without it stay what they were
        data["one_sample_per_file"] = True
    for key in _PATH_KEYS:
        data[key] = _absolute(data[key], cwd)
    model = dict(cfg.get("model") or {})
    optim = dict(cfg.get("optim") or {})
    if not optim.get("milestones"):
        optim.pop("milestones", None)       # unset (schedule=multistep's): fingerprints stay as they were
    for key in ("no_decay", "lr_mult"):
        if not optim.get(key):
            optim.pop(key, None)            # unset: fingerprints stay as they were
    policy = dict(cfg.get("policy") or {})
    if policy.get("fragment_schedule") == DEFAULT_SCHEDULE:
        policy.pop("fragment_schedule")     # the default: fingerprints stay as they were
    for key in ("freeze", "train_only"):
        if not model.get(key):
            model.pop(key, None)            # unset: fingerprints stay as they were
    if not (model.get("lora") or {}).get("rank"):
        model.pop("lora", None)             # LoRA off: fingerprints stay as they were
    if graph_text is not None:
        model["graph_sha256"] = hashlib.sha256(graph_text.encode("utf-8")).hexdigest()
    return {
        "model": model,
        "data": data,
        "optim": optim,
        "policy": policy,
        "train": {k: (cfg.get("train") or {}).get(k) for k in _TRAIN_KEYS},
    }


def _numbers_as_floats(value):
    # optim.lr=1 and optim.lr=1.0 are the same setting
    if isinstance(value, dict):
        return {k: _numbers_as_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_numbers_as_floats(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def config_fingerprint(cfg: dict, cwd: str | None = None, graph_text: str | None = None) -> str:
    """A short stable hash of `fingerprint_record` (key order and int/float spelling aside)."""
    record = _numbers_as_floats(fingerprint_record(cfg, cwd, graph_text))
    text = json.dumps(record, sort_keys=True, default=str, separators=(",", ":"))
    return "cfg-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def flatten(cfg, prefix: str = "") -> dict:
    """{'optim.lr': 0.1, ...}: nested dicts to dotted keys; lists stay values."""
    out = {}
    if not isinstance(cfg, dict):
        return {prefix.rstrip("."): cfg} if prefix else {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def changed_settings(old: dict | None, new: dict | None, ignore: Iterable[str] = ("hydra",)) -> dict:
    """{key: [old value, new value]} for every dotted key whose value differs (a key missing on
    one side reads as None), leaving out keys under `ignore`."""
    a, b = flatten(old or {}), flatten(new or {})
    skip = tuple(ignore)

    def ignored(key: str) -> bool:
        return any(key == s or key.startswith(s + ".") for s in skip)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b))
            if not ignored(k) and a.get(k) != b.get(k)}


def describe_changes(changed: dict, limit: int = 8) -> str:
    items = [f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()]
    more = f", and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more if items else "none"


def job_dir_number(name: str, base: str) -> int | None:
    """0 for `base`, n for `base.n`, None for any other name."""
    if name == base:
        return 0
    m = re.fullmatch(re.escape(base) + r"\.(\d+)", name)
    return int(m.group(1)) if m else None


def choose_job_dir(base: str, existing: dict, mine: str, requeued: bool, resume_auto: bool) -> tuple[str, str]:
    """(directory name, why) for a run of the Slurm job whose directories start with `base`.

    existing: {name: recorded fingerprint, or UNKNOWN} of this job's directories present.
    - resume=auto and a directory whose checkpoint has this fingerprint: continue there (the
      newest such), e.g. a longer run or a resume on another number of ranks;
    - a requeued job (SLURM_RESTART_COUNT > 0) whose newest directory cannot be told apart
      (no checkpoint yet, or one from an older hpc_rlx): continue there;
    - otherwise a fresh directory: `base` if free, else `base.<n>` past the highest n.
    """
    numbered = sorted((n, name) for name in existing
                      if (n := job_dir_number(name, base)) is not None)
    if resume_auto:
        for _, name in reversed(numbered):
            if existing[name] == mine:
                return name, f"its checkpoint has this config's fingerprint {mine}"
        if requeued and numbered and existing[numbered[-1][1]] is UNKNOWN:
            return numbered[-1][1], "the job was requeued (SLURM_RESTART_COUNT)"
    if not numbered:
        return base, "the job's first run"
    fresh = f"{base}.{numbered[-1][0] + 1}"
    why = ("resume is not auto" if not resume_auto else
           "no run directory of this job has a checkpoint of this config")
    return fresh, why
