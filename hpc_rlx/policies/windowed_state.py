"""A windowed policy's checkpoint state (`windowed.WindowedPolicy` inherits it): what every rank
shares (rank 0 writes it: the controller, the positions, the outer optimizer, the epoch's log,
and with streaming syncs the agreed model) and what each rank holds alone (`rank_state`: its
inner optimizer state, the coded wire's residuals, with streaming syncs its parameters and the
fragment in flight), which the checkpoint keeps per rank (`checkpoint/runtime.py`).

A resume on the same world size gives every rank its own state back, so it continues bitwise
as if never stopped. On another world size the shard plan and the segments change: every rank
starts from rank 0's inner state and the agreed model, the residuals are dropped and the
fragment in flight is not sent again.

After a dead rank (`resilience/in_run.py`) the survivors go on exactly as that resume would,
from the last sync: every survivor drops the window in flight (back to the restore point the
policy marks at each sync, `Loop.restore_point`: the agreed model, and its inner optimizer state
as that sync left it), all take the state of the survivor furthest on and rank 0's inner
state, and the policy's one hook, `rebuild`, sets it up again for their world size.
"""

from __future__ import annotations

import numpy as np

from .base import Loop
from .epochlog import EpochLog


class WindowedState:
    """The checkpoint methods of `windowed.WindowedPolicy` (which owns every attribute used; the
    positions, the cost filter and the epoch's log are its `window`, a `window.WindowState`)."""

    def state_dict(self) -> dict:
        arrays, w = {}, self.window
        outer = self.outer.state_dict()
        for key in ("prev", "buf"):
            if outer.get(key) is not None:
                arrays[f"outer_{key}"] = np.asarray(outer[key])
        meta = {
            "name": self.name,
            "controller": self.controller.state_dict(),
            "outer": {k: v for k, v in outer.items() if k not in ("prev", "buf")},
            "cursors": None if w.cursors is None else list(w.cursors),
            "positions": None if w.cursors is None else list(w.cursors),
            "epoch_consumed": int(w.epoch_consumed),
            "recent_costs": list(w.costs.values),
            "epoch_log": None if w.log is None else w.log.state_dict(),
            "world_size": self.world,
        }
        if self.stream is not None:     # the agreed model, fragment by fragment
            arrays["global"] = self.global_params.copy()
            meta["streaming"] = self.stream.meta()
        return {"arrays": arrays, "meta": meta}

    def rank_state(self, worker) -> dict:
        """What only this rank holds, for a bitwise-exact resume on the same world size: its
        inner optimizer state (local steps make it differ between ranks), the coded wire's
        residuals, and with streaming syncs its parameters and the fragment in flight."""
        opt = worker.optimizer.state_dict()
        arrays = {f"opt/{k}": np.asarray(v).copy() for k, v in opt["arrays"].items()}
        if self.coded is not None:
            arrays.update({f"wire/{k}": v for k, v in self.coded.state_dict().items()})
        if self.stream is not None:
            arrays["params"] = np.asarray(worker.params).copy()
            arrays.update(self.stream.rank_state())
        return {"arrays": arrays, "scalars": opt["scalars"]}

    def load_rank_state(self, state: dict | None) -> None:
        """This rank's own `rank_state` from a checkpoint of the same world size (None from
        another: every rank then starts from rank 0's inner state, residuals dropped and the
        agreed model as its parameters); applied at setup."""
        self._rank_pending = state

    def load_state_dict(self, state: dict) -> None:
        meta, w = state.get("meta") or {}, self.window
        same_world = int(state.get("world_size", meta.get("world_size", self.world))) == self.world
        if "epoch_consumed" not in meta:
            # a policy=sync checkpoint: keep the model, start this policy fresh from the
            # position sync reached (see _setup)
            w.adopt_position = True
            return
        w.epoch_consumed = int(meta["epoch_consumed"])
        cursors = meta.get("cursors")
        # a new world size means a new shard plan: every rank starts a fresh local pass
        w.cursors = [int(c) for c in cursors] if (same_world and cursors) else None
        if meta.get("name") != self.name:
            return      # the other windowed policy: same position, this policy's own state
        self.controller.load_state_dict(meta["controller"])
        w.costs.values = [float(v) for v in meta.get("recent_costs", [])][-w.costs.n:]
        log = meta.get("epoch_log")
        w.log = EpochLog.from_state(log, self.world) if log and w.epoch_consumed else None
        self._pending = state

    def _resume_streams(self, loop: Loop, arrays: dict, streaming: dict | None) -> None:
        """The per-rank state a checkpoint kept (`rank_state`), once the arrays exist."""
        worker, own = loop.worker, self._rank_pending
        self._rank_pending = None
        if own is not None:
            opt = {k[4:]: v for k, v in own["arrays"].items() if k.startswith("opt/")}
            worker.load_optimizer_state({"arrays": opt, "scalars": own["scalars"]})
            if self.coded is not None and "wire/sent_residual" in own["arrays"]:
                self.coded.load_state_dict({k[5:]: v for k, v in own["arrays"].items() if k.startswith("wire/")})
        if self.stream is None:
            return
        if "global" in arrays:
            self.global_params[...] = arrays["global"]
            # this rank's own parameters, or (another world size) the agreed model
            worker.params[...] = own["arrays"]["params"] if own and "params" in own["arrays"] else arrays["global"]
            loop.lanes.refresh_device_params()
        if streaming:
            self.stream.load(streaming, own["arrays"] if own else None, worker.comm)


    # ---- after a dead rank (resilience/in_run.py) ------------------------------------------
    def rebuild(self, survivors) -> None:
        """`resilience.hooks.RankLossHook`: as a resume, on the survivors' world size, of the
        state of the survivor they go on from (`survivors.source`, broadcast): the controller and
        the outer optimizer loaded from it (the controller's measurements restart), every rank a
        fresh local pass over its new shard from the epoch's start, the coded wire's residuals
        dropped, the bucket's slots read for the new world size. The recovery has already given
        every survivor the same parameters and rank 0's inner optimizer state."""
        source = survivors.source
        state = survivors.comm.bcast(self._survivors_state() if survivors.rank == source else None, root=source)
        loop = self._loop       # the run this policy was set up in (its worker re-planned the data)
        worker, meta, w = loop.worker, state["meta"], self.window
        self._start_fresh(worker.world)
        self.load_state_dict(state)
        self._setup(loop)
        finished = meta.get("finished_epoch")
        w.epoch_over = finished is not None     # its validation is redone, then the next epoch
        if w.epoch_over:
            w.epoch_log = EpochLog.from_state(finished, int(meta["world_size"]))
            w.cursors = [(worker.epoch + 1) * worker.steps_per_epoch] * self.world
        else:
            w.log = w.log or EpochLog(self.world)
            w.epoch_log = w.log

    def _survivors_state(self) -> dict:
        """What the survivors continue from (`state_dict`), and the record of an epoch whose
        windows are done but whose validation is not (the failure hit it)."""
        state = self.state_dict()
        if self._ready and self.window.log is None and self.window.epoch_log is not None:
            state["meta"]["finished_epoch"] = self.window.epoch_log.state_dict()
        return state
