"""Work-weighted parameter consensus carried by one Allreduce(SUM).

Each rank writes `w_i * W_i` into the bucket's payload and `w_i` into its summed weight slot
(`sync_slots.SyncLayout` places both); after the SUM every rank holds `sum w_i W_i` and `sum w_i`,
and the consensus is the first divided by the second. Because the skip decision (summed
weight == 0) is read from the reduced bucket itself, it is identical on every rank.

Arrays may be NumPy or CuPy: only array methods and NumPy ufuncs with `out=` are used, which
CuPy dispatches to the device, so this module never imports CuPy.
"""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.base.checks import Check


def work_weight(n_steps: int, gamma: float = -1.0) -> float:
    """The consensus weight `n**gamma` of a rank that ran `n_steps` local steps.

    gamma = -1 (the default) divides each rank's move by its steps: every rank's shard then
    moves the model as much as in `policy=sync`, however fast the rank. With gamma = 1 a rank
    three times faster runs three times the steps on its own shard AND weighs three times more,
    so 90% of the consensus's move came from its half of the data (2 ranks), and validation
    lost 1.5 points against sync (`bench/README.md`, "Cadence against sync").

    An idle rank (n == 0) weighs exactly 0 for every gamma (Python's `0**0` is 1, which
    would let an idle rank vote).
    """
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps}")
    Check(lambda v: math.isfinite(v), "must be a finite number")("policy.gamma", gamma)
    if n_steps == 0:
        return 0.0
    return float(n_steps) ** float(gamma)


def _flat(a, what: str):
    if a.ndim != 1:
        raise ValueError(f"{what} must be a flat 1-D array, got shape {tuple(a.shape)}")
    return a


def weigh_into(params, weight: float, payload, reference=None) -> None:
    """Write `weight * params` into `payload` (exact zeros for a zero weight), in place. With
    `reference`, `weight * (params - reference)`: the form a coded wire sends
    (`policy.outer_wire_dtype`), small values around the agreed model rather than the model."""
    params = _flat(params, "params")
    if not (weight >= 0 and math.isfinite(weight)):
        raise ValueError(f"consensus weight must be finite and >= 0, got {weight!r}")
    if weight == 0:
        # exact zeros: 0 * NaN from an idle rank's stale params must not poison the sum
        payload.fill(0)
    elif reference is None:
        np.multiply(params, weight, out=payload)
    else:
        np.subtract(params, reference, out=payload)
        payload *= weight


def consensus_into(payload, total: float, out_params, reference=None) -> bool:
    """`out_params = payload / total` when `total > 0` (True); else False, `out_params` unchanged.
    With `reference`, the payload holds weighted differences from it (`weigh_into`),
    and the consensus is `reference + payload / total`."""
    out_params = _flat(out_params, "out_params")
    if not total > 0:
        return False
    np.divide(payload, total, out=out_params)
    if reference is not None:
        out_params += reference
    return True


def divergence_from(params, payload, total: float, own_weight: float | None = None,
                    chunk: int = 1 << 20, reference=None) -> float:
    """`||W_i - W|| / ||W||` for this rank, with W = `payload / total` the consensus still in
    the reduced bucket.

    Call it after the Allreduce and BEFORE `consensus_into` overwrites `params`, so the
    pre-sync local params and the consensus are both available without a full copy (the
    work is done in float64 chunks of `chunk` elements). A rank that did no work
    (`own_weight == 0`) or a sync where every rank was idle reports 0.0: nothing diverged.

    The value is local to the rank. To let every rank act on the max over ranks with no
    extra collective, write it into this rank's `divergence` report slot of the NEXT sync's
    bucket (see `sync_slots.SyncLayout`).
    """
    params = _flat(params, "params")
    n = params.size
    if not total > 0 or own_weight == 0:
        return 0.0
    diff_sq = 0.0
    cons_sq = 0.0
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        cons = payload[start:stop].astype(np.float64)
        cons /= total
        if reference is not None:       # the payload holds differences from the agreed model
            cons += reference[start:stop]
        cons_sq += float(cons.dot(cons))
        cons -= params[start:stop]
        diff_sq += float(cons.dot(cons))
    if cons_sq <= 0:
        return 0.0 if diff_sq == 0 else math.inf
    return math.sqrt(diff_sq / cons_sq)
