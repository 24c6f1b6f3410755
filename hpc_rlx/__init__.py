"""hpc_rlx: data-parallel training of a shipped model graph over MPI.

Launch::

    mpirun -n 4 python -m hpc_rlx [hydra overrides]

Nothing is imported or initialised here: MPI starts only when the entry point runs.
"""

from hpc_rlx.base.version import __version__  # noqa: F401 - the package version, one home
