"""The lean step's parts, old form vs new, side by side in one process (one BLAS thread).

    .venv/bin/python bench/bench_step_parts.py [--size 1863690] [--repeats 7]

For the MLP 784-1024-1024-10 (1.86 M parameters, float32) prints the per-step time of
- the SGD-momentum update after the Allreduce: divide by the sample count, then NumPy's
  buf = m*buf + g; p -= lr*buf (the step before the change) against `SGD.step(...,
  grad_scale=1/n)`, which folds the division in and runs in BLAS axpy/scal passes;
- the non-finite check of the local gradient: isfinite in blocks against one dot product.
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
from hpc_rlx.runtime.optim import SGD  # noqa: E402


def best_ms(fn, repeats: int, inner: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1_863_690)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(args.size).astype(np.float32)
    p_old, p_new = np.zeros_like(g), np.zeros_like(g)
    buf, scratch, work = np.zeros_like(g), np.zeros_like(g), np.empty_like(g)
    n, lr, m = 128.0, 0.01, 0.9
    new = SGD(args.size, np, "float32", momentum=m)

    def old_sgd():
        np.copyto(work, g)
        np.divide(work, n, out=work)   # the policy's division by the global sample count
        buf.__imul__(m)
        buf.__iadd__(work)
        np.multiply(buf, lr, out=scratch)
        p_old.__isub__(scratch)

    def new_sgd():
        np.copyto(work, g)         # the same copy on both sides: the bucket is overwritten
        new.step(p_new, work, lr, grad_scale=1.0 / n)

    def copy_only():
        np.copyto(work, g)

    with threadpool_limits(limits=1):
        print(f"{args.size} float32 parameters, best of {args.repeats} repeats, one BLAS thread")
        base = best_ms(copy_only, args.repeats)
        old, fused = best_ms(old_sgd, args.repeats) - base, best_ms(new_sgd, args.repeats) - base
        print(f"  SGD momentum update   old {old:6.2f} ms  new {fused:6.2f} ms  new/old {fused / old:.2f}")
        a, b = best_ms(lambda: finite_blockwise(g), args.repeats), best_ms(lambda: _all_finite(g), args.repeats)
        print(f"  non-finite check      old {a:6.2f} ms  new {b:6.2f} ms  new/old {b / a:.2f}")


if __name__ == "__main__":
    main()
