#!/usr/bin/env bash
# A second environment that mirrors a cluster: Debian MPICH + parallel HDF5, with mpi4py and h5py
# built from source against them (h5py.get_config().mpi is True), so the collective MPI-IO
# checkpoint writer is tested for real. ~11 min from nothing, ~1 min with pip's wheel cache warm.
# Usage: scripts/setup_parallel_hdf5.sh [VENV_DIR]; idempotent. The venv holds dependencies only (run
# hpctrain from the checkout with PYTHONPATH) and lives outside the checkout by default, so it is built
# once per machine, not once per clone.
set -euo pipefail
V=${1:-${HPCTRAIN_MPI_VENV:-$HOME/.cache/hpctrain/venv-mpi}}
STAMP="hpctrain-parallel-hdf5 v1"
PY=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive
if [ -x "$V/bin/python" ] && [ "$(cat "$V/.stamp" 2>/dev/null)" = "$STAMP" ] \
   && "$V/bin/python" -c "import h5py, mpi4py.MPI; assert h5py.get_config().mpi" 2>/dev/null; then
  echo "parallel HDF5 environment $V is ready"; exit 0
fi
if ! dpkg -s libhdf5-mpich-dev mpich libmpich-dev >/dev/null 2>&1; then
  apt-get update -qq
  apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends mpich libmpich-dev libhdf5-mpich-dev pkg-config >/dev/null
fi
mkdir -p "$(dirname "$V")"
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/pip" install -q -U pip "setuptools>=77" wheel cython pkgconfig numpy torch==2.13.0
# never the PyPI mpich wheel here: mpi4py must load Debian's MPICH
"$V/bin/pip" uninstall -q -y mpich 2>/dev/null || true
if ! "$V/bin/python" -c "import mpi4py.MPI as M; assert 'MPICH' in M.Get_library_version() and 'pypi' not in M.Get_library_version().lower()" 2>/dev/null; then
  MPICC=/usr/bin/mpicc.mpich "$V/bin/pip" install -q --no-binary=mpi4py --no-cache-dir mpi4py
fi
if ! "$V/bin/python" -c "import h5py; assert h5py.get_config().mpi" 2>/dev/null; then
  HDF5_MPI=ON CC=/usr/bin/mpicc.mpich HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/mpich \
    "$V/bin/pip" install -q --no-binary=h5py --no-build-isolation --no-cache-dir h5py
fi
"$V/bin/pip" install -q pytest pytest-timeout rich matplotlib
"$V/bin/python" -c "import h5py; assert h5py.get_config().mpi, 'h5py was built without MPI'"
echo "$STAMP" > "$V/.stamp"
echo "parallel HDF5 environment $V is ready"
