"""A pipelined run's checkpoint traffic (``parallel.pipeline_stages`` S > 1), one stage at a time.

The file is the data-parallel one: the whole model's flat ``params`` and ``opt/<name>`` arrays
in the whole graph's ``ParamLayout`` order. A stage's parameters keep their names, so the
whole layout's offsets place each of them (``runs``: the copies, merged where both sides are
contiguous); a checkpoint therefore moves between S = 1 and any S, and any D.

- Save: replica 0 of each stage k > 0 sends rank 0 its stage's parameters, then each optimizer
  array (sorted by name), over the world communicator; rank 0 writes its own stage's slices
  into the file's full-size datasets, then each later stage's as it arrives
  (``staged_file.write_staged``), so it holds one other stage at a time, never the model.
  The replicas of a stage agree after their Allreduce, so one of them is enough.
- Resume: rank 0 has read and checked the whole arrays; it cuts stage k's share out of them
  and sends it to every replica of stage k, one stage at a time.
"""

from __future__ import annotations

from math import prod

import numpy as np

from hpc_rlx.checkpoint.staged_file import StagedArrays
from hpc_rlx.base.errors import CheckpointError
from hpc_rlx.graph import Graph, ParamLayout
from hpc_rlx.graph.partition import partition

_SAVE_TAG = 7811
_RESUME_TAG = 7812


def runs(stage: ParamLayout, whole: ParamLayout, names) -> list:
    """(stage offset, whole offset, length) of the parameters ``names``, in order, merged where
    both layouts hold them back to back."""
    out: list = []
    for n in names:
        s, w, k = stage.offsets[n], whole.offsets[n], prod(stage.shapes[n])
        if not k:
            continue
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == w:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + k)
        else:
            out.append((s, w, k))
    return out


class StagedCheckpoint:
    """One rank's side of a pipelined run's checkpoint (see the module docstring)."""

    def __init__(self, whole_graph: dict, comms, world, cut_points=None):
        graph = Graph.from_dict(whole_graph)
        self.fingerprint = graph.fingerprint()
        self.whole = ParamLayout(graph)
        self.layouts = [ParamLayout(p) for p in partition(graph, comms.stages, cut_points=cut_points)]
        self.comms, self.world = comms, world
        self.param_runs = [runs(lay, self.whole, lay.names) for lay in self.layouts]
        self.opt_runs = [runs(lay, self.whole, lay.trainable_names) for lay in self.layouts]
        self.held_bytes = 0     # rank 0: the most bytes of other stages it held at once (a save)

    # ---- save ---------------------------------------------------------------------------
    def send(self, params: np.ndarray, opt: dict) -> None:
        """Every rank, at a save, before rank 0 writes: replica 0 of stages > 0 sends its share."""
        c = self.comms
        if c.replica != 0 or c.stage == 0:
            return
        self.world.Send(np.ascontiguousarray(params), dest=0, tag=_SAVE_TAG)
        for name in sorted(opt):
            self.world.Send(np.ascontiguousarray(opt[name]), dest=0, tag=_SAVE_TAG)

    def staged(self, params: np.ndarray, opt: dict) -> tuple[StagedArrays, object]:
        """Rank 0: the arrays to save (its own stage, then the others received) and a
        ``drain()`` to call when the save is over, written or not (the senders never wait)."""
        dtype = params.dtype
        specs = {"params": (dtype, (self.whole.size,))}
        for name in opt:
            specs[f"opt/{name}"] = (opt[name].dtype, (self.whole.trainable_size,))
        names = sorted(opt)
        done = [1]      # the next stage to receive

        def receive(k: int) -> tuple:
            lay = self.layouts[k]
            p = np.empty(lay.size, dtype=dtype)
            self.world.Recv(p, source=self.comms.grid.rank_of(0, k), tag=_SAVE_TAG)
            o = {}
            for name in names:
                o[name] = np.empty(lay.trainable_size, dtype=specs[f"opt/{name}"][0])
                self.world.Recv(o[name], source=self.comms.grid.rank_of(0, k), tag=_SAVE_TAG)
            done[0] = k + 1
            self.held_bytes = max(self.held_bytes, p.nbytes + sum(a.nbytes for a in o.values()))
            return p, o

        def place(datasets: dict, k: int, p: np.ndarray, o: dict) -> None:
            for s, w, n in self.param_runs[k]:
                datasets["params"][w:w + n] = p[s:s + n]
            for name in names:
                for s, w, n in self.opt_runs[k]:
                    datasets[f"opt/{name}"][w:w + n] = o[name][s:s + n]

        def fill(datasets: dict) -> None:
            place(datasets, 0, params, opt)
            while done[0] < self.comms.stages:
                k = done[0]
                place(datasets, k, *receive(k))

        def drain() -> None:
            while done[0] < self.comms.stages:
                receive(done[0])
        return StagedArrays(specs, fill), drain

    # ---- resume -------------------------------------------------------------------------
    def check(self, shapes: dict, opt_names, where) -> None:
        """Rank 0: the checkpoint's arrays (name -> shape) fit the whole model and this run's
        optimizer."""
        params = shapes.get("params")
        if params != (self.whole.size,):
            raise CheckpointError(f"checkpoint {where} holds {0 if params is None else prod(params)} "
                                  f"parameters, the model has {self.whole.size}")
        missing = [n for n in opt_names if f"opt/{n}" not in shapes]
        if missing:
            raise CheckpointError(f"checkpoint {where} lacks optimizer state {missing}; was it saved "
                                  f"by another optimizer?")
        for n in opt_names:
            if shapes[f"opt/{n}"] != (self.whole.trainable_size,):
                raise CheckpointError(f"checkpoint {where}: optimizer state {n!r} has shape "
                                      f"{shapes[f'opt/{n}']}, the model has "
                                      f"{self.whole.trainable_size} trainable parameters")

    def _cut(self, arrays: dict, k: int, names, dtype) -> list:
        lay = self.layouts[k]
        p = np.empty(lay.size, dtype=dtype)
        for s, w, n in self.param_runs[k]:
            p[s:s + n] = arrays["params"][w:w + n]
        out = [p]
        for name in names:
            o = np.empty(lay.trainable_size, dtype=dtype)
            for s, w, n in self.opt_runs[k]:
                o[s:s + n] = arrays[f"opt/{name}"][w:w + n]
            out.append(o)
        return out

    def scatter(self, arrays: dict | None, opt_names, dtype) -> dict:
        """Collective over the world: this rank's stage's ``params`` and ``opt/<name>`` arrays,
        cut on rank 0 from the whole ``arrays`` (None elsewhere; NumPy arrays or the file's
        datasets, read slice by slice) and sent stage by stage."""
        names, grid = sorted(opt_names), self.comms.grid
        mine, failure = None, None
        if self.world.rank == 0:
            for k in range(grid.stages):
                try:
                    pieces = None if failure else self._cut(arrays, k, names, dtype)
                except (OSError, ValueError, KeyError) as e:   # a slice the file cannot give
                    failure = f"reading stage {k}'s share of the checkpoint failed: {e}"
                if failure:
                    # Every receiver still gets its messages, so nobody waits; the error
                    # reaches every rank below.
                    lay = self.layouts[k]
                    pieces = [np.zeros(lay.size, dtype)] + [np.zeros(lay.trainable_size, dtype) for _ in names]
                for r in range(grid.replicas):
                    dest = grid.rank_of(r, k)
                    if dest == 0:
                        mine = pieces
                        continue
                    for a in pieces:
                        self.world.Send(a, dest=dest, tag=_RESUME_TAG)
        else:
            lay = self.layouts[self.comms.stage]
            mine = [np.empty(lay.size, dtype=dtype)] + [np.empty(lay.trainable_size, dtype=dtype) for _ in names]
            for a in mine:
                self.world.Recv(a, source=0, tag=_RESUME_TAG)
        failure = self.world.bcast(failure, root=0)
        if failure:
            raise CheckpointError(failure)
        return {"params": mine[0], **{f"opt/{n}": a for n, a in zip(names, mine[1:])}}
