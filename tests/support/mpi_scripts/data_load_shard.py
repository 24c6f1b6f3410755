"""Runs load_shard cases under mpirun; every rank records its result per case.

Usage: mpirun -n N python data_load_shard.py JOB.json OUT_DIR

JOB.json is a list of cases: {"name", "mode", "path", "x_name", "y_name", "bounds",
optional "chunk_bytes", "int_max", "forbid_open_nonroot", "fail_read_after"}.
On success rank r writes OUT_DIR/<name>.r<r>.x.npy and .y.npy; on DataError it writes
OUT_DIR/<name>.r<r>.err holding the message. Anything else crashes the job (a test failure).
"""

import json
import os
import sys

import h5py
import numpy as np
from mpi4py import MPI

from hpc_rlx.data import distribute
from hpc_rlx.base.errors import DataError


def _forbidden(*args, **kwargs):
    raise AssertionError("a non-root rank opened the HDF5 file in scatter mode")


def main():
    job, out = sys.argv[1], sys.argv[2]
    with open(job) as fh:
        cases = json.load(fh)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    orig = (h5py.File, h5py.is_hdf5, h5py.Dataset.read_direct, distribute._INT_MAX)
    for case in cases:
        if case.get("forbid_open_nonroot") and rank != 0:
            h5py.File = _forbidden
            h5py.is_hdf5 = _forbidden
        if "int_max" in case:
            distribute._INT_MAX = case["int_max"]
        if "fail_read_after" in case and rank == 0:
            calls = [0]

            def flaky(self, *a, _limit=case["fail_read_after"], **k):
                calls[0] += 1
                if calls[0] > _limit:
                    raise OSError("simulated disk failure")
                return orig[2](self, *a, **k)

            h5py.Dataset.read_direct = flaky
        kwargs = {"chunk_bytes": case["chunk_bytes"]} if "chunk_bytes" in case else {}
        base = os.path.join(out, f"{case['name']}.r{rank}")
        try:
            x, y = distribute.load_shard(
                comm, case["mode"], case["path"], case["x_name"], case["y_name"],
                [tuple(b) for b in case["bounds"]], **kwargs,
            )
        except DataError as e:
            with open(base + ".err", "w") as fh:
                fh.write(str(e))
        else:
            np.save(base + ".x.npy", x)
            np.save(base + ".y.npy", y)
        finally:
            h5py.File, h5py.is_hdf5, h5py.Dataset.read_direct, distribute._INT_MAX = orig
    comm.Barrier()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # a crash on one rank must end the whole job now, not leave the others in a collective
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
