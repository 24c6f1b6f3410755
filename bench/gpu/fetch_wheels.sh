#!/usr/bin/env bash
# Wheels for running bench/gpu_check.sh on a GPU machine with no package index.
#
#   bash bench/gpu/fetch_wheels.sh [DEST] [PYTHON_VERSION]     # defaults: .whl 3.12
#   # copy the repository with DEST to the GPU machine, then there:
#   WHEELHOUSE=.whl bash bench/gpu_check.sh
#
# Only what a CUDA Python image usually lacks: hydra-core and its two dependencies, and an MPI
# (the mpich wheel, which ships mpiexec and libmpi) with the mpi4py that matches it. NumPy,
# h5py, CuPy, PyTorch, pytest and the rest are taken from the image (gpu_check.sh's preflight
# names any that are missing). The versions are the ones this repository's tests run with.
# About 15 MB in all.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=${1:-$REPO/.whl}
PYVER=${2:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$DEST"

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux_2_5_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" \
    "hydra-core==1.3.2" "omegaconf==2.3.0" "mpich==5.0.2" "mpi4py==4.1.2"
# antlr4-python3-runtime 4.9.x (hydra's pin) is published only as a source archive: build the
# pure-Python wheel here so the GPU machine needs no build step
"$PY" -m pip wheel -q --no-deps -w "$DEST" "antlr4-python3-runtime==4.9.3"

ls -l "$DEST"
echo "wheelhouse: $DEST ($(du -sh "$DEST" | cut -f1)) for CPython $PYVER on x86_64 Linux"
