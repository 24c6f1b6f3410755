"""`data.stage_dir`: before the first step the ranks of each node copy the files that node's
ranks read to node-local storage, and training reads the copies.

The plan is `data/stage_plan.py` (which files, who copies them), the copying
`data/stage_copy.py`; here the ranks agree on it: a node is the ranks that share memory
(MPI's shared-memory split, as `base/topology.py` finds nodes), each node's first rank makes
the run's directory and checks the free space before anything is copied, and every failure
is one error on every rank (`collective.agree`). The copies go at the run's end unless
`data.stage_keep=true`, also when it fails (removed by the ranks still alive; after a
SIGKILL of a whole node they stay, in `<stage_dir>/hpc_rlx-stage-*`).
"""

from __future__ import annotations

import os
import time

from hpc_rlx.comm import collective
from hpc_rlx.base.topology import hostname
from hpc_rlx.data.stage_copy import copy_checked, expand_stage_dir, free_bytes, make_stage_root, \
    remove_stage_root
from hpc_rlx.data.files import plan_files
from hpc_rlx.data.stage_plan import assign_copies, describe_staging, needed_files, rank_ranges, \
    space_problem, staged_name
from hpc_rlx.base.errors import DataError
from hpc_rlx.runtime.feed import even_bounds, with_empty_ranks


class Staged:
    """This node's copies: where each original is read from, and the directory to remove."""

    def __init__(self, root: str | None, mapping: dict[str, str], keep: bool):
        self.root, self.mapping, self.keep = root, dict(mapping), bool(keep)

    def path(self, original: str) -> str:
        """Where to read `original`: the node's copy, or the original where this node has none
        (a shard taken over after a dead rank: comm.on_failure)."""
        return self.mapping.get(original, original)

    def close(self) -> None:
        """Remove the copies (unless data.stage_keep); no collective, safe on every rank."""
        if not self.keep:
            remove_stage_root(self.root)
            self.root = None


def _my_files(spec, comm, plan) -> list[str]:
    d = spec.data
    world = plan.world_size
    train_bounds = with_empty_ranks(plan.all_bounds(), comm.size)
    val_bounds = with_empty_ranks(even_bounds(d.val_start, d.val_stop, world), comm.size)
    train, val = rank_ranges(comm.rank, world, train_bounds, val_bounds, d.distribution == "scatter")
    train_set, val_set, _ = plan_files(d)
    return needed_files([(train_set, train), (val_set, val)])


def _sizes(paths: list[str]) -> dict[str, int]:
    out = {}
    for p in paths:
        try:
            out[p] = os.stat(p).st_size
        except OSError as e:
            raise DataError(f"cannot stage {p} (data.stage_dir): {e.strerror or e}") from None
    return out


def stage(spec, comm, plan, log=print) -> Staged | None:
    """Collective over `comm`: copy each node's files to `data.stage_dir` (None when unset)."""
    d = spec.data
    if not getattr(d, "stage_dir", None):
        return None
    from mpi4py import MPI
    t0 = time.perf_counter()
    name = collective.root_computes(comm, lambda: f"hpc_rlx-stage-{hostname()}-{os.getpid()}-{int(time.time())}")

    def _needs():
        files = _my_files(spec, comm, plan)
        return files, _sizes(files)
    mine = collective.agree(comm, _needs)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        gathered = collective.watched_call("staging: the node's files (allgather)", node.allgather, mine)
        here = node.rank        # this rank's place in the node's allgather
    finally:
        node.Free()
    sizes = {p: s for _, sz in gathered for p, s in sz.items()}
    copies = assign_copies([files for files, _ in gathered], sizes)
    local = [p for part in copies for p in part]      # the node's files
    need = sum(sizes[p] for p in local)
    leader, root = here == 0, None
    try:
        def _prepare():
            nonlocal root
            stage_dir = expand_stage_dir(d.stage_dir)
            if leader and local:
                root = make_stage_root(stage_dir, name)
                problem = space_problem(stage_dir, hostname(), need, free_bytes(root), len(local))
                if problem:
                    raise DataError(problem)
            return os.path.join(stage_dir, name)
        # every node's directory exists and has room before any rank copies
        root = collective.agree(comm, _prepare)
        collective.agree(comm, lambda: [copy_checked(p, os.path.join(root, staged_name(p)), sizes[p])
                                        for p in copies[here]])
    except BaseException:
        remove_stage_root(root)
        raise
    seconds = time.perf_counter() - t0
    per_node = collective.watched_call("staging: the line's figures (allgather)", comm.allgather,
                                       (len(local), need) if leader and local else None)
    log(describe_staging(d.stage_dir, [n for n in per_node if n is not None], seconds))
    return Staged(root if local else None, {p: os.path.join(root, staged_name(p)) for p in local},
                  bool(getattr(d, "stage_keep", False)))

