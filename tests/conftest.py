"""Rules for the whole suite, in particular for running it on two pytest workers.

``make test`` runs ``pytest -n 2`` (pytest-xdist): on a 2-core machine about a third of the serial run's
CPU time is idle (launches, sleeps, waits for a timeout, Slurm scheduling), and a second worker fills it.
The contract that keeps that safe:

- **One file, one worker** (``WholeFiles``, the scheduler below): every test file is one unit of work,
  so a module fixture (a reference run several tests compare against) runs once.
- **tests/integration is one unit**: one local Slurm (a session fixture on fixed ports), one set of
  emulated hosts, one container store.
- **Multi-rank files first, the short unit-test files last**, so the two workers end together.
- **``@pytest.mark.alone`` runs with nothing beside it**: a test whose assertion depends on timing (a
  prediction against a measurement, a straggler ratio, a deadline). A fair reader-writer lock on two
  files that both workers share: every other test holds it shared, an ``alone`` test exclusively, and a
  turnstile keeps a waiting ``alone`` test from being starved by the other worker's next test.

Without xdist (plain ``pytest``) none of this does anything.
"""
from __future__ import annotations

import fcntl
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs with no other test beside it (its assertion depends on timing)")


def work_unit(nodeid: str) -> str:
    """The unit of work of a test id ('tests/mpi/test_x.py::test_y[..]'): its file, or the folder for
    tests/integration."""
    path = nodeid.split("::", 1)[0]
    return "tests/integration" if path.startswith("tests/integration/") else path


# unit-test files of one long test (mypy over the package; every CPU test under coverage): first among the unit
# files, so that the last units are short and the two workers end together
LONG_UNIT_FILES = frozenset({"tests/unit/test_type_check.py", "tests/unit/test_cuda_coverage.py"})


def pytest_collection_modifyitems(config, items):
    """Multi-rank units first, the biggest (by number of tests) first; unit tests last. A stable sort,
    the same on every worker, so each file keeps its own order."""
    sizes = Counter(work_unit(item.nodeid) for item in items)

    def order(item):
        unit = work_unit(item.nodeid)
        return (unit.startswith("tests/unit/"), unit not in LONG_UNIT_FILES, -sizes[unit], unit)

    items.sort(key=order)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WholeFiles(LoadScopeScheduling):
        """xdist's scope scheduling with ``work_unit`` as the scope, in collection order."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep pytest_collection_modifyitems' order

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WholeFiles(config, log)


@pytest.fixture(autouse=True)
def _share_the_machine(request, tmp_path_factory):
    """Shared lock for ordinary tests, exclusive for ``alone`` ones (only under xdist)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of this run
    alone = request.node.get_closest_marker("alone") is not None
    with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "machine.lock", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
