"""Launching under a real Slurm: `srun --mpi=pmi2` works; srun without PMI is a clear error, not N singletons."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import ROOT, mpi_env


def srun(slurm_env, *args, timeout=120):
    env = mpi_env(slurm_env)
    # After the parallel-HDF5 setup (scripts/setup_parallel_hdf5.sh) installs Debian's libibverbs/libucx, 2-node
    # pmi2 launches of the MPICH wheel failed intermittently here (the PMI2 put garbled, see below);
    # keeping UCX to shared memory and TCP avoided it in our runs. It changes nothing else these tests check.
    env.setdefault("UCX_TLS", "self,sm,tcp")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return subprocess.run(["timeout", "-k", "5", str(timeout), "srun", "--immediate=30", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


# Slurm's pmi2 plugin now and then misreads a long key-value put during MPI_Init (the MPICH wheel's UCX
# address): slurmstepd logs "mpi/pmi2: invalid client request" ("value not properly terminated") and
# MPI_Init fails or never returns, before hpctrain runs. Seen in fresh-clone CI runs on the local Slurm
# (2026-11-23 once; 2026-11-24 on all four 2-node launches of one run, each hanging until the timeout,
# while the same launch a few minutes later took 10 s). Such a launch (that error, or a launch that
# timed out: a healthy one takes ~10 s) is retried, up to 3 attempts; any other failure is not. When
# every attempt shows that Slurm error the test is skipped, saying so (loaded machines: the plugin
# seems to mishandle a request that arrives in pieces).
PMI2_TRANSPORT_FAULTS = ("mpi/pmi2: invalid client request", "mpi/pmi2: value not properly terminated")
LAUNCH_TIMEOUT_S, LAUNCH_ATTEMPTS = 60, 3


def info(slurm, *srun_args):
    cmd = ("--mpi=pmi2", *srun_args, sys.executable, "-m", "hpctrain.cli", "info", "--tp", "2", "--json")
    for _ in range(LAUNCH_ATTEMPTS):
        result = srun(slurm, *cmd, timeout=LAUNCH_TIMEOUT_S)
        transport_fault = result.returncode in (124, 137) or any(f in result.stderr for f in PMI2_TRANSPORT_FAULTS)
        if result.returncode == 0 or not transport_fault:
            break
    if result.returncode != 0 and any(f in result.stderr for f in PMI2_TRANSPORT_FAULTS):
        # every attempt failed inside Slurm's pmi2 plugin, before hpctrain's code ran: nothing here tests hpctrain
        pytest.skip(f"Slurm's pmi2 plugin garbled MPI_Init's key-value put on {LAUNCH_ATTEMPTS} launches "
                    f"(slurmstepd: {next(f for f in PMI2_TRANSPORT_FAULTS if f in result.stderr)!r})")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_srun_pmi2_two_nodes(slurm):
    doc = info(slurm, "-N2", "--ntasks-per-node=2")
    assert doc["launcher"] == "slurm" and doc["world_size"] == 4
    assert doc["nodes"] == 2 and doc["ranks_per_node"] == [2, 2]
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 2, 3]
    for r in doc["ranks"]:  # tp groups stay inside a node
        assert len({x["node"] for x in doc["ranks"] if x["rank"] in r["tp_group"]}) == 1
    assert doc["groups_crossing_nodes"] == ["dp"]


def test_uneven_placement_is_detected_not_assumed(slurm, tmp_path):
    """Tasks placed 3 + 1 on two nodes (arbitrary distribution): one tp group must span nodes: say so."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1\nn1\nn1\nn2\n")
    doc = info({**slurm, "SLURM_HOSTFILE": str(hostfile)}, "-n4", "--distribution=arbitrary")
    assert doc["nodes"] >= 2 and sum(doc["ranks_per_node"]) == 4 and doc["ranks_per_node"] != [2, 2]
    assert "tp" in doc["groups_crossing_nodes"] and "span nodes" in doc["warnings"][0]


def test_srun_without_pmi_is_a_clear_error(slurm):
    result = srun(slurm, "--mpi=none", "-N1", "-n2", sys.executable, "-m", "hpctrain.cli", "info")
    assert result.returncode != 0
    assert "slurm started 2 tasks" in result.stderr and "srun --mpi=pmi2" in result.stderr, result.stderr
