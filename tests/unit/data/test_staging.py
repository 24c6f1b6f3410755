"""Staging's plan (data/stage_plan.py: which files a rank reads, who copies what) and its file
side (data/stage_copy.py: checked copies, the directory, free space), without MPI."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hpc_rlx.data.fileset import FileSet
from hpc_rlx.data.plan import EpochOrder, plan_shards
from hpc_rlx.data.stage_copy import PART, copy_checked, expand_stage_dir, make_stage_root, remove_stage_root
from hpc_rlx.data.stage_plan import (assign_copies, describe_staging, needed_files, rank_ranges,
                                     space_problem, staged_name)
from hpc_rlx.base.errors import DataError


def _one_sample_files(n: int) -> FileSet:
    return FileSet(tuple(f"/d/f_{i:03d}.h5" for i in range(n)), (1,) * n, one_sample=True)


@pytest.mark.parametrize("leftover", ["drop", "partial"])
@pytest.mark.parametrize("n,batch,world", [(50, 8, 2), (37, 6, 4), (40, 10, 3)])
def test_a_rank_stages_every_file_it_reads_in_any_epoch(n, batch, world, leftover):
    """The files of the rank's block cover every sample its epochs use, whatever the shuffle
    and the leftover rule: the property that makes a staged run train like an unstaged one."""
    files = _one_sample_files(n)
    plan = plan_shards(n, batch, world, leftover)
    for rank in range(world):
        start, stop = plan.shard_bounds(rank)
        staged = set(needed_files([(files, [(start, stop)])]))
        used = set()
        for epoch in range(6):
            order = EpochOrder(plan, rank, epoch, seed=3, shuffle=True)
            for s in range(plan.steps_per_epoch):
                used.update(files.paths[start + int(i)] for i in order.step_indices(s))
        assert used <= staged
        # and nothing more than the block: each node copies only what its ranks read
        assert len(staged) == stop - start


def test_multi_sample_files_needed_by_a_range_and_validation():
    files = FileSet(("/d/a.h5", "/d/b.h5", "/d/c.h5"), (10, 5, 20))
    assert needed_files([(files, [(8, 12)])]) == ["/d/a.h5", "/d/b.h5"]
    assert needed_files([(files, [(15, 16)])]) == ["/d/c.h5"]
    assert needed_files([(files, [(0, 0)])]) == []
    val = FileSet.single("/v/val.h5", 7)
    assert needed_files([(files, [(0, 3)]), (val, [(2, 5)]), (None, [])]) == ["/d/a.h5", "/v/val.h5"]


def test_scatter_stages_on_rank_0_alone_and_spares_read_nothing():
    train = [(0, 5), (5, 10), (10, 10)]
    val = [(20, 22), (22, 24), (24, 24)]
    assert rank_ranges(0, 2, train, val, scatter=True) == ([(0, 5), (5, 10)], [(20, 22), (22, 24)])
    assert rank_ranges(1, 2, train, val, scatter=True) == ([], [])
    assert rank_ranges(1, 2, train, val, scatter=False) == ([(5, 10)], [(22, 24)])
    assert rank_ranges(2, 2, train, val, scatter=False) == ([], [])     # a spare


def test_each_file_is_copied_once_per_node_split_by_bytes():
    needs = [["a", "b", "c"], ["c", "d"], ["a", "e"], []]
    sizes = {"a": 100, "b": 10, "c": 60, "d": 50, "e": 5}
    copies = assign_copies(needs, sizes)
    flat = [p for mine in copies for p in mine]
    assert sorted(flat) == ["a", "b", "c", "d", "e"]          # each once
    loads = [sum(sizes[p] for p in mine) for mine in copies]
    assert max(loads) == 100 and sum(loads) == 225             # the largest file alone
    assert copies == assign_copies(needs, dict(reversed(list(sizes.items()))))   # same on every rank
    assert assign_copies([[], []], {}) == [[], []]


def test_staged_names_keep_files_of_the_same_name_apart():
    a, b = staged_name("/data/train/x.h5"), staged_name("/data/val/x.h5")
    assert a != b and a.endswith("-x.h5") and b.endswith("-x.h5")
    assert staged_name("/data/train/../train/x.h5") == a


def test_space_and_the_start_up_line():
    assert space_problem("/dev/shm", "n1", 100, 100, 3) is None
    msg = space_problem("$TMPDIR", "n1", 3 << 20, 1 << 20, 3)
    assert "data.stage_dir=$TMPDIR on n1" in msg and "1.0 MiB free" in msg and "3.0 MiB" in msg
    line = describe_staging("/dev/shm", [(3, 1 << 20), (2, 1 << 20)], 0.5)
    assert line.startswith("staged 5 file(s), 2.0 MiB, to data.stage_dir=/dev/shm on 2 node(s) in 0.50 s")


def test_a_copy_is_checked_by_size_and_never_left_half_made(tmp_path):
    src = tmp_path / "src.h5"
    src.write_bytes(os.urandom(5000))
    dst = tmp_path / "out" / "copy.h5"
    dst.parent.mkdir()
    copy_checked(str(src), str(dst), 5000)
    assert dst.read_bytes() == src.read_bytes()
    other = tmp_path / "out" / "changed.h5"
    with pytest.raises(DataError, match="holds 5000 bytes, the file held 4000"):
        copy_checked(str(src), str(other), 4000)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["copy.h5"]    # no copy, no .part left
    with pytest.raises(DataError, match="failed"):
        copy_checked(str(tmp_path / "missing.h5"), str(other), 1)
    assert not (tmp_path / "out" / ("changed.h5" + PART)).exists()


def test_the_run_directory_is_made_checked_and_removed(tmp_path, monkeypatch):
    root = make_stage_root(str(tmp_path / "new" / "stage"), "hpc_rlx-stage-x")
    assert os.path.isdir(root) and os.listdir(root) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"data.stage_dir=.*file/sub is not writable"):
        make_stage_root(str(tmp_path / "file" / "sub"), "hpc_rlx-stage-x")
    remove_stage_root(root)
    remove_stage_root(root)         # twice: another rank of the node may have been first
    assert not os.path.exists(root)
    monkeypatch.setenv("STAGE_HERE", str(tmp_path))
    assert expand_stage_dir("$STAGE_HERE/s") == os.path.join(str(tmp_path), "s")
    monkeypatch.delenv("STAGE_UNSET_VAR", raising=False)
    with pytest.raises(DataError, match="STAGE_UNSET_VAR"):
        expand_stage_dir("$STAGE_UNSET_VAR/s")


def test_shuffled_orders_stay_in_the_block_over_many_epochs():
    # the plan's promise staging rests on, checked directly against the rows
    plan = plan_shards(103, 10, 3, "drop")
    for rank in range(3):
        a, b = plan.shard_bounds(rank)
        for epoch in range(5):
            order = EpochOrder(plan, rank, epoch, seed=1, shuffle=True)
            idx = np.concatenate([order.step_indices(s) for s in range(plan.steps_per_epoch)])
            assert idx.min() >= 0 and idx.max() < b - a


def test_where_a_run_stages_is_not_part_of_its_config_fingerprint():
    """A resume may stage elsewhere (another node's $TMPDIR) or not at all: the same training."""
    from hpc_rlx.config.fingerprint import config_fingerprint
    cfg = {"data": {"path": "/d/train", "x": "x", "y": "y", "stage_dir": None, "stage_keep": False},
           "train": {"batch_size": 8, "seed": 0, "dtype": "float32"}}
    staged = {**cfg, "data": {**cfg["data"], "stage_dir": "/dev/shm", "stage_keep": True}}
    moved = {**cfg, "data": {**cfg["data"], "path": "/d/other"}}
    assert config_fingerprint(cfg, "/") == config_fingerprint(staged, "/") != config_fingerprint(moved, "/")


def test_a_file_the_node_did_not_stage_is_read_in_place(tmp_path):
    """After a dead rank a shard may move to a node that lacks some of its files (a spare on
    another node): those are read from data.path; `close` removes the copies unless kept."""
    from hpc_rlx.runtime.staging import Staged
    root = make_stage_root(str(tmp_path / "stage"), "hpc_rlx-stage-t")
    files = FileSet(("/d/a.h5", "/d/b.h5", "/d/c.h5"), (1, 1, 1), one_sample=True)
    staged = Staged(root, {"/d/a.h5": f"{root}/a", "/d/c.h5": f"{root}/c"}, keep=False)
    read = files.remapped(staged.path)
    assert [read.opened(f) for f in range(3)] == [f"{root}/a", "/d/b.h5", f"{root}/c"]
    from hpc_rlx.data.stage_plan import read_places
    assert read_places([(read, [(0, 2)]), (read, [(2, 3)])]) == {"staged_reads": 2, "in_place_reads": 1}
    assert read_places([(files, [(0, 3)])]) == {}          # not staged: summary.json says nothing
    Staged(root, {}, keep=True).close()
    assert os.path.isdir(root)
    staged.close()
    assert not os.path.exists(root)
