"""A scheduler's signal that reaches a rank during start-up (imports, MPI init) stops the run cleanly.

Slurm may send ``--signal`` up to a minute early, and a rank spends seconds (on a parallel file
system tens of seconds) importing torch and MPI before training starts. The signal is sent the
moment a rank's ``/proc/PID/status`` shows a handler for USR1 (``SigCgt``), that is right after the
entry point installed it and before the heavy imports; before the fix the rank died with 138.
"""
import os
import signal
import subprocess
import sys
import time

from mpirun import ROOT, mpi_env, mpiexec

USR1_BIT = 1 << (signal.SIGUSR1 - 1)


def catches_usr1(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            fields = dict(line.split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return False
    return bool(int(fields.get("SigCgt", "0"), 16) & USR1_BIT)


def rank_pids(marker: str) -> list[int]:
    """The ranks: processes whose command line is ``python -m hpctrain.cli ... marker`` (not the launcher)."""
    pids = []
    for pid in subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0] == sys.executable.encode() and argv[1:3] == [b"-m", b"hpctrain.cli"]:
            pids.append(int(pid))
    return pids


def test_usr1_during_start_up_stops_and_saves_instead_of_killing_the_rank(tmp_path):
    run_dir = tmp_path / "startup-signal-run"
    cmd = ["timeout", "-k", "5", "240", *mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain.cli", "train",
           "--config", "configs/tiny.toml", "parallel.pp=1", "train.steps=50", "data.max_bytes=200000",
           "train.progress=false", f"train.run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    signalled, deadline = set(), time.monotonic() + 60
    while len(signalled) < 2 and time.monotonic() < deadline and proc.poll() is None:
        for pid in rank_pids(f"train.run_dir={run_dir}"):
            if pid not in signalled and catches_usr1(pid):
                os.kill(pid, signal.SIGUSR1)
                signalled.add(pid)
        time.sleep(0.005)
    out, _ = proc.communicate(timeout=240)
    assert len(signalled) == 2, out[-3000:]
    assert proc.returncode == 75, f"exit {proc.returncode}\n{out[-3000:]}"
    assert "signal USR1" in out, out[-3000:]
    assert (run_dir / "checkpoints" / "latest").exists()  # stopped, saved: a requeue resumes from it
