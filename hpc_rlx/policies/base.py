"""The policy interface: what the training loop asks of a policy, and what a policy may use.

A policy decides how an epoch's steps turn into synchronised parameters (`sync`: one
gradient Allreduce per step; `cadence` and `async`: local steps, then one fused sync). The
loop (`train.Run`) knows policies only through `Policy`; a policy knows the loop only through
`TrainingLoop`, the few things it needs. Adding a policy: one module defining a `Policy`
subclass, and one line in `registry.POLICIES`.

Nothing here touches MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from hpc_rlx.comm.bucket_layout import STEP_FIELDS

from ..errors import ConfigError


@dataclass
class EpochTotals:
    """Global totals of the epoch being trained, filled by the policy step by step."""
    samples: float = 0.0
    loss_sum: float = 0.0
    correct: float = 0.0
    steps: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_wall_s: float = 0.0
    data_s: float = 0.0          # batch gathering (and, with data.cache=stream, waiting for it)
    extra: dict = field(default_factory=dict)     # policy-specific keys of the epoch record
    complete: bool = False       # a windowed policy consumed the whole epoch (even if stopping)


class TrainingLoop(Protocol):
    """The part of the training loop a policy may use (and nothing more)."""

    worker: Any            # per-rank state: spec, comm, params, bucket, data, step/epoch position
    lanes: Any          # the compute lanes: `step(x, y, seed)`, `refresh_device_params()`
    rank: int
    is_root: bool
    on_nonfinite: str   # train.on_nonfinite: "stop" or "skip"
    faults: Any         # debug.fail_*: `faults.at("step", step)` (does nothing unless asked)

    def epoch_totals(self) -> EpochTotals:
        """Totals for the epoch about to be trained (a resumed epoch's carried in)."""

    def dropout_seed(self) -> int:
        """The seed of this step's dropout masks."""

    def slowdown(self, compute_s: float) -> None:
        """debug.slowdown's extra wall time after a step of `compute_s`."""

    def control_flags(self, nonfinite: bool = False) -> dict:
        """This rank's control flags for the next sync: stop, nonfinite, ckpt_due (0.0 or 1.0)."""

    def fill_flags(self, loss_sum: float) -> None:
        """Write this rank's control flags into the bucket's tail."""

    def read_flags(self) -> dict:
        """The reduced control flags from the bucket's tail."""

    def stop(self, reason: str) -> None:
        """End the run after this step (`nonfinite`, `signal`, `max_steps`)."""

    def after_step(self, n: int, loss: float, compute: float, comm_s: float) -> None:
        """Bookkeeping and progress after a step or window."""

    def should_stop_after_step(self, flags: dict) -> bool:
        """Checkpoint if due; whether the run stops here."""


class Policy:
    """Base of every policy. Subclasses set `name` and `defaults` and implement `run_epoch`.

    Class level (no MPI): `defaults` are the `policy.*` keys the policy takes with their
    default values, `key_docs` one line of documentation each (docs/config.md's table);
    `check_config` normalises and checks them (raising ConfigError).
    Instance level: `run_epoch` trains one epoch through a `TrainingLoop`.
    """

    name: str = ""
    defaults: Mapping[str, Any] = {}
    key_docs: Mapping[str, str] = {}
    # Whether `worker.step_in_epoch` counts global batches (every step a sync). Then a mid-epoch
    # position names the same batch after a resume, and a checkpoint due at the epoch's last
    # step waits for the epoch's validation, so a resume does not redo the epoch's end.
    steps_are_batches: bool = False
    # The tail slots this policy writes in the fused bucket (`comm.bucket_layout`): summed
    # fields, and per-rank fields of one slot per rank. The worker lays out its one bucket
    # with them at start-up, after the payload.
    bucket_fields: tuple[str, ...] = STEP_FIELDS
    bucket_rank_fields: tuple[str, ...] = ()

    def __init__(self, spec):
        self.spec = spec

    # ---- config (class level, pure) ---------------------------------------------------
    @classmethod
    def check_config(cls, cfg: dict) -> dict:
        """`cfg` has every key of `defaults` (user values over defaults): return it checked."""
        return {"name": cls.name}

    @classmethod
    def complete_config(cls, policy: Mapping[str, Any]) -> dict:
        """`policy.*` as given, checked and completed with the defaults."""
        unknown = sorted(set(policy) - set(cls.defaults) - {"name"})
        if unknown:
            raise ConfigError(f"policy={cls.name} does not take {unknown}; its keys are "
                              f"{sorted(['name', *cls.defaults])}")
        cfg = dict(cls.defaults)
        cfg.update({k: v for k, v in policy.items() if k != "name"})
        return cls.check_config(cfg)

    @classmethod
    def build_controller(cls, cfg: Mapping[str, Any], world_size: int):
        """The step-count controller of a windowed policy."""
        raise ConfigError(f"policy={cls.name!r} has no step-count controller")

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ---- what the loop shows and records -----------------------------------------------
    def epoch_fraction(self, worker) -> float:
        """How much of the current epoch is trained (progress display, partial epochs)."""
        return worker.step_in_epoch / max(1, worker.steps_per_epoch)

    def current_lr(self, worker) -> float | None:
        """The learning rate of the step just taken."""
        return worker.lr_at(max(worker.step - 1, 0))

    def step_label(self, worker) -> str:
        """The progress display's position within the epoch."""
        return f"sync {worker.step_in_epoch}"

    def epoch_record(self, totals: EpochTotals) -> dict:
        """Keys this policy adds to the epoch's metrics record."""
        return dict(totals.extra)

    # ---- training -----------------------------------------------------------------------
    def run_epoch(self, loop: TrainingLoop, epoch: int, first_step: int) -> EpochTotals:
        raise NotImplementedError


def dropout_seed(seed: int, local_step: int, rank: int) -> int:
    """The seed of a step's dropout masks: distinct per run seed, step and rank."""
    return (int(seed) * 1_000_003 + local_step) * 4099 + rank


def checked_name(policy: Mapping[str, Any], names) -> str:
    if not isinstance(policy, Mapping):
        raise ConfigError(f"policy must be a mapping with a 'name', got {policy!r}")
    name = policy.get("name")
    if name not in names:
        raise ConfigError(f"policy={name!r} is not one of {tuple(names)}")
    return name
