"""A real Slurm (slurmctld + 2 slurmd on localhost) for the tests of this folder, started once per session."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    if os.geteuid() != 0 or (shutil.which("slurmctld") is None and shutil.which("apt-get") is None):
        pytest.skip("a local Slurm needs root and Debian's slurm packages (slurmctld, slurmd, munge)")
    state = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ, SLURM_TEST_DIR=str(state))
    up = subprocess.run(["bash", str(HERE / "slurm_up.sh")], env=env, capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        pytest.fail(f"could not start the test Slurm:\n{up.stdout}\n{up.stderr}")
    env["SLURM_CONF"] = str(state / "slurm.conf")
    yield env
    subprocess.run(["bash", str(HERE / "slurm_down.sh")], env=env, timeout=60)
