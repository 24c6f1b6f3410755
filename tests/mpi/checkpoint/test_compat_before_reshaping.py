"""Checkpoints written by the code before the third reshaping (issue 47) resume bitwise: sync,
cadence, async with streaming fragments, and a sharded optimizer (comm.shard=optimizer).

Each fixture (tests/support/fixtures/ckpt_before_reshaping, written by
tests/support/make_compat_fixtures.py, whose README names the commit) holds a checkpoint taken in
the middle of a 2-rank float64 run and what that code ended the run with: the final parameters
and the last epoch record. The code under test resumes a copy of the checkpoint in a fresh run
directory and must end with the same bytes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hpc_rlx.checkpoint import checkpoints_dir

from tests.support.jobs import explain, train_job
from tests.support.make_compat_fixtures import CASES, FIXTURES, RANKS, last_record, model_params, write_data

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("compat_data"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_checkpoint_from_before_the_reshaping_resumes_bitwise(case, data, tmp_path):
    fixture = FIXTURES / case.name
    (saved,) = fixture.glob("ckpt-*.h5")
    run = tmp_path / "run"
    checkpoints_dir(run).mkdir(parents=True)
    resumed = shutil.copyfile(saved, checkpoints_dir(run) / saved.name)

    proc = train_job(RANKS, run, case.args(data), timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert f"resumed from {resumed}" in proc.stdout, explain(proc)

    expected, got = model_params(fixture), model_params(run)
    assert sorted(got) == sorted(expected)
    for name in expected:
        a, b = got[name], expected[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        differ = int(np.count_nonzero(a != b))
        assert differ == 0, (f"{case.name}: {name} differs in {differ} of {a.size} values "
                             f"(max abs {np.abs(a - b).max():.3e})")
    assert last_record(run) == json.loads((fixture / "last_record.json").read_text())
