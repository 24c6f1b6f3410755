"""The policy interface: what the training loop asks of a policy, and what a policy may use.

A policy decides how an epoch's steps turn into synchronised parameters (`sync`: one
gradient Allreduce per step; `cadence` and `async`: local steps, then one fused sync). The
loop (`runtime.train.Run.train_epoch`) asks the policy for one step at a time and gets back a
`StepResult`: what the step did, as every rank knows it after the step's collective. The loop
owns the rest: the control flags, the epoch's totals, the display and the metrics records,
checkpoints and stopping. A policy knows the loop only through `Loop`, the few things a step
needs, a typed Protocol (`loop_contract.py`). Adding a policy: one module defining a `Policy`
subclass, and one line in `registry.POLICIES`.

Nothing here touches MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from hpc_rlx.comm.bucket_layout import STEP_FIELDS

from hpc_rlx.base.errors import ConfigError
from .loop_contract import Loop, LoopWorker


@dataclass
class StepResult:
    """What one step did: a sync step of `policy=sync`, or a window (local steps and their
    sync) of a windowed policy. The global numbers are the same on every rank."""
    flags: Mapping[str, bool]    # the reduced control flags: stop, nonfinite, ckpt_due
    samples: float = 0.0         # global samples counted in the epoch's means (0 for a skipped step)
    loss_sum: float = 0.0        # their summed loss
    correct: float = 0.0         # their correct predictions
    rank_samples: int = 0        # this rank's own samples in the step, and their mean loss
    rank_loss: float = 0.0
    compute_s: float = 0.0       # this rank's compute (debug.slowdown's sleep included)
    comm_s: float = 0.0          # ... in the step's collective
    data_s: float = 0.0          # ... gathering batches
    wall_s: float = 0.0          # ... in the whole step
    sums: dict = field(default_factory=dict)    # more global sums, for metrics (observe.metrics)


@dataclass
class EpochTotals:
    """Global totals of the epoch being trained: the sum of its `StepResult`s."""
    samples: float = 0.0
    loss_sum: float = 0.0
    correct: float = 0.0
    steps: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_wall_s: float = 0.0
    data_s: float = 0.0          # batch gathering (and, with data.cache=stream, waiting for it)
    sums: dict = field(default_factory=dict)      # StepResult.sums, summed
    extra: dict = field(default_factory=dict)     # policy-specific keys of the epoch record
    complete: bool = False       # a windowed policy consumed the whole epoch (even if stopping)

    def add(self, step: StepResult) -> None:
        self.samples += step.samples
        self.loss_sum += step.loss_sum
        self.correct += step.correct
        self.steps += 1
        self.compute_s += step.compute_s
        self.comm_s += step.comm_s
        self.step_wall_s += step.wall_s
        self.data_s += step.data_s
        for key, value in step.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def counts(self) -> dict:
        """The additive counts the metrics are computed from (`observe.metrics.Window`)."""
        return {"samples": self.samples, "loss_sum": self.loss_sum, "correct": self.correct,
                "steps": self.steps, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "step_wall_s": self.step_wall_s, "data_s": self.data_s, **self.sums}

    # A mid-epoch checkpoint carries the running totals, so a resumed epoch's record covers
    # all its steps (and samples_per_s stays samples over their step time).
    CARRIED = ("samples", "loss_sum", "correct", "steps", "compute_s", "comm_s", "step_wall_s")

    def carried(self) -> dict:
        out = {key: float(getattr(self, key)) for key in self.CARRIED}
        out["steps"] = int(self.steps)
        if self.sums:
            out["sums"] = dict(self.sums)
        return out

    @classmethod
    def from_carried(cls, carried: Mapping | None) -> "EpochTotals":
        totals = cls()
        for key in cls.CARRIED if carried else ():
            if key in carried:
                setattr(totals, key, int(carried[key]) if key == "steps" else float(carried[key]))
        if carried and carried.get("sums"):
            totals.sums = {k: float(v) for k, v in carried["sums"].items()}
        return totals


class Policy:
    """Base of every policy. Subclasses set `name` and `defaults` and implement `step`.

    Class level (no MPI): `defaults` are the `policy.*` keys the policy takes with their
    default values, `key_docs` one line of documentation each (docs/config.md's table);
    `check_config` normalises and checks them (raising ConfigError).
    Instance level: `step` trains one step through a `Loop`.
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
    # Whether every rank holds the same parameters after every step, so the ranks can hold one
    # slice of the optimizer state each (`comm.shard=optimizer`).
    shards_optimizer_state: bool = False
    bucket_fields: tuple[str, ...] = STEP_FIELDS
    bucket_rank_fields: tuple[str, ...] = ()
    # Whether each rank's optimizer state is its own (local steps between syncs): after a dead
    # rank the survivors all take rank 0's, as a resume on another world size does.
    own_optimizer_state: bool = False

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

    def rank_state(self, worker: LoopWorker) -> dict | None:
        """What this rank alone holds and a checkpoint must keep per rank ({"arrays",
        "scalars"}), or None: every rank holds the same (`checkpoint/rank_states.py`)."""
        return None

    def load_rank_state(self, state: dict | None) -> None:
        """This rank's own `rank_state` back from a checkpoint (None: another world size)."""

    # ---- after a dead rank (resilience/in_run.py) ----------------------------------------
    def rebuild(self, survivors) -> None:
        """`resilience.hooks.RankLossHook`, collective over `survivors.comm` once the worker
        re-planned the data over them: go on as a resume on that many ranks would, from the
        state of the survivor they continue from (`survivors.source`). Nothing here: every
        step ends agreed, and the worker holds all of it. (A policy whose ranks step apart
        marks where they agree, `Loop.restore_point`: what the recovery goes back to.)"""

    # ---- what the loop shows and records -----------------------------------------------
    def epoch_fraction(self, worker: LoopWorker) -> float:
        """How much of the current epoch is trained (progress display, partial epochs)."""
        return worker.step_in_epoch / max(1, worker.steps_per_epoch)

    def current_lr(self, worker: LoopWorker) -> float | None:
        """The learning rate of the step just taken."""
        return worker.lr_at(max(worker.step - 1, 0))

    def step_label(self, worker: LoopWorker) -> str:
        """The progress display's position within the epoch."""
        return f"sync {worker.step_in_epoch}"

    def epoch_record(self, totals: EpochTotals) -> dict:
        """Keys this policy adds to the epoch's metrics record."""
        return dict(totals.extra)

    # ---- training: the loop calls begin_epoch, then step until it returns None or the loop
    # stops, then end_epoch --------------------------------------------------------------
    def begin_epoch(self, loop: Loop, first_step: int) -> None:
        """An epoch (or the rest of a resumed one, from `first_step`) starts."""

    def step(self, loop: Loop) -> StepResult | None:
        """One step; None when the epoch has no step left."""
        raise NotImplementedError

    def end_epoch(self, loop: Loop, totals: EpochTotals, stopping: bool) -> None:
        """The epoch ends (`stopping`: the run stops in it): set `totals.extra`, and
        `totals.complete` when a run stopping here still consumed the whole epoch."""


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
