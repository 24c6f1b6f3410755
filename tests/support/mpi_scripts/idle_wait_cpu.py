"""Rank 0 is late by LATE_S before a broadcast; rank 0 prints, as one JSON list, what every rank
got and the CPU seconds it spent from the start to the end of the broadcast. argv: blocking|idle"""

import json
import sys
import time

from mpi4py import MPI

from hpc_rlx.comm import idle_wait

LATE_S = 2.0

comm = MPI.COMM_WORLD
kind = sys.argv[1]
start = time.process_time()
if comm.rank == 0:
    time.sleep(LATE_S)
value = {"from": "rank 0"} if comm.rank == 0 else None
value = comm.bcast(value, root=0) if kind == "blocking" else idle_wait.bcast(comm, value, root=0)
gathered = idle_wait.allgather(comm, comm.rank)
mine = {"rank": comm.rank, "value": value, "gathered": gathered, "cpu_s": time.process_time() - start}
rows = comm.gather(mine, root=0)
if comm.rank == 0:
    print(json.dumps(rows), flush=True)
