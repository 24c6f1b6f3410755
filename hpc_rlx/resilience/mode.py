"""What `comm.on_failure` means, read once per run, and what it cannot run with: `abort` (the
default: a dead rank ends the job), `shrink` (the survivors train on) or `spare` (a spare takes
a dead rank's shard). Every part of the run asks a `FailureMode`; none reads the key itself.
The schema declares the key and its choices (`config.schema.ON_FAILURE`).

`check_on_failure` refuses, on rank 0 while it builds the spec (`config.spec.build_spec`'s
`refusals`, before anything is read), what `shrink` and `spare` cannot run with yet, one line
each. Pure: whether MPI's fault tolerance (ULFM) is active is asked of every rank at start-up
(`resilience/in_run.py`). `abort` runs with everything. `shrink` and `spare` run, so far, where
the survivors can rebuild all they hold from the state every rank has and the survivors'
communicator: CPU lanes (any data distribution and cache, the bucket summed by any path but the
sharded one, overlapped or not) under `policy=sync`, and under `cadence` and `async` (whole
outer syncs; with `spare`, where no rank keeps state of its own from one sync to the next).
The rest is refused until it is rebuilt too.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.policies.fragments import Streaming
from hpc_rlx.policies.registry import POLICIES

MODES = {"abort": "a rank that dies ends the job (resume from the last checkpoint)",
         "shrink": "a rank that dies is dropped, the survivors train on (MPI's ULFM)",
         "spare": "a rank that dies is replaced by a spare, which takes its shard (MPI's ULFM)"}


@dataclass(frozen=True)
class FailureMode:
    """One run's `comm.on_failure` (`name`) and its `comm` section (for `comm.spares`)."""
    name: str
    comm: dict

    @classmethod
    def of(cls, comm_section) -> "FailureMode":
        """From a spec's (or a config's) `comm` section: the one reader of `comm.on_failure`."""
        return cls(comm_section.get("on_failure", "abort"), dict(comm_section))

    @property
    def active(self) -> bool:
        """Whether a dead rank is survived (shrink or spare), by MPI's ULFM."""
        return self.name != "abort"

    @property
    def has_spares(self) -> bool:
        return self.name == "spare"

    @property
    def spares(self) -> int:
        """`comm.spares`: the ranks, launched on top of the training ones, that wait."""
        return int(self.comm.get("spares") or 0)

    def training_ranks(self, ranks: int) -> int:
        """Of `ranks` ranks, the ones that train (`comm.spares` fewer under spare)."""
        return ranks - (self.spares if self.has_spares else 0)

    def spares_after(self, dead: int) -> int | None:
        """The spares left once `dead` ranks died before training (each takes a spare with it);
        None under shrink, which counts none."""
        return max(0, self.spares - dead) if self.has_spares else None

    def describe(self) -> str:
        return f"comm.on_failure={self.name}: {MODES[self.name]}"


def is_spare(rank: int, training: int) -> bool:
    """Whether `rank` is a spare (comm.on_failure=spare): the ranks past the `training` ones
    hold the model, take part in every collective with no rows, and train nothing until one
    takes a dead rank's place."""
    return rank >= training


# ---- what shrink and spare cannot run with yet (rank 0, as it builds the spec) ---------------

def check_on_failure(cfg: dict, world_size: int | None = None) -> None:
    """Refuse what `comm.on_failure` and `comm.spares` cannot run with (one line each) in the
    completed config `cfg`; `world_size`: the job's ranks, spares included (None: not checked
    against it)."""
    mode = FailureMode.of(cfg["comm"])
    name, spares = mode.name, mode.spares
    if spares and not mode.has_spares:
        raise ConfigError(f"comm.spares={spares} applies to comm.on_failure=spare, got "
                          f"comm.on_failure={name}")
    if mode.has_spares and spares < 1:
        raise ConfigError("comm.on_failure=spare needs comm.spares >= 1 (the ranks, launched on top of "
                          "the training ones, that wait to take a dead rank's place)")
    if mode.has_spares and world_size is not None and spares >= world_size:
        raise ConfigError(f"comm.spares={spares} leaves no rank to train on {world_size} ranks: launch "
                          f"{spares} more than the ranks that train (mpirun -n N+{spares})")
    if not mode.active:
        return
    why = shrink_refusal(cfg, name)
    if why is not None:
        raise ConfigError(f"comm.on_failure={name} does not run with {why}")
    if cfg["model"].get("sync_batch_norm"):
        raise ConfigError(f"model.sync_batch_norm=true does not run with comm.on_failure={name}: a rank lost "
                          f"inside a forward's batch-norm sum cannot be recovered from yet (use "
                          f"comm.on_failure=abort)")


def shrink_refusal(cfg: dict, mode: str = "shrink") -> str | None:
    """Why `comm.on_failure=<mode>` (shrink or spare) cannot run with `cfg` yet, in words, or
    None (pure)."""
    c = cfg["comm"]
    policy = cfg["policy"]
    stages = int(cfg["parallel"]["pipeline_stages"])
    device = cfg["device"]["kind"]
    windowed = not POLICIES[policy["name"]].steps_are_batches
    if windowed and mode == "spare" and policy.get("reset_inner") is not True:
        return (f"policy={policy['name']} without policy.reset_inner=true: a rank's inner optimizer state is "
                f"its own (local steps), and a spare cannot hold the dead rank's; set policy.reset_inner=true "
                f"(none is kept from one sync to the next), or use comm.on_failure=shrink")
    if windowed and mode == "spare" and policy.get("outer_wire_dtype") not in (None, "null", "none"):
        return (f"policy.outer_wire_dtype={policy['outer_wire_dtype']}: the coded outer wire's residuals are "
                f"a rank's own, and a spare cannot hold the dead rank's; use policy.outer_wire_dtype=null, "
                f"or comm.on_failure=shrink")
    if windowed and _streams(policy):
        return ("policy.fragments / policy.fragment_delay (streaming outer syncs): the fragments in "
                "flight are not dropped over the survivors; use policy.fragments=1 "
                "policy.fragment_delay=0")
    if stages > 1:
        return (f"parallel.pipeline_stages={stages}: a dead rank takes a stage's only copy with "
                f"it; use parallel.pipeline_stages=1")
    if device != "cpu":
        return f"device={device}: GPU lanes are not rebuilt after a failure yet; use device=cpu"
    if c.get("node_shared_params"):
        return ("comm.node_shared_params=true: a node's one copy of the parameters lives in a "
                "shared window that is not rebuilt yet; use comm.node_shared_params=false")
    if c.get("shard", "none") != "none":
        return (f"comm.shard={c['shard']}: a rank holds the only copy of its slice of the "
                f"optimizer state; use comm.shard=none")
    if cfg["trace"].get("enabled"):
        return "trace.enabled=true: the trace is not gathered over the survivors yet; use trace.enabled=false"
    return None


def _streams(policy: dict) -> bool:
    """Whether a windowed policy's outer syncs stream (`policy.fragments`, `policy.fragment_delay`)."""
    try:
        return Streaming(int(policy.get("fragments") or 1), int(policy.get("fragment_delay") or 0)).active
    except (TypeError, ValueError):
        return False        # a bad value: the policy's own check names it
