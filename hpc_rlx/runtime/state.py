"""Where training is: the one writer of the global step, the epoch and the position within it.

Policies advance it, the loop ends epochs, a resume restores it; everything else reads it.
Its fields are also exactly what a checkpoint stores of the position (`checkpoint_meta`).
Pure: no MPI, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlx.base.errors import CheckpointError


@dataclass
class TrainState:
    epoch: int = 0              # epochs completed
    step: int = 0               # global optimizer steps (syncs, for windowed policies) taken
    step_in_epoch: int = 0      # of those, in the current epoch
    skipped_steps: int = 0      # steps skipped for non-finite values (train.on_nonfinite=skip)
    consecutive_skips: int = 0  # ... in a row, up to now (not checkpointed: a resume starts afresh)

    def step_taken(self, step_in_epoch: int | None = None) -> None:
        """One more step; `step_in_epoch` where the policy counts it itself (sync: batch index + 1)."""
        self.step += 1
        self.step_in_epoch = self.step_in_epoch + 1 if step_in_epoch is None else step_in_epoch

    def epoch_ended(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0

    def step_skipped(self) -> int:
        """Count a skipped step; returns how many in a row."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        return self.consecutive_skips

    def step_applied(self) -> None:
        self.consecutive_skips = 0

    def checkpoint_meta(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "step_in_epoch": self.step_in_epoch,
                "skipped_steps": self.skipped_steps}

    def restore(self, meta: dict, steps_per_epoch: int, where: str) -> None:
        """The position of a checkpoint's `meta` (see checkpoint_meta)."""
        step_in_epoch = int(meta["step_in_epoch"])
        if step_in_epoch > steps_per_epoch:
            raise CheckpointError(f"checkpoint {where} is at step {step_in_epoch} of an epoch "
                                  f"that now has {steps_per_epoch} steps")
        self.epoch, self.step, self.step_in_epoch = int(meta["epoch"]), int(meta["step"]), step_in_epoch
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.consecutive_skips = 0
