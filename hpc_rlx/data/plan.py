"""Shard planning: which rows each rank owns and which of them it uses at each step. Pure math.

The layout makes the *global* batch at every step independent of the world size, so 1 rank
with global batch B trains on exactly the same samples per step as 2, 4 or 8 ranks:

* The N training samples are cut into B contiguous **rows** (row j holds samples
  ``[row_start[j], row_start[j] + row_len[j])``). Every row holds ``K = N // B`` samples and
  the first ``N % B`` rows one more, so every sample belongs to a row.
* Global step ``s`` of an epoch takes one sample from every row: row j contributes its
  sample at column ``perm_j(s)``, where ``perm_j`` is a per-epoch permutation seeded by
  ``(seed, epoch, j)`` alone.
  - ``leftover="drop"``: K steps of exactly B samples; a row with K+1 samples leaves out the
    one its permutation puts last, so a different random ``N % B`` samples sit out each epoch.
  - ``leftover="partial"``: K+1 steps; a row shorter than that contributes nothing at the
    step that maps past its end (a sample-weighted partial batch).
* Rank r owns a contiguous block of rows, so its shard is one contiguous hyperslab of the
  file. Every rank makes the same number of steps per epoch whatever its row count, so the
  collectives always line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpc_rlx.base.errors import ConfigError

LEFTOVER_MODES = ("drop", "partial")


@dataclass(frozen=True)
class ShardPlan:
    n_samples: int          # training samples in the file (before dropping leftovers)
    global_batch: int
    world_size: int
    leftover: str
    steps_per_epoch: int
    row_start: tuple        # per row: first sample index (global)
    row_len: tuple          # per row: sample count
    rank_rows: tuple        # per rank: (first_row, stop_row)

    @property
    def samples_per_epoch(self) -> int:
        """Samples one epoch trains on, summed over all ranks and steps."""
        return self.n_samples - self.dropped

    @property
    def dropped(self) -> int:
        """Samples left out of each epoch (which ones changes from epoch to epoch)."""
        return self.n_samples - self.steps_per_epoch * self.global_batch if self.leftover == "drop" else 0

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """The contiguous sample range [start, stop) that `rank` must hold."""
        first, stop = self.rank_rows[rank]
        if first == stop:
            return (0, 0)
        return (self.row_start[first], self.row_start[stop - 1] + self.row_len[stop - 1])

    def all_bounds(self) -> list[tuple[int, int]]:
        return [self.shard_bounds(r) for r in range(self.world_size)]

    def rank_batch(self, rank: int) -> int:
        first, stop = self.rank_rows[rank]
        return stop - first

    def describe(self, stages: int = 1) -> str:
        """`stages` > 1: each shard feeds a pipeline of that many ranks (a data-parallel replica)."""
        on = (f"on {self.world_size} ranks" if stages == 1 else
              f"on {self.world_size} replica(s) of {stages} pipeline stages ({self.world_size * stages} ranks)")
        extra = (f"{self.dropped} leftover samples sit out each epoch (a different random set every "
                 f"epoch)" if self.leftover == "drop"
                 else f"{self.n_samples % self.global_batch} leftover samples used in partial batches")
        return (f"{self.n_samples} training samples, global batch {self.global_batch}, "
                f"{self.steps_per_epoch} steps/epoch {on}; {extra}")


EVAL_BATCH_CAP = 1024    # the most validation rows one forward evaluates by default


def eval_batch_rows(global_batch: int, world_size: int, splits: int = 1,
                    configured: int | None = None) -> int:
    """Validation rows one rank evaluates per forward: ``train.eval_batch_size`` when set, else
    the rank's largest training micro-batch (its share of the global batch over ``splits``
    micro-batches: ``train.accumulate``, or a pipeline's ``parallel.microbatches``), at most
    EVAL_BATCH_CAP. Validation activations then cost no more memory than a training step's."""
    if configured:
        return int(configured)
    rank_batch = -(-int(global_batch) // max(1, int(world_size)))
    return max(1, min(EVAL_BATCH_CAP, -(-rank_batch // max(1, int(splits)))))


def plan_shards(n_samples: int, global_batch: int, world_size: int, leftover: str = "drop") -> ShardPlan:
    """Plan the rows. Raises ConfigError for plans that cannot give every rank work."""
    if leftover not in LEFTOVER_MODES:
        raise ConfigError(f"data.leftover={leftover!r} is not one of {LEFTOVER_MODES}")
    if global_batch <= 0:
        raise ConfigError(f"train.batch_size must be positive, got {global_batch}")
    if world_size > n_samples:
        raise ConfigError(f"more ranks ({world_size}) than training samples ({n_samples})")
    if global_batch < world_size:
        raise ConfigError(
            f"train.batch_size={global_batch} is smaller than the number of ranks ({world_size}); "
            f"every rank needs at least one sample per step")
    if global_batch > n_samples:
        raise ConfigError(
            f"train.batch_size={global_batch} is larger than the training set ({n_samples} samples)")
    base, extra = divmod(n_samples, global_batch)
    row_len = [base + (1 if j < extra else 0) for j in range(global_batch)]
    row_start = np.concatenate([[0], np.cumsum(row_len)[:-1]]).astype(int).tolist()
    steps = base + (1 if extra and leftover == "partial" else 0)
    # Rows split as evenly as possible; ranks may own one row more than others.
    per, more = divmod(global_batch, world_size)
    rank_rows, first = [], 0
    for r in range(world_size):
        count = per + (1 if r < more else 0)
        rank_rows.append((first, first + count))
        first += count
    return ShardPlan(n_samples, global_batch, world_size, leftover, steps,
                     tuple(row_start), tuple(row_len), tuple(rank_rows))


def _row_permutation(seed: int, epoch: int, row: int, n: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    rng = np.random.Generator(np.random.PCG64([seed, epoch, row]))
    return rng.permutation(n)


class EpochOrder:
    """Local sample indices a rank uses at each step of one epoch (indices into its shard).

    Held as one column per (local row, step) in the smallest unsigned type that fits a row's
    permutation: 2 or 4 bytes per sample instead of 8, so the order table stays small next to
    the data it orders (it is O(shard), and data.cache=stream keeps it for the whole epoch)."""

    def __init__(self, plan: ShardPlan, rank: int, epoch: int, seed: int, shuffle: bool = True):
        first, stop = plan.rank_rows[rank]
        steps = plan.steps_per_epoch
        shard_start = plan.shard_bounds(rank)[0]
        rows = range(first, stop)
        self.offsets = np.array([plan.row_start[r] - shard_start for r in rows], dtype=np.int64)
        self.lengths = np.array([plan.row_len[r] for r in rows], dtype=np.int64)
        width = max([steps, *self.lengths.tolist()])
        # cols[j, s] = the column local row j uses at step s; >= its length: no sample
        self.cols = np.empty((len(rows), steps), dtype=np.min_scalar_type(width))
        for j, row in enumerate(rows):
            # Over max(length, steps) slots: with drop, the row's last slot sits out this
            # epoch; with partial, a slot past the row's end is a missing sample.
            self.cols[j] = _row_permutation(seed, epoch, row, max(plan.row_len[row], steps), shuffle)[:steps]

    def step_indices(self, step: int) -> np.ndarray:
        col = self.cols[:, step]
        used = col < self.lengths
        return self.offsets[used] + col[used]

    def window(self, start: int, stop: int) -> "Window":
        """The samples of steps [start, stop), for reading them in one go (data.cache=stream)."""
        cols = self.cols[:, start:stop]
        used = cols < self.lengths[:, None]
        local = self.offsets[:, None] + cols
        rows = np.sort(local[used])      # distinct: a permutation never repeats a column
        pos = np.searchsorted(rows, local)
        return Window(start, stop, rows, [pos[used[:, k], k] for k in range(stop - start)])


@dataclass(frozen=True)
class Window:
    """Steps [start, stop) of an epoch: `rows` (sorted local indices, each once) is what to
    read; `step_pos[k]` indexes `rows` with step start+k's samples, in step_indices' order."""
    start: int
    stop: int
    rows: np.ndarray
    step_pos: list

    def positions(self, step: int) -> np.ndarray:
        return self.step_pos[step - self.start]


def window_steps(steps_per_epoch: int, step_bytes: int, budget_bytes: int, min_windows: int = 8) -> int:
    """Steps per streamed window: as many as fit `budget_bytes` (a step needs `step_bytes`),
    and at most 1/min_windows of an epoch so reading ahead starts early; at least one step."""
    by_bytes = budget_bytes // max(1, step_bytes)
    return int(max(1, min(by_bytes, -(-steps_per_epoch // min_windows), steps_per_epoch)))


def window_of(step: int, steps_per_epoch: int, w: int) -> tuple[int, int]:
    """The window [start, stop) of an epoch that holds `step` (windows never cross epochs)."""
    start = (step // w) * w
    return start, min(start + w, steps_per_epoch)
