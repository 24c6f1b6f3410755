"""One rank's share of a pipelined step: its stage, micro-batch by micro-batch, in the order
the schedule gives (``schedule.build``), activations and their gradients exchanged with the
neighbouring stages by non-blocking point-to-point calls.

Buffers. The messages to and from each neighbour are laid out once (``buffers.BoundaryLayout``,
sized for the largest micro-batch of the largest replica batch, the same numbers on every
rank) and allocated once, K slots per direction, K = the most micro-batches the schedule keeps
alive on this stage (``schedule.simulate``: M for GPipe, min(S-s, M) for 1F1B). Micro-batch
m uses slot m % K: the micro-batches alive on a stage are consecutive, so no two share a slot.
A received activation stays in its slot until the micro-batch's backward ran (the executor
reads its inputs in place); then the slot takes the receive of micro-batch m + K, posted
right away, so the next messages land while this stage computes. A send waits for the
previous send from its slot before packing. Tags: 2m forward, 2m+1 backward; MPI keeps the
order of messages between two ranks, so consecutive steps need no further tagging.

Micro-batches. A replica's batch of n rows is cut into min(M, n) micro-batches of sizes
differing by at most one (every stage cuts it the same way, so message lengths are known at
both ends); each micro-batch's backward is seeded with ``grad_scale`` = its rows, so the
stage's gradients accumulate to the sample-weighted sum of the whole batch, exactly as lanes
and ranks sum today (partial batches included).

What travels with the gradients (``buffers.TAIL``): the last stage writes each micro-batch's
loss sum and correct count into the backward message, and every stage passes them down, so
every stage ends the step with its replica's loss and no collective is needed for it. The
control flags cannot travel this way (see ``adapters.PipelineBucket``).
"""

from __future__ import annotations

import time

import numpy as np

from hpc_rlx.comm.collective import watched_call
from hpc_rlx.graph import Executor
from hpc_rlx.base import trace
from hpc_rlx.pipeline.buffers import TAIL, BoundaryLayout, micro_sizes
from hpc_rlx.pipeline.schedule import build, simulate
from hpc_rlx.pipeline.stage_lanes import StageLanes


class StageEngine:
    """Runs stage ``comms.stage`` of ``stage_graph`` (a ``partition.StageGraph``)."""

    def __init__(self, stage_graph, comms, schedule: str, micro: int, max_rows: int, dtype, lanes: int = 1,
                 xp=np):
        self.g, self.comms = stage_graph, comms
        self.pipe = comms.pipe
        self.stage, self.stages = comms.stage, comms.stages
        self.schedule, self.micro = schedule, int(micro)
        self.ex = Executor(stage_graph, xp, dtype)       # xp: NumPy, or NumPy with MKL's GEMMs
        # CPU lanes: each micro-batch's rows split over them, one executor each (see StageLanes)
        self.lanes = StageLanes([self.ex] + [Executor(stage_graph, xp, dtype) for _ in range(int(lanes) - 1)],
                                stage_graph)
        self.dtype = self.ex.dtype
        self.rows = -(-int(max_rows) // self.micro)       # the largest micro-batch
        self.slots = max(1, simulate(build(schedule, self.stages, self.micro)).peak_alive[self.stage])
        types, s, S = stage_graph.types, self.stage, self.stages
        bi, bo = stage_graph.boundary_inputs, stage_graph.boundary_outputs
        self.f_in = BoundaryLayout(bi, types, self.rows) if s > 0 else None
        self.b_out = BoundaryLayout(bi, types, self.rows, tail=len(TAIL)) if s > 0 else None
        self.f_out = BoundaryLayout(bo, types, self.rows) if s < S - 1 else None
        self.b_in = BoundaryLayout(bo, types, self.rows, tail=len(TAIL)) if s < S - 1 else None
        k = self.slots
        self.recv_f = self.f_in.allocate(k, self.dtype) if self.f_in else []
        self.send_b = self.b_out.allocate(k, self.dtype) if self.b_out else []
        self.send_f = self.f_out.allocate(k, self.dtype) if self.f_out else []
        self.recv_b = self.b_in.allocate(k, self.dtype) if self.b_in else []
        self._plans: dict[int, list] = {}
        self.busy_s = 0.0
        self.sent_bytes = 0     # activations and their gradients sent in training steps (wire_bytes)
        self.wait_s = 0.0

    def boundary_bytes(self) -> int:
        return sum(b.nbytes for b in self.recv_f + self.send_b + self.send_f + self.recv_b)

    def _plan(self, m: int) -> list:
        if m not in self._plans:
            self._plans[m] = build(self.schedule, self.stages, m)[self.stage]
        return self._plans[m]

    def _wait(self, req, what: str, m: int) -> None:
        if req is None:
            return
        t0 = time.perf_counter()
        watched_call(what, req.Wait)    # the stall watchdog sees a stage waiting on its neighbour
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        if trace.ACTIVE is not None:
            trace.ACTIVE.add(what, "pipeline", trace.MAIN, t0, t1, {"micro": m})

    # ---- training ------------------------------------------------------------------------
    def step(self, param_views, grad_flat, grad_views, feeds: dict, seed: int, peers=()):
        """Forward and backward of this replica's batch ``feeds`` through this stage; the
        sample-weighted gradient sum lands in ``grad_flat``. Returns (rows, loss_sum, correct)
        of the replica's batch (the loss as the last stage computed it). ``peers``: for each
        lane after the first, its own (flat gradient, views), added into ``grad_flat`` at the end."""
        s, S, pipe, K = self.stage, self.stages, self.pipe, self.slots
        n = int(next(iter(feeds.values())).shape[0])
        sizes = micro_sizes(n, self.micro)
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
        grad_flat[...] = 0
        for flat, _ in peers:
            flat[...] = 0
        lane_grads = [grad_views] + [v for _, v in peers]
        acc = np.zeros(len(TAIL))
        if not sizes:
            return 0, 0.0, 0.0
        rf, rb, sf, sb = {}, {}, [None] * K, [None] * K

        def post(m):
            if m >= len(sizes):
                return
            r = sizes[m]
            if self.f_in:
                rf[m] = pipe.Irecv(self.recv_f[m % K][:self.f_in.size(r)], source=s - 1, tag=2 * m)
            if self.b_in:
                rb[m] = pipe.Irecv(self.recv_b[m % K][:self.b_in.size(r)], source=s + 1, tag=2 * m + 1)

        for m in range(min(K, len(sizes))):
            post(m)
        runs, own = {}, {}
        plan = self._plan(len(sizes))
        for i, a in enumerate(plan):
            m = a.micro
            r, lo = sizes[m], offs[m]
            if a.kind == "F":
                f = {name: feeds[name][lo:lo + r] for name in self.g.feeds}
                if self.f_in:
                    self._wait(rf.pop(m), "recv activations", m)
                    f.update(self.f_in.views(self.recv_f[m % K], r))
                t0 = time.perf_counter()
                run = self.lanes.forward(param_views, f, r, (seed * 1_000_003 + s) * 4099 + m)
                self._span("forward", t0, m)
                runs[m] = run
                if self.f_out:
                    k = m % K
                    self._wait(sf[k], "send activations", m)
                    self.lanes.gather(self.f_out.views(self.send_f[k], r), run, "boundary")
                    sf[k] = pipe.Isend(self.send_f[k][:self.f_out.size(r)], dest=s + 1, tag=2 * m)
                    self.sent_bytes += self.f_out.size(r) * self.send_f[k].itemsize
                else:
                    own[m] = self.lanes.loss(run)
                continue
            if self.b_in:
                self._wait(rb.pop(m), "recv gradients", m)
                buf = self.recv_b[m % K]
                seeds = self.b_in.views(buf, r)
                loss_m, correct_m = float(buf[0]), float(buf[1])
            else:
                seeds = {}
                loss_m, correct_m = own.pop(m)
            acc[0] += loss_m
            acc[1] += correct_m
            t0 = time.perf_counter()
            grads_in = self.lanes.backward(runs.pop(m), lane_grads, seeds)
            self._span("backward", t0, m)
            if self.b_out:
                k = m % K
                self._wait(sb[k], "send gradients", m)
                out = self.send_b[k]
                self.lanes.gather(self.b_out.views(out, r), grads_in)
                out[:len(TAIL)] = (loss_m, correct_m)
                sb[k] = pipe.Isend(out[:self.b_out.size(r)], dest=s - 1, tag=2 * m + 1)
                self.sent_bytes += self.b_out.size(r) * out.itemsize
            post(m + K)
        for req in sf + sb:
            self._wait(req, "send drain", -1)
        for flat, _ in peers:
            grad_flat += flat
        return n, float(acc[0]), float(acc[1])

    def _span(self, what: str, t0: float, m: int) -> None:
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        if trace.ACTIVE is not None:
            trace.ACTIVE.add(what, "compute", f"stage {self.stage}", t0, t1, {"micro": m})

    # ---- validation ------------------------------------------------------------------------
    def evaluate(self, param_views, feeds: dict) -> tuple[float, float]:
        """(loss_sum, correct) of ``feeds`` through the whole pipeline, without dropout: the
        values on the last stage, 0 elsewhere. Chunks of the largest micro-batch, blocking."""
        s, pipe = self.stage, self.pipe
        n = int(next(iter(feeds.values())).shape[0])
        loss_sum = correct = 0.0
        for lo in range(0, n, self.rows):
            r = min(self.rows, n - lo)
            f = {name: feeds[name][lo:lo + r] for name in self.g.feeds}
            if self.f_in:
                buf = self.recv_f[0]
                pipe.Recv(buf[:self.f_in.size(r)], source=s - 1, tag=0)
                f.update(self.f_in.views(buf, r))
            run = self.ex.stage_forward(param_views, f, train=False)
            if self.f_out:
                buf = self.send_f[0]
                self.f_out.pack(buf, r, run.boundary)
                pipe.Send(buf[:self.f_out.size(r)], dest=s + 1, tag=0)
            else:
                loss_sum += run.outputs["loss"] * r
                correct += float(run.outputs.get("correct", 0.0))
            run.env = run.saved = run.ctx = None
        return loss_sum, correct
