"""`comm.on_failure` / `comm.spares`: what `shrink` runs with so far, one refusal line each (pure)."""

from __future__ import annotations

import pytest

from hpc_rlx.config import schema
from hpc_rlx.config.failure_mode import check_on_failure, shrink_refusal, training_ranks
from hpc_rlx.errors import ConfigError
from hpc_rlx.injection import DebugHooks


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
    assert training_ranks({"on_failure": "spare", "spares": 1}, 3) == 2
    assert training_ranks({"on_failure": "shrink", "spares": 0}, 3) == 3


def test_spare_refuses_what_shrink_refuses_and_the_windowed_policies():
    with pytest.raises(ConfigError, match=r"^comm\.on_failure=spare does not run with device=cuda"):
        check_on_failure(config(comm__on_failure="spare", comm__spares=1, device__kind="cuda"))
    for policy in ("cadence", "async"):       # a spare cannot hold a dead rank's own inner state
        with pytest.raises(ConfigError, match=rf"^comm\.on_failure=spare does not run with policy={policy}: a "
                                              r"rank's inner optimizer state is its own"):
            check_on_failure(config(comm__on_failure="spare", comm__spares=1, policy__name=policy))


def test_the_keys_are_declared_with_their_choices():
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
