"""How a rank waits inside MPI when its node has more ranks than cores.

MPI libraries busy-poll while a rank waits in a blocking call. MPICH spins and calls
`sched_yield` every 1000 polls; on a node with more ranks than cores that still takes a full
share of a core from the rank everyone is waiting for, and the time shows up as system CPU.
Where this node's ranks outnumber the cores they may use, the rank asks its MPI, before MPI
starts (the settings are read in MPI_Init), to sleep between polls instead:

- MPICH: `MPIR_CVAR_ENABLE_HEAVY_YIELD=1` (a nanosleep instead of `sched_yield`), every
  `MPIR_CVAR_POLLS_BEFORE_YIELD=16` polls.
- Open MPI: `OMPI_MCA_mpi_yield_when_idle=1`.

A value already in the environment (the site's, the user's) wins. A rank the launcher bound to
one core is taken as not oversubscribed: the launcher gave each rank a core of its own. On
8 ranks over 2 cores this took a 2-epoch job from 10.4 to 8.2 CPU-seconds (bench/README.md).
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from hpc_rlx.base.topology import cores_available, layout_from_env

SLEEPY_WAIT = {
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "16",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}

# what this process changed, for the debug log (observe/debuglog.py)
APPLIED: dict[str, str] = {}


def oversubscribed(ranks_on_node: int, usable_cores: int) -> bool:
    """More ranks on this node than the cores they may use; a rank bound to a single core
    (the launcher's one-rank-per-core binding) is not."""
    return usable_cores > 1 and ranks_on_node > usable_cores


def sleepy_wait_settings(env: Mapping[str, str], usable_cores: int) -> dict[str, str]:
    """The variables to add to `env` so that waiting ranks sleep: none unless the launcher's
    variables say this node is oversubscribed, and none the environment already sets."""
    layout = layout_from_env(env)
    if layout is None or not oversubscribed(layout[1], usable_cores):
        return {}
    return {k: v for k, v in SLEEPY_WAIT.items() if k not in env}


def apply_before_mpi_starts(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put the settings into this process's environment; call before `import mpi4py.MPI`."""
    added = sleepy_wait_settings(env, cores_available())
    env.update(added)
    APPLIED.update(added)
    return added
