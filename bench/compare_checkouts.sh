#!/usr/bin/env bash
# Old vs new code, alternated in one run: bench_engine, bench_collective and the hpc_rlx side of
# bench_ddp, each run from each checkout with the same Python (one BLAS thread).
#   bash bench/compare_checkouts.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS]
# e.g. git worktree add /tmp/old 7bd88fd && bash bench/compare_checkouts.sh /tmp/old .
set -euo pipefail
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); ROUNDS=${3:-2}
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
uptime
for i in $(seq "$ROUNDS"); do
  for side in "$OLD" "$NEW"; do
    echo "== engine $side (round $i)"
    (cd "$side" && timeout 600 "$PY" bench/bench_engine.py 2>&1 | grep -E "^[A-Z]|engine |ratio")
    echo "== collective $side (round $i)"
    (cd "$side" && timeout 600 "$PY" bench/bench_collective.py --sizes 1,8,32 --repeats 8 2>&1 | grep -v "^#")
  done
done
echo "== full path (hpc_rlx side of bench_ddp), samples/s"
for i in $(seq "$ROUNDS"); do
  for n in 1 2; do
    for side in "$OLD" "$NEW"; do
      rate=$(cd "$side" && timeout 900 "$PY" -c '
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, "bench")
import bench_ddp as b
n = int(sys.argv[1]); work = Path(tempfile.mkdtemp())
data = b.prepare_synthetic(work / "syn.h5", b.PER_RANK_BATCH * 2 * 24, b.FEATURES, b.CLASSES)
print(b.run_hpc(n, data, 3, work)["samples_per_s"])' "$n" | tail -n 1)
      echo "round $i, $n rank(s), $side: $rate"
    done
  done
done
uptime
