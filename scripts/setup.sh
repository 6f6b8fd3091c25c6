#!/usr/bin/env bash
# Create .venv and install hpctrain (editable) with the PyPI MPICH wheel and the test tools.
# Idempotent: does nothing when .venv/.hpctrain-installed is newer than setup.py (delete it to force).
# PYTHON picks the interpreter (default python3, >= 3.11). Used by `make setup` and by .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.hpctrain-installed"

# An editable install leaves the package uncompiled; where PYTHONDONTWRITEBYTECODE is set (CI images
# often set it) every rank of every launch would then compile ~150 modules from source (~0.15 s a
# process, ~0.8 s of a 4-rank launch on 2 cores). Byte-compiling here (incremental) saves that.
compile_sources() {
  "$VENV/bin/python" -m compileall -q hpctrain tests benchmarks \
    || echo "setup: warning: byte-compiling the sources failed (see above); every launch compiles them instead" >&2
}

if [[ -f "$STAMP" && "$STAMP" -nt setup.py && "$STAMP" -nt pyproject.toml && "$STAMP" -nt scripts/constraints.txt && -x "$VENV/bin/hpctrain" && -x "$VENV/bin/mpiexec" ]]; then
  compile_sources
  echo "setup: $VENV is up to date (delete $STAMP to reinstall)"
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "setup: $PYTHON is older than Python 3.11; set PYTHON=python3.11" >&2; exit 1; }
  "$PYTHON" -m venv "$VENV"
fi
# torch is pinned to the CPU build by the constraints file (setup.py only asks for a range, which on
# its own resolves to a multi-GB CUDA build); on a GPU cluster install with the site's torch instead
"$VENV/bin/python" -m pip install --progress-bar off -c scripts/constraints.txt -e ".[mpi,test,compression,data,hf,monitor,fp8]"
"$VENV/bin/python" -c "import hpctrain, torch, mpi4py.MPI"  # fail here, not in the first test
compile_sources
touch "$STAMP"
echo "setup: ready ($VENV/bin/hpctrain, $VENV/bin/mpiexec)"
