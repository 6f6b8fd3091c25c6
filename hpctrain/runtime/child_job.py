"""One ``hpctrain train`` job as a child process, for the tools that run several (``loss_compare``,
``sweep``): its launcher, its command line, and a hard timeout that ends the job's whole process
group, so a stalled job never hangs the tool.

    launcher = find_launcher("mpiexec") or "mpiexec"
    cmd = train_command([launcher], 2, ["--config", "configs/tiny.toml", "train.steps=4"])
    code = launch_training_job(cmd, Path("runs/a/train.log"), timeout_s=600)  # None: timed out
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from hpctrain.runtime import env

KILL_GRACE_S = 5.0  # after SIGTERM, before SIGKILL


def find_launcher(name: str) -> str | None:
    """Full path of the launcher program ``name``: beside ``sys.executable`` first (a venv's ``mpiexec``
    belongs to the MPI that mpi4py uses), then on PATH; None if neither has it."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def train_command(launcher: list[str], nprocs: int, train_args: list[str],
                  launcher_args: list[str] | None = None) -> list[str]:
    """``<launcher> -n NPROCS <launcher_args> python -m hpctrain.cli train <train_args>``."""
    return [*launcher, "-n", str(nprocs), *(launcher_args or []), sys.executable, "-m", "hpctrain.cli", "train",
            *train_args]


def launch_training_job(cmd: list[str], log_path: Path, timeout_s: float) -> int | None:
    """Run ``cmd`` with stdout and stderr into ``log_path``, in its own process group; its exit status,
    or None if it ran past ``timeout_s`` (the whole group is then ended: SIGTERM, then SIGKILL; so it is
    when the wait is interrupted).
    The child gets ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1`` unless they are set."""
    child = env.child_environ(defaults={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child,
                                start_new_session=True)  # own process group: a timeout ends the whole job
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        except BaseException:  # Ctrl-C of the tool: its child job (another process group) ends too
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
