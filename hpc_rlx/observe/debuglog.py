"""hpc_rlx's own debug log (rank 0), through Python logging and Hydra's log configuration.

``hydra.verbose=true`` puts the root logger at DEBUG: hpc_rlx then logs how it chose the run
directory, the spec it shipped, and what its checkpoints do, while libraries that flood DEBUG
(matplotlib's font manager, h5py, PIL) stay at INFO. Name them to see theirs:
``hydra.verbose=[hpc_rlx,matplotlib]``. ``hydra.verbose=hpc_rlx`` is hpc_rlx's log alone.
"""

from __future__ import annotations

import logging

from hpc_rlx.comm import waiting
from hpc_rlx.config import rundirs

NOISY = ("matplotlib", "PIL", "h5py", "fsspec", "urllib3", "asyncio")

log = logging.getLogger("hpc_rlx")


def configure(verbose) -> None:
    """Call once Hydra has configured logging, with `hydra.verbose` (True, a name or names)."""
    if verbose is True or str(verbose).lower() == "true":
        for name in NOISY:
            logging.getLogger(name).setLevel(logging.INFO)


def spec_summary(spec) -> str:
    """One line of what rank 0 ships: where, how many ranks, which training (fingerprints)."""
    graph = spec.graph or {}
    return (f"spec: run_dir={spec.run_dir} world_size={spec.world_size} "
            f"config_fingerprint={spec.config_fingerprint} "
            f"graph nodes={len(graph.get('nodes', []))} data={spec.data.path} "
            f"rows={spec.data.n_train} optim={spec.optim['name']} lr={spec.optim['lr']} "
            f"policy={spec.policy['name']} resume={spec.resume} checkpoint={spec.checkpoint}")


def startup(spec) -> None:
    if waiting.APPLIED:
        log.debug("more ranks than cores on this node: waiting ranks sleep between MPI polls (%s)",
                  " ".join(f"{k}={v}" for k, v in waiting.APPLIED.items()))
    if rundirs.LAST_CHOICE:
        log.debug("run directory under Slurm: %s", rundirs.LAST_CHOICE)
    log.debug(spec_summary(spec))
