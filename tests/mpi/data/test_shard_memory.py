"""A shard larger than the memory its rank may use, with `data.cache=memory`: refused before it
is read, with its size, the room and `data.cache=stream`, which then trains the same file under
the same limit. Real mpirun jobs under a real cgroup memory limit (tests/support/memory_limit.py);
without the check the kernel's OOM killer ends the job with signal 9 and no message."""

from __future__ import annotations

import re
import subprocess

import h5py
import numpy as np
import pytest

from tests.support.jobs import REPO, explain, launch_cmd, mpi_env
from tests.support.memory_limit import memory_limit_or_skip

LIMIT = 224 << 20
FEATURES = 256          # 1 KiB of float32 per row


def _file_over(path, nbytes: int):
    """x: `nbytes` of float32 rows (one random block repeated, quick to write), y: 3 classes."""
    rows = nbytes // (4 * FEATURES)
    block = np.random.default_rng(0).standard_normal((8192, FEATURES)).astype(np.float32)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (rows, FEATURES), np.float32)
        for lo in range(0, rows, len(block)):
            x[lo:lo + len(block)] = block[:rows - lo]
        f["y"] = (np.arange(rows) % 3).astype(np.int64)
    return path


@pytest.mark.mpi
def test_a_shard_over_the_ranks_memory_is_refused_and_stream_trains_it(tmp_path):
    limit = memory_limit_or_skip(LIMIT)
    # each of the 2 ranks would hold 126 MiB: more than half the limit, whatever else is in use
    data = _file_over(tmp_path / "big.h5", 252 << 20)

    def run(name: str, extra: list[str]) -> subprocess.CompletedProcess:
        cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / name}", "report.plots=false",
                             "data=file", f"data.path={data}", "model.hidden=[16]", "train.epochs=1",
                             "train.max_steps=4", "checkpoint=off"] + extra)
        with limit as lim:
            proc = subprocess.run(lim.wrap(cmd), cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                                  timeout=120)
            proc.oom = lim.oom_killed()
        return proc

    refused = run("memory", [])
    assert refused.returncode == 2 and not refused.oom, explain(refused)
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, explain(refused)
    line = errors[0]
    assert line.startswith("hpc_rlx: error (DataError, reported by rank "), line
    assert re.search(r"this rank's shard of .*big\.h5 \(.* rows of 1,032 bytes\) takes 12\d\.\d MiB of memory "
                     r"with data\.cache=memory", line), line
    assert re.search(r"more than the \d+\.\d MiB the rank may use \(the memory limit of cgroup .*: "
                     r"224\.0 MiB, \d+\.\d MiB in use, shared by its 2 ranks on ", line), line
    assert "data.cache=stream trains the same file" in line
    assert not (tmp_path / "memory").exists(), "a run refused before training keeps no directory"
    # the advice: the same file, the same limit
    streamed = run("stream", ["data.cache=stream"])
    assert streamed.returncode == 0 and not streamed.oom, explain(streamed)
