"""`comm.on_failure` / `comm.spares`: what `shrink` runs with so far, one refusal line each
(`resilience/mode.py`); the keys' declaration; the spec for the survivors of a start; the debug
keys a rank reads before the spec (pure)."""

from __future__ import annotations

import pytest

from hpc_rlx.config import schema
from hpc_rlx.config.section import SECTIONS
from hpc_rlx.config.spec import DataPlan, TrainSpec, for_job_ranks
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.injection import DebugHooks, fail_keys_from_command_line, spec_failure_hooks
from hpc_rlx.resilience.mode import MODES, FailureMode, check_on_failure, shrink_refusal


BASE = {"device": {"kind": "cpu"}, "data": {"name": "digits"}, "model": {"name": "mlp"},
        "optim": {"name": "sgd"}, "policy": {"name": "sync"}}


def config(**overrides) -> dict:
    """A completed default config with `section.key=value` overrides (`policy` by name)."""
    cfg = schema.complete(BASE)
    cfg["policy"] = {"name": "sync"}
    for path, value in overrides.items():
        section, key = path.split("__")
        cfg[section] = dict(cfg[section], **{key: value})
    return cfg


def test_abort_and_a_plain_shrink_run():
    check_on_failure(config())
    check_on_failure(config(comm__on_failure="shrink"))
    assert shrink_refusal(config()) is None
    for policy in ("cadence", "async"):       # whole outer syncs: the window in flight is dropped
        check_on_failure(config(comm__on_failure="shrink", policy__name=policy))
        check_on_failure(config(comm__on_failure="shrink", policy__name=policy, policy__fragments=1))


@pytest.mark.parametrize("overrides, words", [
    ({"policy__name": "async", "policy__fragments": 2}, "policy.fragments / policy.fragment_delay (streaming"),
    ({"policy__name": "async", "policy__fragment_delay": 1}, "the fragments in flight are not dropped"),
    ({"parallel__pipeline_stages": 2}, "parallel.pipeline_stages=2: a dead rank takes a stage's only copy"),
    ({"device__kind": "cuda"}, "device=cuda: GPU lanes are not rebuilt after a failure yet; use device=cpu"),
    ({"device__kind": "all"}, "device=all: GPU lanes"),
    ({"comm__shard": "optimizer"}, "comm.shard=optimizer: a rank holds the only copy of its slice"),
    ({"comm__node_shared_params": True, "comm__shard": "optimizer"},
     "comm.node_shared_params=true: a node's one copy of the parameters"),
    ({"trace__enabled": True}, "trace.enabled=true: the trace is not gathered over the survivors"),
])
def test_shrink_refuses_what_it_does_not_rebuild_yet(overrides, words):
    with pytest.raises(ConfigError) as e:
        check_on_failure(config(comm__on_failure="shrink", **overrides))
    assert str(e.value).startswith("comm.on_failure=shrink does not run with ")
    assert words in str(e.value)
    check_on_failure(config(**overrides))      # abort runs with all of it, as before


def test_spare_needs_spares_and_spares_need_spare():
    with pytest.raises(ConfigError, match=r"comm\.on_failure=spare needs comm\.spares >= 1"):
        check_on_failure(config(comm__on_failure="spare"))
    with pytest.raises(ConfigError, match=r"comm\.spares=2 applies to comm\.on_failure=spare, got "
                                          r"comm\.on_failure=abort"):
        check_on_failure(config(comm__spares=2))
    with pytest.raises(ConfigError, match=r"comm\.spares=2 leaves no rank to train on 2 ranks: launch 2 more "
                                          r"than the ranks that train \(mpirun -n N\+2\)"):
        check_on_failure(config(comm__on_failure="spare", comm__spares=2), world_size=2)
    check_on_failure(config(comm__on_failure="spare", comm__spares=1), world_size=2)
    assert FailureMode.of({"on_failure": "spare", "spares": 1}).training_ranks(3) == 2
    assert FailureMode.of({"on_failure": "shrink", "spares": 0}).training_ranks(3) == 3


def test_spare_refuses_what_shrink_refuses_and_the_windowed_policies():
    with pytest.raises(ConfigError, match=r"^comm\.on_failure=spare does not run with device=cuda"):
        check_on_failure(config(comm__on_failure="spare", comm__spares=1, device__kind="cuda"))
    for policy in ("cadence", "async"):       # a spare cannot hold a dead rank's own inner state
        with pytest.raises(ConfigError, match=rf"^comm\.on_failure=spare does not run with policy={policy} "
                                              r"without policy\.reset_inner=true: a rank's inner optimizer state"):
            check_on_failure(config(comm__on_failure="spare", comm__spares=1, policy__name=policy))
        # none kept from one sync to the next: a spare holds all a rank holds
        check_on_failure(config(comm__on_failure="spare", comm__spares=1, policy__name=policy,
                                policy__reset_inner=True))
        with pytest.raises(ConfigError, match=r"policy\.outer_wire_dtype=int8: the coded outer wire's residuals"):
            check_on_failure(config(comm__on_failure="spare", comm__spares=1, policy__name=policy,
                                    policy__reset_inner=True, policy__outer_wire_dtype="int8"))


def test_sync_batch_norm_is_refused_under_shrink_and_spare_with_its_own_line():
    """A rank lost inside a forward's batch-norm sum: resilience's refusal, in the words
    `model.sync_batch_norm`'s other refusals use (`config/batch_norm_sync.py`)."""
    for mode, spares in (("shrink", 0), ("spare", 1)):
        with pytest.raises(ConfigError) as e:
            check_on_failure(config(comm__on_failure=mode, comm__spares=spares, model__sync_batch_norm=True))
        assert str(e.value) == (f"model.sync_batch_norm=true does not run with comm.on_failure={mode}: a rank "
                                f"lost inside a forward's batch-norm sum cannot be recovered from yet (use "
                                f"comm.on_failure=abort)")
    check_on_failure(config(model__sync_batch_norm=True))      # abort: as before
    # what shrink refuses first names the other key, as it did
    with pytest.raises(ConfigError, match=r"^comm\.on_failure=shrink does not run with parallel\.pipeline_stages=2"):
        check_on_failure(config(comm__on_failure="shrink", model__sync_batch_norm=True, parallel__pipeline_stages=2))


def test_the_keys_are_declared_with_their_choices():
    assert tuple(MODES) == schema.ON_FAILURE      # each choice the schema takes has its meaning here
    schema.validate({**BASE, "comm": {"on_failure": "shrink", "spares": 0}, "debug": {"fail_mode": "kill"}})
    with pytest.raises(ConfigError, match=r"comm\.on_failure='restart' is not one of"):
        schema.validate({**BASE, "comm": {"on_failure": "restart"}})
    with pytest.raises(ConfigError, match=r"debug\.fail_mode='explode' is not one of"):
        schema.validate({**BASE, "debug": {"fail_mode": "explode"}})
    with pytest.raises(ConfigError, match=r"comm\.spares must be"):
        schema.validate({**BASE, "comm": {"spares": -1}})


def test_fail_rank_names_one_rank_or_several_that_fail_together():
    both = {"fail_rank": [1, 2], "fail_point": "step", "fail_step": 5, "fail_mode": "kill"}
    assert [DebugHooks.from_section(both, r).fail_point for r in range(4)] == [None, "step", "step", None]
    assert DebugHooks.from_section(both, 2).fail_mode == "kill"
    assert DebugHooks.from_section({"fail_rank": 1, "fail_point": "data"}, 1).fail_mode == "raise"
    with pytest.raises(ConfigError, match=r"debug\.fail_rank must be null, a rank or a list of ranks, got \[\]"):
        schema.validate({**BASE, "debug": {"fail_rank": []}})


def _spec(world_size: int, **comm):
    data = DataPlan(path="d.h5", x="x", y="y", n_train=96, val_path=None, val_start=96, val_stop=100,
                    distribution="read", leftover="drop", shuffle=True, check_finite=False,
                    sample_shape=[4], x_dtype="float32", y_dtype="int64")
    sections = {name: schema.defaults(name) for name in SECTIONS}
    sections["comm"] = dict(sections["comm"], **comm)
    sections["train"] = dict(sections["train"], batch_size=24)
    return TrainSpec(graph={}, param_source={"kind": "seed", "seed": 0}, data=data, run_dir="run",
                     resume="auto", world_size=world_size, plan="stale", **sections)


def test_the_spec_for_the_survivors_of_a_start_plans_for_them():
    """A rank dead before training: the spec's ranks that train and its plan line follow the
    survivors; under spare a dead rank takes a spare with it."""
    shrunk = for_job_ranks(_spec(3, on_failure="shrink"), 2)
    assert shrunk.world_size == 2 and "4 steps/epoch on 2 ranks" in shrunk.plan and "spare" not in shrunk.plan
    spare = for_job_ranks(_spec(3, on_failure="spare", spares=2), 4, spares=1)     # 5 ranks, one died
    assert spare.world_size == 3 and spare.comm["spares"] == 1 and spare.plan.endswith(", and 1 spare rank(s)")
    assert spare.data == shrunk.data and spare.train["batch_size"] == 24


def test_a_rank_reads_its_debug_keys_from_the_command_line_before_it_holds_the_spec():
    argv = ["hydra.run.dir=r", "debug.fail_rank=[1,2]", "debug.fail_point=spec", "debug.fail_mode=kill", "x=1",
            "debug.slowdown={1:3.0}"]
    section = fail_keys_from_command_line(argv)
    assert section == {"fail_rank": [1, 2], "fail_point": "spec", "fail_mode": "kill"}
    assert [spec_failure_hooks(argv, r).fail_point for r in range(3)] == [None, "spec", "spec"]
    assert spec_failure_hooks(argv, 1).fail_mode == "kill"
    assert spec_failure_hooks(["debug.fail_rank=abc", "debug.fail_point=spec"], 1) is None    # rank 0 names it
