# hpctrain: `make demo` runs the main job on 4 local ranks, `make test` runs the test suite.
# Both set up .venv first (scripts/setup.sh: idempotent, reinstalls only when setup.py changes).
# The venv's own mpiexec and hpctrain are used, so nothing needs activating.

VENV := .venv
BIN := $(VENV)/bin
NP ?= 4

# The demo job. To switch it (e.g. to training), change DEMO here or pass it: make demo DEMO="train --config configs/tiny.toml"
DEMO ?= bench comm --sizes 1K,1M,16M

# One torch thread per rank; MPICH polls less when ranks outnumber cores (oversubscribed laptops/CI).
export OMP_NUM_THREADS ?= 1
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= 1

.PHONY: setup demo test clean

setup:
	scripts/setup.sh

demo: setup
	$(BIN)/mpiexec -n $(NP) $(BIN)/hpctrain $(DEMO)

test: setup
	$(BIN)/python -m pytest tests -v --timeout 900

clean:
	rm -rf $(VENV) hpctrain.egg-info .pytest_cache
