"""TensorBoard event files of a run: `RUN_DIR/tensorboard/events.out.tfevents.*` (rank 0).

Written with tensorboardX (its writer queues events and a background thread writes them, so a
step pays for building a few small protobufs only, and only at the step log's bounded rate):

- `train/<step_key>` of every metric with a step key (`observe.metrics`: `train/loss`,
  `train/lr`, `train/samples_per_s`) at the steps `step_log.StepSampler` picks;
- per epoch `val/loss`, `val/accuracy` and `epoch/<epoch_key>` of every metric with an epoch
  key (`epoch/train_loss`, `epoch/train_accuracy`, `epoch/lr`, `epoch/samples_per_s`), at the
  epoch's last global step;
- the run's hyper-parameters (the HParams dashboard), with `val/loss` and `val/accuracy` as its
  metrics, so `tensorboard --logdir outputs/` compares runs and `--logdir multirun/` the
  points of a sweep.

`report.tensorboard`: `auto` (write when tensorboardX is installed), `true` (an error when it
is not), `false`.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.config.tensorboard_setting import import_writer
from hpc_rlx.observe.metrics import METRICS
from hpc_rlx.observe.metrics.validation import VAL_TAGS

HPARAM_GROUPS = ("model", "data", "optim", "policy", "train", "device", "comm")
HPARAM_METRICS = ("val/loss", "val/accuracy")
VALIDATION_TAGS = VAL_TAGS      # metrics.jsonl key: tag (val_loss: val/loss, val_iou: val/iou, ...)


def flat_hparams(config: dict, world_size: int) -> dict:
    """The run's settings as TensorBoard hyper-parameters: `group.key` -> number, bool or
    string (lists and nulls as text)."""
    out: dict = {"world_size": int(world_size)}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, bool) or isinstance(value, (int, float, str)):
            out[prefix] = value
        else:
            out[prefix] = json.dumps(value)

    for group in HPARAM_GROUPS:
        if isinstance(config.get(group), dict):
            walk(group, config[group])
    return out


class TensorBoardLog:
    """Rank 0's event file writer for one run segment."""

    def __init__(self, run_dir, hparams: dict):
        SummaryWriter, hparams_summary = import_writer()
        self.dir = Path(run_dir) / names.TENSORBOARD
        self.writer = SummaryWriter(logdir=str(self.dir), flush_secs=10)
        exp, ssi, self._sei = hparams_summary(hparams, {k: 0.0 for k in HPARAM_METRICS})
        self.writer.file_writer.add_summary(exp)
        self.writer.file_writer.add_summary(ssi)

    def step(self, step: int, values: dict) -> None:
        """A step record's metrics (`metrics.step_values`)."""
        for key, value in values.items():
            if _is_number(value):
                self.writer.add_scalar(f"train/{key}", value, step)

    def epoch(self, rec: dict) -> None:
        """An epoch's record (metrics.jsonl's): validation and every metric with an epoch key."""
        step = int(rec["step"])
        tags = dict(VALIDATION_TAGS, **{m.epoch_key: f"epoch/{m.epoch_key}" for m in METRICS if m.epoch_key})
        for key, tag in tags.items():
            if _is_number(rec.get(key)):
                self.writer.add_scalar(tag, rec[key], step)

    def event(self, rec: dict) -> None:
        """A record that is not an epoch (metrics.jsonl's `{"event": ...}`), marked at its step:
        its fields as text under `events/<event>`, and for a failure the world size after it
        as the scalar `events/world_size`, a step down in the plot where ranks were lost."""
        step = int(rec.get("step") or 0)
        fields = {k: v for k, v in rec.items() if k != "event"}
        self.writer.add_text(f"events/{rec['event']}", json.dumps(fields, sort_keys=True), step)
        if rec["event"] == "failure" and _is_number(rec.get("world_size_after")):
            self.writer.add_scalar("events/world_size", rec["world_size_after"], step)

    def close(self) -> None:
        self.writer.file_writer.add_summary(self._sei)
        self.writer.close()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
