"""Segments of a run directory: each run that trains in it (the first, then every resume).

The first segment's config is ``config.yaml`` and is never overwritten; segment k >= 2 writes
``config.segment-<k>.yaml`` and a record in ``metrics.jsonl`` that says where it started and
which settings changed::

    {"event": "segment", "segment": 2, "config": "config.segment-2.yaml", "start_step": 440,
     "start_epoch": 20, "resumed_from": ".../ckpt-00000440.h5", "world_size": 4,
     "changed": {"optim.lr": [0.1, 0.05], "train.epochs": [20, 30]}}

Records with an "event" key are not epochs: readers of epoch records skip them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.config.fingerprint import changed_settings, describe_changes
from hpc_rlx.config.schema import complete

_SEGMENT_CONFIG = re.compile(r"config\.segment-(\d+)\.yaml")


def segment_config_name(k: int) -> str:
    return names.CONFIG if k == 1 else f"config.segment-{k}.yaml"


def existing_segments(run_dir: Path) -> list[int]:
    """Segment numbers whose config is in `run_dir`, ascending."""
    if not (run_dir / names.CONFIG).is_file():
        return []
    later = [int(m.group(1)) for p in run_dir.iterdir() if (m := _SEGMENT_CONFIG.fullmatch(p.name))]
    return [1] + sorted(later)


def _load_yaml(text: str | None) -> dict | None:
    if not text:
        return None
    import yaml   # here: rank 0 alone compares segment configs
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def _changed(before: dict | None, after: dict | None) -> dict:
    """The settings that differ, each side read with the declared defaults filled in: a key
    that an older checkpoint's config lacks is no change while it sits at its default."""
    return changed_settings(complete(before) if before else before, complete(after) if after else after)


def start_segment(run_dir: Path, config_yaml: str, *, resumed_from: str | None,
                  resumed_config_yaml: str | None, start_step: int, start_epoch: int,
                  world_size: int) -> dict | None:
    """Write this segment's config; for a later segment return its metrics.jsonl record.

    `changed` compares with what the resumed checkpoint trained with, else with the config
    of the previous segment in this directory.
    """
    done = existing_segments(run_dir)
    k = (done[-1] + 1) if done else 1
    (run_dir / segment_config_name(k)).write_text(config_yaml)
    if k == 1:
        return None
    before = resumed_config_yaml
    if not before:
        try:
            before = (run_dir / segment_config_name(done[-1])).read_text()
        except OSError:
            before = None
    changed = _changed(_load_yaml(before), _load_yaml(config_yaml))
    return {"event": "segment", "segment": k, "config": segment_config_name(k),
            "start_step": int(start_step), "start_epoch": int(start_epoch),
            "resumed_from": resumed_from, "world_size": int(world_size), "changed": changed}


def describe(record: dict) -> str:
    how = (f"resumed from {record['resumed_from']} at step {record['start_step']}"
           if record.get("resumed_from") else "started over (no checkpoint resumed)")
    return (f"segment {record['segment']} of this run directory: {how}; config in "
            f"{record['config']}; changed settings: {describe_changes(record['changed'])}")


def dumps(record: dict) -> str:
    return json.dumps(record, default=str)
