"""The fixed inputs of the streaming cases (`mpi_scripts/streaming_cases.py`), shared with the
test that holds the runs against its own reference (`tests/mpi/policies/test_streaming_reference.py`).
No MPI here: the test process imports it."""

from __future__ import annotations

import numpy as np

K = 8                   # local steps per sync of a fragment (policy.anchor)
EPOCHS = 3
BATCH = 4               # samples per rank and step (train.batch_size = 4 x ranks)
HIDDEN = 64             # model.hidden=[64]
INNER_LR = 2.0 ** -4    # a power of two: lr x gradient is exact, an SGD step rounds once
OUTER_LR, OUTER_MU, OUTER_WARMUP = 0.7, 0.9, 1


def gradient(rank: int, position: int, n: int) -> np.ndarray:
    """The mean gradient of `rank`'s local step at `position` (its local steps since the run
    began): eighths in [-1, 1], different per rank, step and parameter."""
    i = np.arange(n)
    return (((7 * rank + 3 * position + 5 * i + (i * i) % 13) % 17) - 8) / 8.0


def start_params(n: int) -> np.ndarray:
    i = np.arange(n)
    return ((3 * i) % 11 - 5) / 16.0


def overrides(data: str, ranks: int) -> list[str]:
    """The cases' config: SGD without momentum at a constant power-of-two rate, float64,
    DiLoCo's outer step after one warm-up sync per fragment (`case_keys` sets the rest)."""
    return [f"data.path={data}", "data=file", "checkpoint=off", "report.plots=false",
            "report.tensorboard=false", f"model.hidden=[{HIDDEN}]", "train.dtype=float64",
            f"train.epochs={EPOCHS}", f"train.batch_size={BATCH * ranks}", "optim=sgd",
            f"optim.lr={INNER_LR}", "optim.momentum=0", "optim.schedule=constant",
            "comm.shared_memory=false", "policy=async", "policy.tune=false", f"policy.anchor={K}",
            "policy.outer=diloco", f"policy.outer_lr={OUTER_LR}", f"policy.outer_momentum={OUTER_MU}",
            f"policy.outer_warmup={OUTER_WARMUP}"]


def case_keys(fragments: int, delay: int, wire: str) -> dict:
    """The policy.* keys of one case."""
    return {"fragments": fragments, "fragment_delay": delay,
            "outer_wire_dtype": None if wire == "null" else wire}
