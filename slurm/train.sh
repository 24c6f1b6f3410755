#!/bin/bash
# hpc_rlx training as a Slurm batch job: one MPI rank per task, data-parallel over all nodes.
#
#   mkdir -p logs                                     # Slurm does not create the log directory
#   sbatch slurm/train.sh                             # the default job
#   sbatch slurm/train.sh model=cnn policy=cadence train.epochs=20     # Hydra overrides pass through
#   sbatch --nodes=4 --time=12:00:00 slurm/train.sh optim.lr=0.05      # sbatch options beat the header
#   sbatch --ntasks-per-node=8 --cpus-per-task=4 slurm/train.sh         # more ranks and cores per rank
#
# Edit the header for your site in this one place. Lines starting "##SBATCH" are switched off.
# The defaults (1 node, 2 ranks of 1 CPU) fit the smallest node, so the job never pends on a
# request no node can meet (squeue shows Reason=PartitionConfig for that); ask for more with
# sbatch options as above, or here.
#SBATCH --job-name=hpc_rlx
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
##SBATCH --gpus-per-node=4
##SBATCH --partition=compute
##SBATCH --account=myproject
#SBATCH --time=01:00:00
# 90 s before the time limit every rank gets SIGUSR1: it checkpoints at the next step and exits,
# then the job requeues itself and resumes from that checkpoint (same job id, same run directory).
#SBATCH --signal=USR1@90
#SBATCH --requeue
# a requeued job appends to its log instead of overwriting it
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#
# Environment knobs (all optional):
#   HPC_RLX_VENV=/path/to/venv     virtual environment to use (default: the active one, else ./.venv)
#   HPC_RLX_LAUNCHER=srun|mpirun   skip detection; "srun" honours SLURM_MPI_TYPE / the site default
#   HPC_RLX_MPIRUN=mpirun          the mpirun to fall back on
#   HPC_RLX_REQUEUE=0              do not requeue after a preemption checkpoint
#   HPC_RLX_NTASKS=N               ranks when this script runs outside Slurm (bash slurm/train.sh)
#   HPC_RLX_MODULE=hpc_rlx.doctor  run the preflight check in exactly this job's environment
#   HPC_RLX_FT_DETECTOR_S=5        comm.on_failure=shrink|spare: seconds without a heartbeat before
#                                  Open MPI's failure detector declares a frozen rank dead (0: off)

set -euo pipefail

# ---- software environment ------------------------------------------------------------------
# On clusters with environment modules, load the site MPI/HDF5/CUDA here, for example:
#   module purge
#   module load gcc/12 openmpi/4.1 hdf5/1.14 cuda/12.4
submit_dir=${SLURM_SUBMIT_DIR:-$PWD}
venv=${HPC_RLX_VENV:-}
if [[ -z $venv && -z ${VIRTUAL_ENV:-} && -x $submit_dir/.venv/bin/python ]]; then
    venv=$submit_dir/.venv
fi
if [[ -n $venv ]]; then
    if [[ ! -x $venv/bin/python ]]; then
        echo "hpc_rlx: HPC_RLX_VENV=$venv has no bin/python" >&2
        exit 2
    fi
    export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
fi
python=${HPC_RLX_PYTHON:-python}
export PYTHONUNBUFFERED=1

# ---- threads: BLAS threads per rank = CPUs per task, so ranks x threads fit the cores ----------
threads=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
export VECLIB_MAXIMUM_THREADS=$threads NUMEXPR_NUM_THREADS=$threads

module=${HPC_RLX_MODULE:-hpc_rlx}
# Defaults go first so that the user's own overrides, later on the line, win.
defaults=()
if [[ $module == hpc_rlx ]]; then
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
        defaults+=("train.threads_per_rank=$threads")
    fi
    # The requeue after a preemption checkpoint is done below, once every rank has exited:
    # requeueing from inside the run kills ranks that are still shutting down MPI, and under
    # srun their leftovers break MPI_Init of the requeued job (same job and step ids).
    defaults+=("checkpoint.requeue=false")
fi

# ---- launcher: srun when its PMI matches this MPI, else mpirun --------------------------------
# A mismatched srun does not fail: every rank silently starts as rank 0 of a world of 1. So each
# candidate plugin is tried on two tasks, and kept only if MPI sees a world of 2. The plugins
# this MPI speaks are tried first: Open MPI starts under --mpi=pmix, MPICH and its derivatives
# (Intel MPI, MVAPICH) under --mpi=pmi2 (the MPICH wheel has no PMIx client).
mpi_library_of_python() {
    # MPI_Get_library_version up to its first line end or comma ("Open MPI v5.0.11", "MPICH
    # Version: 4.2.0"); it may be called before MPI_Init
    "$python" -c 'import mpi4py, re; mpi4py.rc.initialize = False; from mpi4py import MPI
print(" ".join(re.split(r"[\n,]", MPI.Get_library_version().replace("\0", ""))[0].split()))' \
        2>/dev/null || true
}

preferred_plugins() {
    case $1 in
        *"Open MPI"*) echo '^pmix' ;;
        *MPICH*|*"Intel(R) MPI"*|*MVAPICH*) echo '^pmi2$' ;;
        *) echo '^$' ;;
    esac
}

probe_srun() {
    timeout 120 srun --mpi="$1" --ntasks=2 --kill-on-bad-exit=1 --quiet "$python" -c \
        'import sys; from mpi4py import MPI; sys.exit(0 if MPI.COMM_WORLD.Get_size() == 2 else 3)' \
        >/dev/null 2>&1
}

srun_plugins() {
    if [[ -n ${SLURM_MPI_TYPE:-} ]]; then
        echo "$SLURM_MPI_TYPE"
        return
    fi
    # "srun --mpi=list" prints one plugin per indented line; this MPI's own first (pmix before
    # pmix_v4), then the others (pmix before pmi2)
    local offered preferred
    offered=$(srun --mpi=list 2>&1 | awk '/^[[:space:]]+[A-Za-z]/ {print $1}' \
        | grep -Ev '^(none|cray_shasta)$' || true)
    preferred=$(preferred_plugins "$mpi_library")
    grep -E "$preferred" <<<"$offered" | sort || true
    grep -Ev "$preferred" <<<"$offered" | sort -r || true
}

ntasks=${SLURM_NTASKS:-${HPC_RLX_NTASKS:-1}}
mpirun_bin=${HPC_RLX_MPIRUN:-mpirun}
choice=${HPC_RLX_LAUNCHER:-auto}
launch=()

# ---- fault tolerance: comm.on_failure=shrink|spare survives a dead rank through MPI's ULFM,
# which Open MPI 5's mpirun switches on with --with-ft ulfm; a rank started directly by srun
# has none (the run would refuse at start-up), so such a job is launched by mpirun inside the
# allocation. A failed node must not end the allocation either: that is sbatch's --no-kill,
# which only the submission can ask for (sbatch --no-kill slurm/train.sh comm.on_failure=shrink).
on_failure=""
for arg in "$@"; do
    case $arg in
        comm.on_failure=*) on_failure=${arg#comm.on_failure=} ;;
    esac
done
on_failure=${on_failure//[\'\"]/}
if [[ $on_failure == shrink || $on_failure == spare ]]; then
    if [[ $choice == srun ]]; then
        echo "hpc_rlx: comm.on_failure=$on_failure needs MPI's fault tolerance (ULFM), which a rank" \
             "started by srun does not have: unset HPC_RLX_LAUNCHER (mpirun --with-ft ulfm is used)" >&2
        exit 2
    fi
    choice=ulfm
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        # a running job cannot ask for it, nor does scontrol show whether it has it
        echo "hpc_rlx: comm.on_failure=$on_failure: a failed node ends the allocation unless the job" \
             "was submitted with sbatch --no-kill (a Hydra sweep on Slurm adds it)"
    fi
fi
# Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: pass it on
cpt=()
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    cpt=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi
if [[ $choice == ulfm ]]; then
    # Open MPI's failure detector (off by default): a rank that stops without dying (a frozen
    # process or node) is declared dead after this many seconds without a heartbeat, which its
    # own thread sends, so a rank busy in a long computation is not; the period a quarter of it
    detector_s=${HPC_RLX_FT_DETECTOR_S:-5}
    detector=()
    if [[ $detector_s != 0 ]]; then
        detector=(--mca mpi_ft_detector true --mca mpi_ft_detector_thread true
                  --mca mpi_ft_detector_timeout "$detector_s"
                  --mca mpi_ft_detector_period "$(awk -v t="$detector_s" 'BEGIN { print t / 4 }')")
    fi
    launch=("$mpirun_bin" --with-ft ulfm ${detector[@]+"${detector[@]}"} -n "$ntasks")
    why="comm.on_failure=$on_failure: Open MPI's ULFM, which srun cannot start"
elif [[ -z ${SLURM_JOB_ID:-} ]]; then
    # outside Slurm (bash slurm/train.sh): a plain local MPI run
    launch=("$mpirun_bin" -n "$ntasks")
    why="not in a Slurm job"
elif [[ $choice == srun ]]; then
    launch=(srun --kill-on-bad-exit=1 ${cpt[@]+"${cpt[@]}"})
    why="HPC_RLX_LAUNCHER=srun"
elif [[ $choice == mpirun ]]; then
    launch=("$mpirun_bin" -n "$ntasks")
    why="HPC_RLX_LAUNCHER=mpirun"
elif [[ $choice != auto ]]; then
    echo "hpc_rlx: HPC_RLX_LAUNCHER=$choice: expected srun, mpirun or auto" >&2
    exit 2
elif (( ntasks == 1 )); then
    launch=(srun --mpi=none ${cpt[@]+"${cpt[@]}"})
    why="one task"
else
    mpi_library=$(mpi_library_of_python)
    why="no srun MPI plugin starts this MPI"
    failed=()
    for plugin in $(srun_plugins); do
        if probe_srun "$plugin"; then
            launch=(srun --mpi="$plugin" --kill-on-bad-exit=1 ${cpt[@]+"${cpt[@]}"})
            why="srun --mpi=$plugin works with this MPI${mpi_library:+: $mpi_library}"
            why+="${failed[*]:+; tried first: ${failed[*]}}"
            break
        fi
        failed+=("$plugin")
    done
    if (( ${#launch[@]} == 0 )); then
        launch=("$mpirun_bin" -n "$ntasks")
    fi
fi
if [[ ${launch[0]} == "$mpirun_bin" ]] && ! command -v "$mpirun_bin" >/dev/null; then
    echo "hpc_rlx: cannot launch: $why, and '$mpirun_bin' is not on PATH ($PATH)" >&2
    exit 2
fi

# The run directory, to read how the run ended: hydra.run.dir if given, else the one the run
# would choose by itself (python -m hpc_rlx.rundirs: the job's directory only when this is the
# same training continuing, a requeue or a matching checkpoint, else slurm-<jobid>.<n>). It is
# then passed on as hydra.run.dir, so the run and this script agree.
run_dir=""
for arg in "$@"; do
    case $arg in
        hydra.run.dir=*) run_dir=${arg#hydra.run.dir=} ;;
    esac
done
run_dir=${run_dir#\'}
run_dir=${run_dir%\'}
if [[ $module == hpc_rlx && -z $run_dir && -n ${SLURM_JOB_ID:-} ]]; then
    run_dir=$("$python" -m hpc_rlx.rundirs "$@" 2>/dev/null | tail -n 1) || run_dir=""
    if [[ -z $run_dir ]]; then
        run_dir=outputs/slurm-$SLURM_JOB_ID${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}
    fi
    defaults+=("hydra.run.dir=$run_dir")
fi

# A fault-tolerant run outside Slurm: the run names its directory in this file as it starts
# (hpc_rlx/__main__.py), so that an mpirun exit 0 without a finished run is told from success
run_dir_report=""
# arguments under which the run names no one directory: a sweep, or Hydra printing and exiting
one_run=1
if printf '%s\n' "$@" | grep -qx -e '-m' -e '--multirun' -e '--help' -e '-h' -e '--hydra-help' -e '--cfg.*' \
        -e '-c.*' -e '--info.*' -e '-i.*' -e '--shell-completion' -e '-sc.*'; then
    one_run=0
fi
if [[ $choice == ulfm && $module == hpc_rlx && -z $run_dir && $one_run == 1 ]]; then
    run_dir_report=$(mktemp "${TMPDIR:-/tmp}/hpc_rlx-run-dir.XXXXXX")
    export HPC_RLX_RUN_DIR_REPORT=$run_dir_report
    launch+=(-x HPC_RLX_RUN_DIR_REPORT)
fi

echo "hpc_rlx: $(date '+%F %T') job ${SLURM_JOB_ID:-none} (${SLURM_JOB_NAME:-local}) restart" \
     "${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}: $ntasks ranks," \
     "$threads BLAS threads per rank"
echo "hpc_rlx: python $(command -v "$python"), launcher: ${launch[*]} ($why)"
if [[ $module == hpc_rlx && -n $run_dir ]]; then
    echo "hpc_rlx: run directory: $run_dir"
fi

# ---- run, then requeue if the run stopped for a preemption warning ----------------------------
# Slurm signals the ranks directly (--signal=USR1@90, scancel --signal). A signal sent to this
# shell instead (--signal=B:USR1@90, scancel -b) is passed on to srun/mpirun, which forward it.
# TERM means the job is being cancelled, timed out or requeued by Slurm: keep waiting for the
# ranks to write their checkpoint, and do not requeue on top of that.
child=""
got_term=0
forward() {
    if [[ -n $child ]]; then kill -s "$1" "$child" 2>/dev/null || true; fi
}
trap 'forward USR1' USR1
trap 'got_term=1' TERM

"${launch[@]}" "$python" -m "$module" ${defaults[@]+"${defaults[@]}"} "$@" &
child=$!
status=0
while :; do
    wait "$child" && status=0 || status=$?
    kill -0 "$child" 2>/dev/null || break
done
if (( status > 128 )); then
    # that wait was cut short by a trapped signal; the launcher's own status is still stored
    wait "$child" 2>/dev/null && status=0 || { s=$?; (( s == 127 )) || status=$s; }
fi
echo "hpc_rlx: $(date '+%F %T') ranks finished with status $status"

# Open MPI 5 under --with-ft ulfm tears the job down and exits 0 when a node's daemon is lost with
# its node (Open MPI issue #12227), and once after ranks crashed in MPI_Init under the failure
# detector: a fault-tolerant run that left no summary did not finish
if [[ -n $run_dir_report ]]; then
    [[ -s $run_dir_report ]] && run_dir=$(head -n 1 "$run_dir_report")
    rm -f "$run_dir_report"
fi
if [[ $choice == ulfm && $status == 0 && $module == hpc_rlx && $one_run == 1 ]]; then
    if [[ -z $run_dir ]]; then
        echo "hpc_rlx: error: mpirun exited 0 but no rank started the run (rank 0 never named its" \
             "run directory): the launch failed; see the lines above" >&2
        status=3
    elif [[ ! -f $run_dir/summary.json ]]; then
        echo "hpc_rlx: error: mpirun exited 0 but the run did not finish ($run_dir has no summary.json):" \
             "Open MPI ends a --with-ft ulfm job with status 0 when it loses a node's daemon (a node lost" \
             "with its daemon is not survived); resubmit with hydra.run.dir=$run_dir to resume from its" \
             "newest checkpoint" >&2
        status=3
    fi
fi

stopped_on_signal() {
    [[ -f $run_dir/summary.json ]] && "$python" -c 'import json, sys
sys.exit(0 if json.load(open(sys.argv[1])).get("status") == "signal" else 1)' "$run_dir/summary.json"
}
if [[ $module == hpc_rlx && -n ${SLURM_JOB_ID:-} && ${HPC_RLX_REQUEUE:-1} != 0 && $status == 0 \
      && $got_term == 0 ]] && stopped_on_signal; then
    echo "hpc_rlx: stopped on a preemption signal after a checkpoint: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || echo "hpc_rlx: scontrol requeue failed; resubmit to resume" >&2
fi
exit "$status"
