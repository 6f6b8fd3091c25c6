#!/usr/bin/env bash
# The cluster-like configuration: Debian MPICH + parallel HDF5 (collective mpio checkpoint writer).
# Sets the environment up (scripts/setup_parallel_hdf5.sh) and runs the checkpoint tests in it.
#   --if-possible: a notice and exit 0 where the environment cannot be built (no root or no apt-get);
#   --prepare: set it up and run nothing: the Debian packages now, the venv in the background (its log beside
#     it, $V.setup.log), so that `make test` builds it while the main suite runs; the next run of this
#     script waits for that build (setup's lock) and then tests.
set -euo pipefail
cd "$(dirname "$0")/.."
IF_POSSIBLE=0 PREPARE=0
while [ "${1:-}" = "--if-possible" ] || [ "${1:-}" = "--prepare" ]; do
  [ "$1" = "--if-possible" ] && IF_POSSIBLE=1 || PREPARE=1
  shift
done
if [ "$IF_POSSIBLE" = 1 ] && { [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; }; then
  echo "test_parallel_hdf5: skipped: building Debian MPICH + parallel HDF5 needs root and apt-get;"
  echo "  on a cluster, test the mpio writer with h5py built against the site's parallel HDF5."
  exit 0
fi
V=${HPCTRAIN_MPI_VENV:-$HOME/.cache/hpctrain/venv-mpi}
if [ "$PREPARE" = 1 ]; then
  bash scripts/setup_parallel_hdf5.sh --system "$V"
  nohup bash scripts/setup_parallel_hdf5.sh "$V" > "$V.setup.log" 2>&1 < /dev/null &
  echo "test_parallel_hdf5: building $V in the background (log: $V.setup.log)"
  exit 0
fi
bash scripts/setup_parallel_hdf5.sh "$V"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HPCTRAIN_TEST_MPIEXEC=mpiexec.mpich OMP_NUM_THREADS=1
"$V/bin/python" -c "import h5py; assert h5py.get_config().mpi"
exec "$V/bin/python" -m pytest -v -n 2 --timeout 900 -p no:cacheprovider \
  tests/mpi/test_checkpoint_writers.py \
  "tests/mpi/test_checkpoint.py::test_exact_resume_is_bitwise[dp2-pp2-zero1]" \
  "tests/mpi/test_checkpoint.py::test_flipped_byte_is_detected_and_resume_falls_back" "$@"
