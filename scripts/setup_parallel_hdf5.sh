#!/usr/bin/env bash
# A second environment that mirrors a cluster: Debian MPICH + parallel HDF5, with mpi4py and h5py that load
# them (h5py built from source against them: h5py.get_config().mpi is True), so the collective MPI-IO
# checkpoint writer is tested for real. ~2-3 min from nothing on 2 cores (apt packages, ~40 s of pip, ~75 s
# of CPU for h5py's build): mpi4py is PyPI's wheel (built for the MPICH ABI), pointed at Debian's MPICH by a
# one-line shim library, and h5py is built at -O0 (a test environment: its speed is HDF5's, not the glue's).
# Before v2, both were built from source at -O2: ~11 min.
# Usage: scripts/setup_parallel_hdf5.sh [--system] [VENV_DIR]; idempotent. --system: the Debian packages only
# (what changes the machine's libraries; the rest touches nothing outside the venv). The venv holds dependencies
# only (run hpctrain from the checkout with PYTHONPATH) and lives outside the checkout by default, so it is
# built once per machine, not once per clone. One setup at a time per venv (a lock beside it: a second waits,
# then finds the venv ready).
set -euo pipefail
SYSTEM_ONLY=0
if [ "${1:-}" = "--system" ]; then SYSTEM_ONLY=1; shift; fi
V=${1:-${HPCTRAIN_MPI_VENV:-$HOME/.cache/hpctrain/venv-mpi}}
STAMP="hpctrain-parallel-hdf5 v3"
PY=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9
if [ -x "$V/bin/python" ] && [ "$(cat "$V/.stamp" 2>/dev/null)" = "$STAMP" ] \
   && "$V/bin/python" -c "import h5py, mpi4py.MPI; assert h5py.get_config().mpi" 2>/dev/null; then
  echo "parallel HDF5 environment $V is ready"; exit 0
fi
if ! dpkg -s libhdf5-mpich-dev mpich libmpich-dev >/dev/null 2>&1; then
  apt-get update -qq
  apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends mpich libmpich-dev libhdf5-mpich-dev pkg-config >/dev/null
fi
if [ "$SYSTEM_ONLY" = 1 ]; then echo "parallel HDF5: Debian MPICH and HDF5 installed"; exit 0; fi
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/pip" install -q -U pip "setuptools>=77" wheel cython pkgconfig numpy torch==2.13.0 "mpi4py>=4.1"
# never the PyPI mpich wheel here: mpi4py must load Debian's MPICH
"$V/bin/pip" uninstall -q -y mpich 2>/dev/null || true
# mpi4py's wheel loads the MPICH ABI's libmpi.so.12 from $V/lib (mpi4py._mpiabi); Debian names its MPICH
# libmpich.so.12. The shim is that name (its SONAME) and needs libmpich.so.12, so the MPI symbols resolve to
# Debian's library, the one libhdf5_mpich links, loaded once.
if [ ! -e "$V/lib/libmpi.so.12" ]; then
  printf '/* libmpi.so.12 for the mpi4py wheel: Debian MPICH under the MPICH ABI name */\n' > "$V/lib/mpich-abi-shim.c"
  /usr/bin/cc -shared -fPIC -o "$V/lib/libmpi.so.12" -Wl,-soname,libmpi.so.12 -Wl,--no-as-needed \
    "$V/lib/mpich-abi-shim.c" -L/usr/lib/x86_64-linux-gnu -lmpich
fi
if ! "$V/bin/python" -c "import mpi4py.MPI as M; assert 'MPICH' in M.Get_library_version() and 'pypi' not in M.Get_library_version().lower()" 2>/dev/null; then
  MPICC=/usr/bin/mpicc.mpich "$V/bin/pip" install -q --force-reinstall --no-binary=mpi4py --no-cache-dir mpi4py
fi
if ! "$V/bin/python" -c "import h5py; assert h5py.get_config().mpi" 2>/dev/null; then
  CFLAGS="-O0 -g0" HDF5_MPI=ON CC=/usr/bin/mpicc.mpich HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/mpich \
    "$V/bin/pip" install -q --no-binary=h5py --no-build-isolation --no-cache-dir h5py
fi
"$V/bin/pip" install -q pytest pytest-timeout pytest-xdist rich matplotlib
"$V/bin/python" -c "import h5py; assert h5py.get_config().mpi, 'h5py was built without MPI'"
echo "$STAMP" > "$V/.stamp"
echo "parallel HDF5 environment $V is ready"
