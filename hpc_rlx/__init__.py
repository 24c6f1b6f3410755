"""hpc_rlx: data-parallel training of a shipped model graph over MPI.

Launch::

    mpirun -n 4 python -m hpc_rlx [hydra overrides]

Nothing is imported or initialised here: MPI starts only when the entry point runs.
"""

__version__ = "0.1.0"
