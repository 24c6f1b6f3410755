#!/usr/bin/env bash
# Convolutions, several checkouts of hpc_rlx alternated in one run: bench_engine.py --only cnn
# (engine step vs PyTorch, from each checkout), then the model=cnn full path (this checkout's
# bench_cnn.py with hpc_rlx from each checkout, the same PyTorch loop), one BLAS thread.
#   [ROUNDS=2] [FULL_REPEATS=5] bash bench/compare_cnn.sh CHECKOUT [CHECKOUT ...]
# e.g. mkdir /tmp/old && git archive 7f9f497 | tar -x -C /tmp/old && bash bench/compare_cnn.sh /tmp/old .
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
ROUNDS=${ROUNDS:-2}; FULL=${FULL_REPEATS:-5}
SIDES=(); for d in "$@"; do SIDES+=("$(cd "$d" && pwd)"); done
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for i in $(seq "$ROUNDS"); do
  for side in "${SIDES[@]}"; do
    echo "== engine $side (round $i, load $(cut -d' ' -f1-3 /proc/loadavg))"
    (cd "$side" && timeout 600 "$PY" bench/bench_engine.py --only cnn 2>&1 | grep -E "^[A-Z]|engine |torch |ratio")
  done
done
for i in $(seq "$ROUNDS"); do
  for side in "${SIDES[@]}"; do
    echo "== full path, hpc_rlx from $side (round $i, load $(cut -d' ' -f1-3 /proc/loadavg))"
    timeout 1200 "$PY" "$HERE/bench/bench_cnn.py" --code "$side" --repeats "$FULL" 2>&1 | tail -n 4
  done
done
