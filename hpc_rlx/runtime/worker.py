"""What one rank holds during training: the graph, parameters, optimizer and LR schedule, its
data shard and validation slice, and the fused bucket. Policies drive it through its methods."""

from __future__ import annotations

import math
import time

import numpy as np

from hpc_rlx.comm import collective
from hpc_rlx.comm.bucket_layout import STEP_FIELDS
from hpc_rlx.comm.node_params import NodeSharedParams
from hpc_rlx.comm.shard import ParamShard, SplitNorms
from hpc_rlx.config.batch_norm_sync import describe as describe_sync_batch_norm
from hpc_rlx.config.spec import TrainSpec, initial_parameters, schedule_kwargs
from hpc_rlx.data.plan import plan_shards
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph import ParamLayout
from hpc_rlx.graph.frozen import describe as describe_frozen
from hpc_rlx.graph.lora import describe as adapters_line
from hpc_rlx.graph.param_names import names_by_meta
from hpc_rlx.graph.partition import load_graph
from hpc_rlx.runtime.feed import Feed, MemoryFeed, StreamFeed
from hpc_rlx.runtime.feed_scatter import ScatterStreamFeed
from hpc_rlx.device.eval_counts import pack_counts, unpack_counts
from hpc_rlx.base import trace
from hpc_rlx.observe.metrics.validation import val_values
from hpc_rlx.optim import make_optimizer, make_schedule, optimizer_kwargs, scaled_lr
from hpc_rlx.optim.clip import scale_to_norm_, squared_norm
from hpc_rlx.optim.groups import settings_for
from hpc_rlx.optim.segments import slice_segments
from hpc_rlx.resilience.hooks import Survivors
from hpc_rlx.resilience.mode import FailureMode, is_spare
from hpc_rlx.runtime.staging import Staged, stage
from hpc_rlx.runtime.state import TrainState


class Worker:
    """Everything one rank holds during training. Policies drive it through its methods."""

    def __init__(self, spec: TrainSpec, comm, log=print, fields: tuple[str, ...] = STEP_FIELDS,
                 rank_fields: tuple[str, ...] = (), fail_at=None):

        self.spec, self.comm, self.log = spec, comm, log
        self.fail_at = fail_at      # debug.fail_point in the feed (`DebugHooks.fail_at`), or None
        # comm.on_failure=spare: the last ranks of `comm` are spares, which hold the model, take
        # part in every collective with no rows, and train nothing until one takes a dead
        # rank's place; `world` counts the ranks that train (rank r < world trains shard r)
        self.rank, self.world = comm.rank, FailureMode.of(spec.comm).training_ranks(comm.size)
        self.dtype = np.dtype(spec.train["dtype"])
        self.graph = load_graph(spec.graph)      # a pipelined rank: its stage (runtime/pipelined.py)
        self.layout = ParamLayout(self.graph)
        self.per_sample = max(1, int(getattr(self.graph, "predictions_per_sample", 1)))
        # a regression loss (mse) has no `correct` output: there is no accuracy to report
        self.has_accuracy = "correct" in self.graph.result_names
        self._warned_val_nonfinite = False

        # Initial weights: rank 0 materialises them, everyone receives them by buffer Bcast.
        # comm.node_shared_params: the ranks of a node share one array (comm/node_params.py)
        self.node_params = (NodeSharedParams.create(comm, self.layout.size, self.dtype)
                            if spec.comm.get("node_shared_params") else None)
        self.params = (np.empty(self.layout.size, dtype=self.dtype) if self.node_params is None
                       else self.node_params.array)
        initial = {}

        def _init():
            if self.rank == 0:
                initial["params"] = initial_parameters(spec, self.graph, self.layout)
                if self.node_params is None:
                    self.params[...] = initial.pop("params")
        collective.root_computes(comm, _init)
        if self.node_params is None:
            comm.Bcast(self.params, root=0)
        else:
            self.node_params.write_all(comm, initial.pop("params", None))

        self.plan = plan_shards(spec.data.n_train, spec.train["batch_size"], self.world, spec.data.leftover)
        # comm.shard=optimizer: this rank steps, and holds the optimizer state of, one slice
        self.n_trainable = self.layout.trainable_size
        self.shard = (ParamShard(self.n_synced, self.n_trainable, self.rank, self.world)
                      if spec.comm.get("shard", "none") == "optimizer" else None)
        self.steps_per_epoch = self.plan.steps_per_epoch
        # The one parameter-sized bucket: gradients (or a windowed sync's weighted parameters),
        # then the tail slots the policy declares (`Policy.bucket_fields`, `bucket_rank_fields`).
        # agreed: a bad comm.wire_dtype is one clear error on every rank
        self.bucket = collective.agree(comm, lambda: collective.FusedBucket(
            self.n_synced, tuple(fields), self.dtype, rank_fields=tuple(rank_fields),
            world_size=self.world,
            cap_mb=float(spec.comm["bucket_cap_mb"]), deterministic=bool(spec.comm["deterministic"]),
            wire_dtype=spec.comm["wire_dtype"], overlap=bool(spec.comm["overlap"]),
            overlap_chunk_mb=float(spec.comm["overlap_chunk_mb"]), reduction=spec.comm["reduction"],
            shard=self.shard, shared_params=self.node_params))
        # comm.overlap: where each gradient sits, so a chunk can start once backward finished it
        self.bucket.set_overlap_spans({name: (off, off + int(np.prod(self.layout.shapes[name], dtype=np.int64)))
                                       for name, off in self.layout.offsets.items() if off < self.n_synced})
        opt = dict(spec.optim)
        # The optimizer steps the trainable prefix; the buffers after it (batch-norm running
        # statistics) move towards the step's mean statistic, carried in the same bucket slots.
        stepped = self.n_trainable if self.shard is None else self.shard.n_local
        self.optimizer = make_optimizer(opt["name"], stepped, np, self.dtype, **optimizer_kwargs(opt))
        self._segment_optimizer()
        self.buffer_rates = self._buffer_rates()
        self.base_lr = scaled_lr(float(opt["lr"]), self.world, float(opt["lr_scale_ratio"] or 0.0))
        # The schedule spans the configured epochs; max_steps only stops early, so a run
        # stopped by max_steps and resumed follows exactly the same LR curve.
        self.schedule_steps = spec.train["epochs"] * self.steps_per_epoch
        self.total_steps = int(spec.train["max_steps"]) if spec.train["max_steps"] else None
        self.schedule = make_schedule(opt["schedule"], self.base_lr, self.schedule_steps,
                                      **schedule_kwargs(opt))
        # With pipeline stages: the communicator along this replica's pipeline (one rank per
        # stage), over which the gradient's global norm is summed (set by runtime/pipelined.py)
        self.stage_pipe = None
        self.state = TrainState()     # step, epoch, position: advanced only through it
        self.staged: Staged | None = None     # data.stage_dir: this node's copies (runtime/staging.py)
        self.history: list[dict] = []
        # model.sync_batch_norm: the batch-norm sums' own communicator (runtime/batch_sync.py)
        self.batch_norm_comm = None
        if spec.sync_batch_norm:
            collective.agree(comm, self._check_sync_batch_norm)
            self.batch_norm_comm = comm.Dup()       # so they never meet the bucket's collectives

    def _check_sync_batch_norm(self) -> None:
        """The start-up line; lanes' threads call MPI (the last lane in a batch-norm sum)."""
        lanes = int(self.spec.device["cpu_lanes"])
        if lanes > 1:
            from mpi4py import MPI
            if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
                raise ConfigError(f"model.sync_batch_norm=true with device.cpu_lanes={lanes} needs an MPI "
                                  f"thread level of at least MPI_THREAD_SERIALIZED (the lanes' threads sum)")
        self.log(describe_sync_batch_norm(self.graph, self.world, lanes))

    def _segment_optimizer(self) -> None:
        """Tell the optimizer where each trainable parameter lies in what it steps; sharded,
        the parameters a slice boundary cuts have their norms completed across ranks."""
        spans = [(name, self.layout.offsets[name], int(np.prod(self.layout.shapes[name], dtype=np.int64)))
                 for name in self.layout.trainable_names]
        if self.shard is None:
            self.optimizer.use_segments(slice_segments(spans, 0, self.n_trainable))
        else:
            mine = self.shard.trainable
            segments = slice_segments(spans, mine.start, mine.stop)
            self.optimizer.use_segments(segments, SplitNorms(self.comm, spans, self.shard, segments))
        opt = self.spec.optim
        if opt.get("no_decay") or opt.get("lr_mult"):     # parameter groups, by their users' names
            names = names_by_meta(self.spec.graph.get("meta"), [name for name, _, _ in spans])
            self.optimizer.use_settings(settings_for(names, opt.get("no_decay") or (), opt.get("lr_mult") or {},
                                                     every_glob_matches=False))
        if adapters_line(self.graph):       # model.lora.*: the adapters train, the base is frozen
            self.log(adapters_line(self.graph))
        if self.layout.frozen_names:        # model.freeze / model.train_only: neither stepped nor in the bucket
            self.log(describe_frozen(self.layout, self.graph))

    @property
    def n_synced(self) -> int:
        """The gradient vector's (the bucket payload's) size: the trainable parameters, then the
        buffers. The frozen parameters (model.freeze) follow in `params` only: not summed, not
        sliced under comm.shard=optimizer, never stepped."""
        return self.layout.grad_size

    # ---- the position (read-only views of `state`) --------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.state.step_in_epoch

    @property
    def skipped_steps(self) -> int:
        return self.state.skipped_steps

    @property
    def is_spare(self) -> bool:
        """A spare rank (comm.on_failure=spare) that trains no rows yet."""
        return is_spare(self.rank, self.world)

    # ---- data ----------------------------------------------------------------------------
    def load_data(self) -> None:
        """Collective: the feed `data.cache` and `data.distribution` ask for (runtime/feed.py)."""
        t0 = time.perf_counter()
        d = self.spec.data
        if d.stage_dir and self.staged is None:     # once: after a dead rank the copies stay
            self.staged = stage(self.spec, self.comm, self.plan, self.log)
        kind = (MemoryFeed if d.cache == "memory"
                else ScatterStreamFeed if d.distribution == "scatter" else StreamFeed)
        self.feed: Feed = kind(self.spec, self.comm, self.graph, self.plan, fail_at=self.fail_at)
        if self.staged is not None:     # the node's copies; a file it lacks is read in place
            self.feed.read_from(self.staged.path)
        self.feed.load()
        self.data_s = time.perf_counter() - t0

    def close_data(self, collective_ok: bool = True) -> None:
        """The run's end or failure: the feed stops (MPI only if every rank is here, see
        `Feed.close`) and the staged copies go (unless data.stage_keep), on every rank alive."""
        feed = getattr(self, "feed", None)
        try:
            if feed is not None:
                feed.close(collective_ok=collective_ok)
        finally:
            if self.staged is not None:
                self.staged.close()

    def rebuild(self, survivors: Survivors) -> None:
        """`resilience.hooks.RankLossHook`: collective over the survivors after a dead rank, of
        whom the first `survivors.training` train (the rest stay spares): train on over them as
        a resume on that many ranks would. The shards are re-planned for the same global batch, the learning
        rate is scaled for the new world size (unchanged where a spare took the dead rank's
        place), the bucket's per-rank slots are laid out for it, and this rank reads its new
        shard; parameters, optimizer state and position stay as they are."""
        self.comm, self.rank, self.world = survivors.comm, survivors.rank, int(survivors.training)
        spec, opt = self.spec, self.spec.optim
        self.plan = plan_shards(spec.data.n_train, spec.train["batch_size"], self.world, spec.data.leftover)
        if self.plan.steps_per_epoch != self.steps_per_epoch:     # the plan keeps the global batch
            raise RuntimeError(f"re-planned over {self.world} ranks, an epoch has "
                               f"{self.plan.steps_per_epoch} steps instead of {self.steps_per_epoch}")
        self.base_lr = scaled_lr(float(opt["lr"]), self.world, float(opt["lr_scale_ratio"] or 0.0))
        self.schedule = make_schedule(opt["schedule"], self.base_lr, self.schedule_steps, **schedule_kwargs(opt))
        self.bucket.world_changed(self.world)   # its per-rank slots laid out again, its path re-chosen
        self.feed.close(collective_ok=False)
        loaded = self.data_s
        self.load_data()
        self.data_s += loaded

    def batch(self, position: int):
        """(x, y) of this rank's batch at `position` = pass * steps_per_epoch + step, x in
        the compute dtype; the same bytes whatever data.cache."""
        if self.is_spare:
            return self.feed.no_rows()      # a spare's lanes write a zero gradient
        return self.feed.batch(position)

    # ---- numerics ---------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        return float(self.schedule(step))

    def _buffer_rates(self):
        """Per buffer element, the rate of its running update (None without buffers)."""
        if self.n_trainable == self.n_synced:
            return None
        rates = np.zeros(self.n_synced - self.n_trainable, dtype=self.dtype)
        momentum = self.graph.buffer_momentum()
        for name in self.layout.buffer_names:
            off = self.layout.offsets[name] - self.n_trainable
            rates[off:off + int(np.prod(self.layout.shapes[name]))] = momentum[name]
        return rates

    def apply_gradient(self, grad: np.ndarray, lr: float, grad_scale: float = 1.0) -> float:
        """Clip (optionally) and step the optimizer with the mean gradient ``grad_scale * grad``
        (the sum and 1 / samples from the bucket: the optimizer folds the division into its own
        passes); move the buffers towards the mean statistics in the rest of ``grad``, which
        may be overwritten. With sharded optimizer state only this rank's slice of ``grad``
        holds the sum: the rank steps its slice, and the slices are then gathered. Returns the
        seconds spent in that allgather (0 unsharded)."""
        if self.shard is not None:
            return self._apply_slice(grad, lr, grad_scale)
        n = self.n_trainable
        clip = self.spec.optim["clip_grad_norm"]
        if clip:
            if grad_scale != 1.0:
                grad[:n] *= grad_scale
            scale_to_norm_(grad[:n], float(clip), self._global_norm(grad[:n]))
            self.optimizer.step(self.params[:n], grad[:n], lr)
        else:
            self.optimizer.step(self.params[:n], grad[:n], lr, grad_scale=grad_scale)
        if self.buffer_rates is not None:
            buffers = self.params[n:self.n_synced]
            buffers += self.buffer_rates * (grad[n:self.n_synced] * grad_scale - buffers)
        return 0.0

    def _global_norm(self, mine) -> float:
        """The L2 norm of the whole model's gradient, of which this rank holds `mine`: its
        slice under sharded state (the slices' shares added in rank order), its stage's with
        pipeline stages (the stages' shares added in stage order), both, or all of it."""
        squared = squared_norm(mine)
        if self.shard is not None:
            squared = math.fsum(self.comm.allgather(squared))
        if self.stage_pipe is not None:
            squared = math.fsum(self.stage_pipe.allgather(squared))
        return math.sqrt(squared)

    def _apply_slice(self, grad: np.ndarray, lr: float, grad_scale: float) -> float:
        shard = self.shard
        mine = shard.trainable
        clip = self.spec.optim["clip_grad_norm"]
        if clip:
            if grad_scale != 1.0:
                grad[mine] *= grad_scale
            scale_to_norm_(grad[mine], float(clip), self._global_norm(grad[mine]))
            self.optimizer.step(self.params[mine], grad[mine], lr)
        else:
            self.optimizer.step(self.params[mine], grad[mine], lr, grad_scale=grad_scale)
        if self.buffer_rates is not None:
            own = shard.buffers
            rates = self.buffer_rates[own.start - self.n_trainable: own.stop - self.n_trainable]
            buffers = self.params[own]
            buffers += rates * (grad[own] * grad_scale - buffers)
        t0 = time.perf_counter()
        with trace.span("allgather", "comm"):   # the bucket's path gathers its own way; bytes in `sent`
            self.bucket.gather_params(self.comm, self.params)
        return time.perf_counter() - t0

    def set_params(self, values) -> None:
        """Collective: the parameters become `values`, which every rank holds (a resume); with
        node-shared parameters, written once per node."""
        if self.node_params is None:
            self.params[...] = values
        else:
            self.node_params.write_local(values)

    @property
    def held_param_bytes(self) -> int:
        """The parameter bytes this rank holds: a node's shared copy counts on its first rank."""
        if self.node_params is not None and not self.node_params.is_leader:
            return 0
        return int(self.params.nbytes)

    # ---- optimizer state as a checkpoint holds it (whole, whatever the sharding) ----------
    def optimizer_state_for_checkpoint(self) -> dict | None:
        """Collective under sharding: rank 0 gets the whole state, gathered one array at a
        time; the other ranks None. Unsharded: this rank's state."""
        state = self.optimizer.state_dict()
        if self.shard is None:
            return state
        arrays = {name: self.shard.gather_to_root(self.comm, value) for name, value in state["arrays"].items()}
        return dict(state, arrays=arrays) if self.rank == 0 else None

    def load_optimizer_state(self, state: dict) -> None:
        """A checkpoint's whole optimizer state (sharded: this rank takes its slice)."""
        if self.shard is not None:
            state = dict(state, arrays={name: self.shard.local(value) for name, value in state["arrays"].items()})
        self.optimizer.load_state_dict(state)

    def note_skip(self) -> None:
        """Count a step skipped for non-finite values (train.on_nonfinite=skip). A model that
        only produces skipped steps is broken: stop instead of finishing as if it trained."""
        in_a_row = self.state.step_skipped()
        limit = int(self.spec.train["max_consecutive_skips"] or 0)
        if limit and in_a_row >= limit:
            # Decided from the bucket's flags: every rank raises this in the same step.
            raise collective.CollectiveError(
                kind="NonFiniteError",
                message=f"{in_a_row} consecutive steps had NaN/Inf gradients or loss "
                        f"(train.on_nonfinite=skip, train.max_consecutive_skips={limit}) at step "
                        f"{self.step}; the model is not training: lower optim.lr or set optim.clip_grad_norm "
                        f"(or, if the data may hold NaN or Inf, data.check_finite=true names the row)")

    def check_validation_finite(self, val_loss, train_loss) -> None:
        """A non-finite validation loss after a finite training loss: the parameters trained
        (a non-finite step stops or is skipped), so the validation rows hold NaN or Inf. Both
        numbers come from Allreduces, so every rank decides the same."""
        if val_loss is None or math.isfinite(val_loss) or train_loss is None or not math.isfinite(train_loss):
            return
        d = self.spec.data
        what = (f"validation loss is {val_loss} at epoch {self.epoch + 1} while the training loss is "
                f"finite ({train_loss:.4g}): the validation rows (rows {d.val_start}-{d.val_stop - 1} of "
                f"{d.val_path}) likely hold NaN or Inf; data.check_finite=true names the first such "
                f"row at load time")
        if self.spec.train["on_nonfinite"] == "stop":
            raise collective.CollectiveError(kind="NonFiniteError", message=what)
        if not self._warned_val_nonfinite:
            self._warned_val_nonfinite = True
            self.log(f"warning: {what}")

    def apply_gradient_ok(self) -> None:
        self.state.step_applied()

    def evaluate(self, lanes) -> dict:
        """Global validation loss/accuracy: every rank scores its slice, one small Allreduce.
        Summed per evaluation batch (`feed.eval_batch` rows) in order, whatever data.cache."""
        from mpi4py import MPI
        head = getattr(lanes, "head", None)
        if head is not None and head.counts_validation:    # weights, IoU or MAE: the counts of eval_counts.py
            total: dict = {}
            for xb, yb in self.feed.val_batches():
                for key, value in lanes.evaluate_counts(xb, yb, batch=self.feed.eval_batch).items():
                    total[key] = total.get(key, 0) + value
            classes = head.classes if head.reports_iou else 0
            buf = pack_counts(total, classes)
            collective.watched_call("validation Allreduce", self.comm.Allreduce, MPI.IN_PLACE, buf, op=MPI.SUM)
            return val_values(unpack_counts(buf, classes), head.reports)
        loss_sum = correct = 0.0
        n = 0
        for xb, yb in self.feed.val_batches():
            part_loss, part_correct = lanes.evaluate(xb, yb, batch=self.feed.eval_batch)
            loss_sum += part_loss
            correct += part_correct
            n += int(xb.shape[0])
        buf = np.array([loss_sum, correct, float(n)], dtype=np.float64)
        collective.watched_call("validation Allreduce", self.comm.Allreduce, MPI.IN_PLACE, buf, op=MPI.SUM)
        if buf[2] == 0:
            return {"val_loss": None, "val_accuracy": None}
        if not self.has_accuracy:
            return {"val_loss": buf[0] / buf[2], "val_accuracy": None}
        return {"val_loss": buf[0] / buf[2], "val_accuracy": buf[1] / (buf[2] * self.per_sample)}
