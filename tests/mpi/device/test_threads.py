"""Threads per rank: the default never oversubscribes the cores, and the limit really reaches
the BLAS pools of every rank (checked with threadpoolctl inside real mpirun jobs)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_rlx.device.threads import cores_available, default_threads

from tests.support.jobs import REPO, explain, mpirun


@given(cores=st.integers(1, 512), ranks=st.integers(1, 128), lanes=st.integers(1, 8))
def test_default_fills_but_never_oversubscribes_the_cores(cores, ranks, lanes):
    t = default_threads(cores, ranks, lanes)
    assert t >= 1
    if ranks * lanes <= cores:
        assert ranks * lanes * t <= cores            # no oversubscription
        assert ranks * lanes * (t + 1) > cores       # and no idle core a thread could have used
    else:
        assert t == 1                                # more ranks than cores: one thread each


def test_default_examples():
    assert default_threads(64, 8) == 8
    assert default_threads(64, 8, lanes=2) == 4
    assert default_threads(2, 4) == 1
    assert default_threads(48, 0) == 48              # ranks unknown counts as one


def test_cores_available_respects_affinity():
    n = cores_available()
    assert 1 <= n <= (os.cpu_count() or n)
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


PROBE = textwrap.dedent("""
    import json, sys
    from mpi4py import MPI
    import numpy  # loads the BLAS whose pool is limited
    from threadpoolctl import threadpool_info
    from hpc_rlx.device.threads import limit_threads, cores_available

    arg = sys.argv[1]
    got = limit_threads(MPI.COMM_WORLD, None if arg == "default" else int(arg))
    pools = {i["internal_api"]: i["num_threads"] for i in threadpool_info()}
    rows = MPI.COMM_WORLD.gather({"rank": MPI.COMM_WORLD.rank, "got": got, "pools": pools,
                                  "cores": cores_available()}, root=0)
    if MPI.COMM_WORLD.rank == 0:
        print("RESULT " + json.dumps(rows))
""")


def _probe(tmp_path, n: int, arg: str) -> list[dict]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    # an inherited OMP/OPENBLAS setting must not decide the outcome: the limit does
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "7", "OPENBLAS_NUM_THREADS": "7"}
    proc = mpirun(n, [str(script), arg], timeout=120, env=env)
    assert proc.returncode == 0, explain(proc)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.mpi
def test_explicit_limit_reaches_every_rank_blas(tmp_path):
    rows = _probe(tmp_path, 2, "1")
    assert len(rows) == 2
    for r in rows:
        assert r["got"] == 1
        assert r["pools"], "no BLAS/OpenMP pool found to limit"
        assert set(r["pools"].values()) == {1}, r


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2])
def test_default_limit_shares_the_node(tmp_path, n):
    rows = _probe(tmp_path, n, "default")
    for r in rows:
        expected = max(1, r["cores"] // n)
        assert r["got"] == expected
        assert n * r["got"] <= max(r["cores"], n)
        # a pool can be smaller than the limit (e.g. built for fewer threads), never larger
        assert all(v <= expected for v in r["pools"].values()), r
