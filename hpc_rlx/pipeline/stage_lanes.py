"""The CPU lanes of one pipeline stage (``device.cpu_lanes`` with S > 1).

Each micro-batch's rows are split over the lanes (sizes differing by at most one, the first
lane the first rows, every lane its own ``Executor``), their forwards and backwards run
concurrently on a thread pool, and what goes to the neighbours is gathered back into the one
message per micro-batch: the boundary values and their gradients, row slices along each
value's batch axis. Each lane's backward is seeded with ``grad_scale`` = its rows, so the lanes'
gradients, each in a buffer of its own (the first lane's is the stage's bucket), add up to the
micro-batch's sample-weighted sum, as ``runtime.lanes.CpuLanes`` sums them; the engine adds the
peers' buffers into the bucket once, after the step. One lane is the engine's plain path.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hpc_rlx.pipeline.buffers import micro_sizes


class LaneRuns:
    """A micro-batch's per-lane results (``StageRun``s or gradient dicts) and their row spans."""

    def __init__(self, parts: list, spans: list):
        self.parts, self.spans = parts, spans


class StageLanes:
    def __init__(self, executors: list, stage_graph):
        self.exs = executors
        self.types = stage_graph.types
        self.pool = ThreadPoolExecutor(max_workers=len(executors)) if len(executors) > 1 else None

    def __len__(self) -> int:
        return len(self.exs)

    def _axis(self, name: str) -> int:
        t = self.types.get(name)
        shape = tuple(t.shape) if t is not None and t.shape is not None else ()
        return shape.index(None) if None in shape else 0

    def _rows(self, name: str, a, lo: int, hi: int):
        idx = [slice(None)] * a.ndim
        idx[self._axis(name)] = slice(lo, hi)
        return a[tuple(idx)]

    def _spans(self, rows: int) -> list:
        sizes = micro_sizes(rows, len(self.exs))
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        return list(zip(offs[:-1], offs[1:]))

    def _map(self, fn, jobs: list) -> list:
        if self.pool is None or len(jobs) == 1:
            return [fn(*j) for j in jobs]
        return list(self.pool.map(lambda j: fn(*j), jobs))

    def forward(self, param_views, feeds: dict, rows: int, seed: int) -> LaneRuns:
        """The stage's training forward of a micro-batch of ``rows`` rows, over the lanes."""
        if len(self.exs) == 1:
            return LaneRuns([self.exs[0].stage_forward(param_views, feeds, train=True, seed=seed)], [(0, rows)])
        spans = self._spans(rows)
        jobs = [(self.exs[i], {k: self._rows(k, v, lo, hi) for k, v in feeds.items()}, seed * 64 + i)
                for i, (lo, hi) in enumerate(spans)]
        runs = self._map(lambda ex, f, sd: ex.stage_forward(param_views, f, train=True, seed=sd), jobs)
        return LaneRuns(runs, spans)

    def loss(self, run: LaneRuns) -> tuple[float, float]:
        """(loss sum, correct) of a micro-batch on the stage holding the loss."""
        return (sum(r.outputs["loss"] * (hi - lo) for r, (lo, hi) in zip(run.parts, run.spans)),
                sum(float(r.outputs.get("correct", 0.0)) for r in run.parts))

    def backward(self, run: LaneRuns, lane_grads: list, seeds: dict) -> LaneRuns:
        """Each lane's backward into its gradient views (``lane_grads[i]``), seeded with its
        rows of ``seeds``; returns the lanes' boundary-input gradients."""
        jobs = [(self.exs[i], r, lane_grads[i], {k: self._rows(k, v, lo, hi) for k, v in seeds.items()}, hi - lo)
                for i, (r, (lo, hi)) in enumerate(zip(run.parts, run.spans))]
        grads = self._map(lambda ex, r, g, sd, n: ex.stage_backward(r, g, sd, grad_scale=float(n), accumulate=True),
                          jobs)
        return LaneRuns(grads, run.spans)

    def gather(self, views: dict, run: LaneRuns, attr: str | None = None) -> None:
        """Copy the lanes' values (``attr`` of each part, or the parts themselves) into the
        message ``views`` (name -> the micro-batch's rows), each lane into its rows."""
        for name, view in views.items():
            for part, (lo, hi) in zip(run.parts, run.spans):
                src = getattr(part, attr) if attr else part
                np.copyto(self._rows(name, view, lo, hi) if len(run.parts) > 1 else view, src[name])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
