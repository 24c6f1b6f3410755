"""Hydra launcher plugin of hpc_rlx: each sweep point as its own Slurm batch job (hydra/launcher=slurm)."""
