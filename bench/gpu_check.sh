#!/usr/bin/env bash
# hpc_rlx on a machine with an NVIDIA GPU: one script that installs what it needs, checks the
# GPU path end to end and prints results to paste into bench/RESULTS.md. At most 10 minutes on
# one GPU, the install included: every section has its own time limit, the limits below add up
# to that (tests/unit/test_gpu_check.py checks the sum), and no section outlives the whole
# check's deadline (CHECK_S, 600 s from the start).
#
#   bash bench/gpu_check.sh                           # installs into .venv-gpu, then checks
#   SKIP_INSTALL=1 bash bench/gpu_check.sh            # reuse .venv-gpu as it is
#   PYTHON=/opt/x/bin/python bash bench/gpu_check.sh  # use that interpreter, install nothing
#   WHEELHOUSE=.whl bash bench/gpu_check.sh           # no package index: install from wheels
#                                                     # made by bench/gpu/fetch_wheels.sh
#   INSTALL_ONLY=1 ...                                # stop after the install and the preflight
#
# Install: a venv (.venv-gpu, or $VENV) made from $BASE_PYTHON (default python3) that sees that
# interpreter's packages, also when it is itself a venv, so the CUDA PyTorch and CuPy already
# on the machine are reused. Online: `pip install -e '.[test,cudaNN]'`, with NN from the CUDA
# version nvidia-smi reports (12 -> cuda12 / cupy-cuda12x, 13+ -> cuda13); when a CUDA PyTorch
# is already there, the test extra's pinned CPU-era torch is left out so it is kept. Offline
# (WHEELHOUSE): hydra-core, omegaconf, antlr4, mpich and mpi4py from the wheelhouse, everything
# else from the machine, and hpc_rlx from this checkout (PYTHONPATH), with no build step.
#
# Sections (each continues after a failure of the previous one):
#   preflight   GPU, driver, CuPy, PyTorch, MPI and whether it is CUDA-aware; the doctor
#   gradcheck   every gpu-marked test (pytest -m gpu over the files that hold one): each kernel of
#               the graph engine on CuPy vs NumPy, forward and gradients, float64 and float32; the
#               optimizers on CuPy arrays; GPU lanes and GPU training; the cases it ran, passed,
#               failed or skipped, go to results.md ("Kernels covered", bench/gpu/covered.py)
#   train-1     1 rank: device=cpu, device=cuda, device=all (accuracy, lane shares, bucket path)
#   train-2     2 ranks sharing GPU 0: comm.cuda_aware=auto (direct when the MPI is CUDA-aware),
#               comm.cuda_aware=false (pinned staging), a bfloat16 wire, device=all
#   throughput  step time of CPU lane / GPU lane / both, and PyTorch CUDA: MLP and CNN
# Logs and results.md go to $GPU_CHECK_DIR (default: a new directory under /tmp).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
WORK=${GPU_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/hpc_rlx_gpu_check.XXXXXX")}
mkdir -p "$WORK"
RESULTS="$WORK/results.md"
: >"$RESULTS"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # Open MPI refuses root otherwise
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"                # works even if the install failed
T_START=$SECONDS

# Section limits, seconds. With the install (or the wheelhouse install) they add up to at most
# CHECK_S: 135 + 3 x 8 (the mpirun probe) + 45 + 20 + 160 + 70 + 85 + 25 + 10, plus KILL_AFTER for
# each of the 7 sections that run under it = 595.
CHECK_S=${CHECK_S:-600}
KILL_AFTER=3
LIMIT_INSTALL=135
LIMIT_PROBE=8
LIMIT_PREFLIGHT=45
LIMIT_DOCTOR=20
LIMIT_GRADCHECK=160
LIMIT_TRAIN1=70      # 3 runs of at most 22 s
LIMIT_TRAIN2=85      # 4 runs of at most 20 s
LIMIT_THROUGHPUT=25
LIMIT_COVERED=10

NAMES=()
STATES=()
TIMES=()

# run_section NAME LIMIT_SECONDS COMMAND...: log to $WORK/NAME.log, show its tail, never abort;
# the limit is cut to what is left of CHECK_S; a section with no time left is NOT RUN (a failure)
run_section() {
    local name=$1 limit=$2
    shift 2
    local log="$WORK/$name.log" t0=$SECONDS rc=0 state=ok
    local left=$((CHECK_S - (SECONDS - T_START) - KILL_AFTER))
    if [ "$left" -lt 5 ]; then   # not a skip: a section that never ran fails the check
        NAMES+=("$name")
        STATES+=("NOT RUN: CHECK_S=${CHECK_S}s spent")
        TIMES+=(0)
        echo "=== [$name] NOT RUN: CHECK_S=${CHECK_S}s spent"
        return 0
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo
    echo "=== [$name] (limit ${limit}s) $*"
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        state="TIMEOUT after ${limit}s"
    elif [ "$rc" -ne 0 ]; then
        state="FAILED (exit $rc)"
    fi
    tail -n "${TAIL_LINES:-30}" "$log" | sed 's/^/    /'
    NAMES+=("$name")
    STATES+=("$state")
    TIMES+=("$((SECONDS - t0))")
    echo "=== [$name] $state in $((SECONDS - t0))s (full log: $log)"
    return 0
}

skip_section() {
    NAMES+=("$1")
    STATES+=("SKIPPED: $2")
    TIMES+=(0)
    echo
    echo "=== [$1] SKIPPED: $2"
}

cuda_extra() {
    local major
    major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1 || true)
    if [ -n "$major" ] && [ "$major" -ge 13 ]; then echo cuda13; else echo cuda12; fi
}

# ---- install ------------------------------------------------------------------------------
# make_venv VENV: a venv that sees $BASE_PYTHON's packages. `venv --system-site-packages` only
# exposes the base installation's, so when $BASE_PYTHON is itself a venv (CUDA images often
# ship PyTorch and CuPy in one) its site-packages are added with a .pth file.
make_venv() {
    local venv=$1 base=${BASE_PYTHON:-python3} parent site
    if [ ! -x "$venv/bin/python" ]; then
        "$base" -m venv --system-site-packages "$venv" 2>/dev/null ||
            "$base" -m venv --system-site-packages --without-pip "$venv"
    fi
    parent=$("$base" -c "import site, sys; print(chr(10).join(site.getsitepackages()) if sys.prefix != sys.base_prefix else '')")
    if [ -n "$parent" ]; then
        site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        printf '%s\n' "$parent" >"$site/_gpu_check_parent_env.pth"
        echo "the venv also sees $base's packages: $(echo "$parent" | tr '\n' ' ')"
    fi
}

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
    skip_section install "PYTHON=$PYTHON is used as it is"
else
    VENV=${VENV:-$REPO/.venv-gpu}
    PY=$VENV/bin/python
    if [ -n "${SKIP_INSTALL:-}" ]; then
        skip_section install "SKIP_INSTALL is set"
    elif [ -n "${WHEELHOUSE:-}" ]; then
        echo "installing from the wheelhouse $WHEELHOUSE into $VENV (no package index)"
        make_venv "$VENV"
        # --ignore-installed: this MPI and its matching mpi4py land in the venv, whose lib/ is
        # where mpi4py looks for libmpi; --no-deps: the rest comes from the machine
        run_section install "$LIMIT_INSTALL" "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" \
            --no-deps --ignore-installed hydra-core omegaconf antlr4-python3-runtime mpich mpi4py
    else
        EXTRA=$(cuda_extra)
        echo "installing hpc_rlx[$EXTRA] into $VENV (nvidia-smi: $(nvidia-smi 2>/dev/null |
            sed -n 's/.*\(CUDA Version: *[0-9.]*\).*/\1/p' | head -n 1 || echo 'not found'))"
        make_venv "$VENV"
        if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            run_section install "$LIMIT_INSTALL" "$PY" -m pip install -q -e ".[$EXTRA]" mpich matplotlib \
                "pytest>=7.4" "pytest-timeout>=2.2" "hypothesis>=6.80"
        else
            run_section install "$LIMIT_INSTALL" "$PY" -m pip install -q -e ".[test,$EXTRA]"
        fi
    fi
fi

# ---- an mpirun that matches this mpi4py ---------------------------------------------------
MPIRUN=""
for cand in "$(dirname "$PY")/mpirun" "$(command -v mpirun || true)" "$(command -v mpiexec || true)"; do
    [ -n "$cand" ] && [ -x "$cand" ] || continue
    if timeout "$LIMIT_PROBE" "$cand" -n 2 "$PY" -c \
        "import sys; from mpi4py import MPI; sys.exit(0 if MPI.COMM_WORLD.Get_size() == 2 else 3)" \
        >/dev/null 2>&1; then
        MPIRUN=$cand
        break
    fi
done
if [ -n "$MPIRUN" ]; then
    echo "mpirun: $MPIRUN"
    export PATH="$(dirname "$MPIRUN"):$PATH"
else
    echo "no mpirun starts 2 ranks that see each other with this mpi4py: the MPI sections will fail"
    MPIRUN=mpirun
fi

# ---- the checks ---------------------------------------------------------------------------
run_section preflight "$LIMIT_PREFLIGHT" "$PY" bench/gpu/preflight.py --out "$RESULTS"
if [ -n "${INSTALL_ONLY:-}" ]; then
    echo "INSTALL_ONLY is set: stopping after the preflight (logs in $WORK)"
    exit 0
fi
run_section doctor "$LIMIT_DOCTOR" "$MPIRUN" -n 2 "$PY" -m hpc_rlx.doctor
# every gpu-marked test, from the files that hold one (collecting only those keeps the section's
# time for the tests)
mapfile -t GPU_TESTS < <(grep -rlE 'mark\.gpu\b' tests --include='test_*.py' | sort)
run_section gradcheck "$LIMIT_GRADCHECK" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu \
    --junitxml="$WORK/gpu_tests.xml" "${GPU_TESTS[@]}"
# tests that skip (no CuPy, one GPU for a 2-GPU test) are not a pass: say so in the summary
last=$((${#STATES[@]} - 1))
skipped=$(grep -Eo '[0-9]+ skipped' "$WORK/gradcheck.log" | tail -n 1 || true)
if [ "${STATES[$last]}" = ok ] && [ -n "$skipped" ]; then
    STATES[$last]="ok, but $skipped (reasons in the log)"
fi
timeout "$LIMIT_COVERED" "$PY" bench/gpu/covered.py "$WORK/gpu_tests.xml" --out "$RESULTS" >"$WORK/covered.log" 2>&1 ||
    echo "bench/gpu/covered.py: a case failed, none ran, or no report (see $WORK/covered.log)"
run_section train-1 "$LIMIT_TRAIN1" "$PY" bench/gpu/train_check.py --set single --mpirun "$MPIRUN" --timeout 22 --out "$RESULTS"
run_section train-2 "$LIMIT_TRAIN2" "$PY" bench/gpu/train_check.py --set pair --mpirun "$MPIRUN" --timeout 20 --out "$RESULTS"
run_section throughput "$LIMIT_THROUGHPUT" "$PY" bench/gpu/throughput.py --steps 20 --warmup 3 --out "$RESULTS"

# ---- summary ------------------------------------------------------------------------------
echo
echo "=================== summary ($((SECONDS - T_START))s in all; logs in $WORK) ==================="
failed=0
{
    echo
    echo "#### Sections"
    echo
    echo "| section | result | seconds |"
    echo "|---|---|---|"
} >>"$RESULTS"
for i in "${!NAMES[@]}"; do
    printf '  %-12s %-40s %5ss\n' "${NAMES[$i]}" "${STATES[$i]}" "${TIMES[$i]}"
    echo "| ${NAMES[$i]} | ${STATES[$i]} | ${TIMES[$i]} |" >>"$RESULTS"
    case "${STATES[$i]}" in ok* | SKIPPED*) ;; *) failed=1 ;; esac
done
echo
echo "----- paste into bench/RESULTS.md (also in $RESULTS) -----"
cat "$RESULTS"
echo "----- end -----"
exit "$failed"
