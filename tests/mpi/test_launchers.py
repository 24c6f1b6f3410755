"""What each MPI's launcher tells a rank (local rank, rank number), and the tests' launcher
command for MPICH and Open MPI (HPC_RLX_MPI=mpich|openmpi)."""

from __future__ import annotations

import json
import subprocess

import pytest

from hpc_rlx.base.topology import layout_from_env

from tests.support.jobs import MPI_IMPL, REPO, explain, launch_cmd, mpi_env
from tests.support.mpi_launch import launcher_flags, rank_of, selected_mpi


def test_local_rank_comes_from_the_innermost_launcher_not_a_stale_slurm_one():
    # mpirun inside one srun task: every rank inherits SLURM_LOCALID=0
    assert layout_from_env({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == (1, 2)
    assert layout_from_env({"SLURM_LOCALID": "0", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}) == (3, 4)
    assert layout_from_env({"SLURM_LOCALID": "2"}) == (2, 3)          # the node's size unknown
    assert layout_from_env({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "x"}) == (1, 2)
    assert layout_from_env({"PMI_RANK": "5"}) is None


def test_launcher_flags_for_each_mpi():
    assert launcher_flags("mpich", {"SLURM_JOB_ID": 7}) == ["-genv", "SLURM_JOB_ID", "7"]
    ompi = launcher_flags("openmpi", {"SLURM_JOB_ID": 7}, as_root=True)
    assert ompi[0] == "--allow-run-as-root" and ompi[-2:] == ["-x", "SLURM_JOB_ID=7"]
    assert {"--oversubscribe", "--bind-to", "none", "mpi_yield_when_idle"} <= set(ompi)
    assert "--allow-run-as-root" not in launcher_flags("openmpi", as_root=False)
    assert selected_mpi({"HPC_RLX_MPI": "OpenMPI"}) == "openmpi" and selected_mpi({}) == "mpich"
    with pytest.raises(RuntimeError, match="HPC_RLX_MPI='lam': use one of mpich, openmpi"):
        selected_mpi({"HPC_RLX_MPI": "lam"})


def test_rank_of_reads_either_launchers_variable():
    assert rank_of(b"A=1\0PMI_RANK=3\0") == 3
    assert rank_of(b"OMPI_COMM_WORLD_RANK=2\0PMIX_RANK=2\0") == 2
    assert rank_of(b"HOME=/root\0PMI_RANKS=1\0") is None


PROBE = """
import json, os
from mpi4py import MPI
from hpc_rlx.base.topology import layout_from_env, node_layout
comm = MPI.COMM_WORLD
row = {"rank": comm.rank, "split": node_layout(comm), "env": layout_from_env(os.environ),
       "probe": os.environ.get("HPC_RLX_PROBE")}
rows = comm.gather(row, root=0)        # one line from rank 0: the launchers interleave output
if comm.rank == 0:
    print("RESULT " + json.dumps(rows), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.openmpi
def test_each_launcher_gives_the_ranks_their_local_rank_and_the_ranks_only_variables(tmp_path):
    proc = subprocess.run(launch_cmd(3, ["-c", PROBE], rank_env={"HPC_RLX_PROBE": "ranks only"}),
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, explain(proc)
    rows = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert [r["rank"] for r in rows] == [0, 1, 2], explain(proc)
    for r in rows:
        assert r["split"] == [r["rank"], 3], (MPI_IMPL, r)
        assert r["env"] == r["split"], (MPI_IMPL, r)      # the fallback agrees with the split
        assert r["probe"] == "ranks only", (MPI_IMPL, r)
