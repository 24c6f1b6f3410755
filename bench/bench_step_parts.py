"""The lean step's parts, old form vs new, side by side in one process (one BLAS thread).

    .venv/bin/python bench/bench_step_parts.py [--size 1863690] [--repeats 9]

For the MLP 784-1024-1024-10 (1.86 M parameters, float32) prints the per-step time of
- the SGD-momentum update after the Allreduce: divide by the sample count, then NumPy's
  buf = m*buf + g; p -= lr*buf (the first form) against `SGD.step(..., grad_scale=1/n)`, which
  folds the division in and runs in BLAS axpy/scal passes, over whole arrays (the second form)
  and block by block (`optim.BLOCK_BYTES`, today's);
- the AdamW update: scale the gradient, then torch's 15 NumPy passes op for op
  (`AdamW._plain_step`, the form before) against `AdamW.step(..., grad_scale=1/n)` (10 fused
  in-place passes, the scale folded into the coefficients), over whole arrays and by blocks;
- the non-finite check of the local gradient: isfinite in blocks against one dot product.
Every variant runs once per repeat, in turn (so background load hits them alike); each
figure is the best repeat, less the copy of the gradient every variant makes first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpc_rlx.comm.collective import _all_finite, finite_blockwise  # noqa: E402
from hpc_rlx.optim import base as optim  # noqa: E402  (BLOCK_BYTES)
from hpc_rlx.optim.adamw import AdamW  # noqa: E402
from hpc_rlx.optim.sgd import SGD  # noqa: E402


def best_ms(fns: dict, repeats: int, inner: int = 20) -> dict:
    """{name: best ms per call}, the variants alternating within every repeat."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[k].append((time.perf_counter() - t0) / inner)
    return {k: 1e3 * min(v) for k, v in times.items()}


def whole_array(make):
    """An optimizer from ``make()`` that walks whole arrays (one block), as before blocking."""
    keep = optim.BLOCK_BYTES
    optim.BLOCK_BYTES = 1 << 62
    try:
        return make()
    finally:
        optim.BLOCK_BYTES = keep


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1_863_690)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    size = args.size
    rng = np.random.default_rng(0)
    g = rng.standard_normal(size).astype(np.float32)
    buf, scratch, work = np.zeros_like(g), np.zeros_like(g), np.empty_like(g)
    n, lr, m = 128.0, 0.01, 0.9
    params = {k: np.zeros_like(g) for k in ("sgd0", "sgd1", "sgd2", "adam0", "adam1", "adam2")}
    sgd1 = whole_array(lambda: SGD(size, np, "float32", momentum=m))
    sgd2 = SGD(size, np, "float32", momentum=m)
    adam0, adam2 = AdamW(size, np, "float32"), AdamW(size, np, "float32")
    adam1 = whole_array(lambda: AdamW(size, np, "float32"))

    def sgd_numpy():
        np.copyto(work, g)
        np.divide(work, n, out=work)   # the policy's division by the global sample count
        buf.__imul__(m)
        buf.__iadd__(work)
        np.multiply(buf, lr, out=scratch)
        params["sgd0"].__isub__(scratch)

    def stepper(opt, key, rate):
        def run():
            np.copyto(work, g)         # the same copy on every side: the bucket is overwritten
            opt.step(params[key], work, rate, grad_scale=1.0 / n)
        return run

    def adam_plain():
        np.copyto(work, g)
        np.multiply(work, 1.0 / n, out=work)
        adam0.step_count += 1
        adam0._plain_step(params["adam0"], work, 1e-3)

    fns = {"copy": lambda: np.copyto(work, g),
           "sgd numpy": sgd_numpy, "sgd blas whole": stepper(sgd1, "sgd1", lr),
           "sgd blas blocks": stepper(sgd2, "sgd2", lr),
           "adam plain": adam_plain, "adam fused whole": stepper(adam1, "adam1", 1e-3),
           "adam fused blocks": stepper(adam2, "adam2", 1e-3),
           "finite blockwise": lambda: finite_blockwise(g), "finite dot": lambda: _all_finite(g)}
    with threadpool_limits(limits=1):
        t = best_ms(fns, args.repeats)
    c = t.pop("copy")
    print(f"{size} float32 parameters, best of {args.repeats} alternating repeats, one BLAS thread "
          f"(the gradient copy, {c:.2f} ms, taken off the updates)")
    rows = [("SGD momentum update", "sgd numpy", "sgd blas whole", "sgd blas blocks"),
            ("AdamW update", "adam plain", "adam fused whole", "adam fused blocks")]
    for label, a, b, d in rows:
        old, whole, blocks = t[a] - c, t[b] - c, t[d] - c
        print(f"  {label:<20} old {old:6.2f} ms  fused {whole:6.2f} ms  fused+blocks {blocks:6.2f} ms"
              f"  new/old {blocks / old:.2f}")
    a, b = t["finite blockwise"], t["finite dot"]
    print(f"  {'non-finite check':<20} old {a:6.2f} ms  new {b:6.2f} ms  new/old {b / a:.2f}")


if __name__ == "__main__":
    main()
