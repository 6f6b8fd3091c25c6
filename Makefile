# hpctrain: `make demo` runs the main job on 4 local ranks, `make test` runs the test suite.
# Both set up .venv first (scripts/setup.sh: idempotent, reinstalls only when setup.py changes).
# The venv's own mpiexec and hpctrain are used, so nothing needs activating.

VENV := .venv
BIN := $(VENV)/bin
NP ?= 4

# The demo job: a 4-rank tp=2 x pp=2 training run of the tiny GPT on the embedded corpus (~20-60 s on 2 cores).
# Another job: make demo DEMO="bench comm --sizes 1K,1M,16M". --resume none: a second `make demo` starts
# over, moving the first run's files to runs/tiny/superseded/ (hpctrain train refuses a used run
# directory without --resume).
DEMO ?= train --config configs/tiny.toml --resume none

# One torch thread per rank; MPICH polls less when ranks outnumber cores (oversubscribed laptops/CI).
export OMP_NUM_THREADS ?= 1
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= 1

.PHONY: setup demo test test-parallel-hdf5 clean

setup:
	scripts/setup.sh

# After the default demo job, a sample from the model it trained (one process, any layout's checkpoint).
SAMPLE ?= generate runs/tiny --prompt "def " --max-new-tokens 160 --seed 0

demo: setup
	$(BIN)/mpiexec -n $(NP) $(BIN)/hpctrain $(DEMO)
	@if [ "$(DEMO)" = "train --config configs/tiny.toml --resume none" ] && [ -n '$(SAMPLE)' ]; then $(BIN)/hpctrain $(SAMPLE); fi

# The default environment (PyPI MPICH, serial h5py), then the cluster-like one (Debian MPICH + parallel
# HDF5, collective MPI-IO checkpoints) where this machine can build it (root + apt-get), else a notice; its
# venv is built in the background while the main suite runs (--prepare; its Debian packages before).
# Two pytest workers (pytest-xdist): on 2 cores about a third of a serial run's CPU time is idle
# (launches, timeouts, Slurm). tests/conftest.py says what may run beside what. PYTEST_WORKERS=0: serial.
PYTEST_WORKERS ?= 2

test: setup
	scripts/test_parallel_hdf5.sh --if-possible --prepare
	$(BIN)/python -m pytest tests -v -n $(PYTEST_WORKERS) --timeout 900 --durations=60
	scripts/test_parallel_hdf5.sh --if-possible

test-parallel-hdf5:
	scripts/test_parallel_hdf5.sh

clean:
	rm -rf $(VENV) hpctrain.egg-info .pytest_cache
