"""The typed failure `train` raises, what `comm.on_failure` means (`FailureMode`), and which
parts of a run's context rebuild over the survivors: pure, no MPI."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from hpc_rlx.base.errors import DataError, phase
from hpc_rlx.optim import make_optimizer
from hpc_rlx.resilience.failure import PHASES, RunFailed, RunFailure, failure_of
from hpc_rlx.resilience.hooks import RankLossHook, Survivors, rank_loss_hooks
from hpc_rlx.resilience.in_run import FailureHandling
from hpc_rlx.resilience.mode import FailureMode, is_spare
from hpc_rlx.runtime.context import RunContext


def test_the_phases_run_from_startup_to_the_last_one():
    assert PHASES == ("startup", "setup", "training", "finish")
    assert [RunFailure(ValueError(), phase=p).before_training for p in PHASES] == [True, True, False, False]
    with pytest.raises(ValueError, match="unknown run phase 'validation'"):
        RunFailure(ValueError(), phase="validation")


def test_a_failure_names_what_the_rank_was_doing_as_the_message_did():
    def load():
        with phase("data loading"):
            raise DataError("no such file")

    with pytest.raises(DataError) as info:
        load()
    assert RunFailure(info.value, step=3, phase="setup").doing == "data loading"
    # no inner phase: the start-up before `train`, the training from its set-up to its end
    assert RunFailure(ValueError(), phase="startup").doing == "startup"
    assert [RunFailure(ValueError(), phase=p).doing for p in ("setup", "training", "finish")] == ["training"] * 3


def test_the_failure_travels_typed_and_an_untyped_error_is_one_of_the_startup():
    cause = DataError("disk full")
    failure = RunFailure(cause, step=7, phase="finish", abandon=lambda: True)
    try:
        raise RunFailed(failure) from cause
    except RunFailed as exc:
        assert failure_of(exc) is failure and exc.__cause__ is cause and str(exc) == "disk full"
    plain = failure_of(cause)
    assert (plain.cause, plain.step, plain.phase, plain.abandon) == (cause, None, "startup", None)
    assert not hasattr(cause, "step") and not hasattr(cause, "before_training")
    with pytest.raises(dataclasses.FrozenInstanceError):
        failure.step = 8


def test_the_mode_is_read_once_and_means_the_same_everywhere():
    abort, shrink = FailureMode.of({}), FailureMode.of({"on_failure": "shrink"})
    spare = FailureMode.of({"on_failure": "spare", "spares": 2})
    assert (abort.name, abort.active, shrink.active, spare.active) == ("abort", False, True, True)
    assert [m.training_ranks(5) for m in (abort, shrink, spare)] == [5, 5, 3]
    assert [m.spares_after(1) for m in (shrink, spare)] == [None, 1]
    assert spare.spares_after(3) == 0
    assert spare.describe().startswith("comm.on_failure=spare: a rank that dies is replaced by a spare")
    assert [is_spare(r, 3) for r in range(5)] == [False, False, False, True, True]


class _Comm:
    rank = 1


class _Rebuilt:
    def __init__(self, seen):
        self.seen = seen

    def rebuild(self, survivors: Survivors) -> None:
        self.seen.append((self, survivors.rank, survivors.training))


def test_the_parts_of_a_context_that_rebuild_are_found_by_their_one_method_in_order():
    seen: list = []
    worker, outputs = _Rebuilt(seen), _Rebuilt(seen)
    ctx = RunContext(comm=_Comm(), rank=1, is_root=False, worker=worker, lanes=object(), policy=object(),
                     checkpoints=None, outputs=outputs, display=object())
    assert rank_loss_hooks(ctx) == (worker, outputs)
    for part in rank_loss_hooks(ctx):
        part.rebuild(Survivors(_Comm(), training=2))
    assert seen == [(worker, 1, 2), (outputs, 1, 2)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 0
    # the run's own parts: the worker, the policy and the checkpoints each rebuild, by that one method
    from hpc_rlx.checkpoint.runtime import RuntimeCheckpoints
    from hpc_rlx.policies.base import Policy
    from hpc_rlx.policies.windowed import WindowedPolicy
    from hpc_rlx.runtime.worker import Worker
    assert all(callable(getattr(cls, "rebuild", None)) for cls in (Worker, RuntimeCheckpoints, Policy, WindowedPolicy))
    assert isinstance(_Rebuilt(seen), RankLossHook) and not isinstance(object(), RankLossHook)
    comm = _Comm()
    assert Survivors(comm, training=2) == Survivors(comm, 2, source=0, new_writer=False)


def _handling(on_failure: str) -> FailureHandling:
    spec = SimpleNamespace(comm={"on_failure": on_failure, "spares": 0})
    return FailureHandling(spec, SimpleNamespace(size=2))


def test_a_recovery_goes_back_to_the_last_restore_point_and_abort_keeps_none():
    """The restore point a windowed policy marks at each sync (`Loop.restore_point`): the agreed
    model's array as it is when the recovery starts, and this rank's optimizer state as it was
    when marked (copied); under abort nothing is kept, and a lockstep run has nothing to undo."""
    params = np.arange(4.0)
    worker = SimpleNamespace(params=params, optimizer=make_optimizer("sgd", 4, np, np.float64, momentum=0.9))
    worker.optimizer.step(params.copy(), np.ones(4), lr=0.1)
    agreed, marked = params.copy(), worker.optimizer.state_dict()
    shrink = _handling("shrink")
    shrink.keep(agreed, worker.optimizer)
    worker.optimizer.step(params, np.ones(4), lr=0.1)     # the window in flight moves on
    params += 1.0
    shrink.roll_back(worker)
    assert np.array_equal(worker.params, agreed) and worker.params is params
    now = worker.optimizer.state_dict()
    assert now["scalars"] == marked["scalars"]
    assert all(np.array_equal(now["arrays"][k], v) for k, v in marked["arrays"].items())
    abort = _handling("abort")
    abort.keep(agreed, worker.optimizer)
    assert abort.restore is None
    params += 1.0
    abort.roll_back(worker)
    _handling("shrink").roll_back(worker)      # nothing marked: nothing to undo
    assert np.array_equal(worker.params, agreed + 1.0)
