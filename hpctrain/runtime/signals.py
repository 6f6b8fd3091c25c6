"""Stop requests from outside: signals and the scheduler's time limit. Handlers only set a flag.

``SignalFlag(["USR1", "TERM"])`` installs Python handlers that record the first signal received and
nothing else (never checkpoint inside a handler: it runs between two bytecodes of whatever the rank
was doing, possibly inside MPI). The training loop reads the flag once per step, and the ranks agree
on it with one collective (``hpctrain/train/stop.py``).

Start-up: ``hpctrain train`` creates the flag first thing in its entry point (``hpctrain/cli.py``),
before the heavy imports (torch, MPI: seconds, tens of seconds on a parallel file system), for
``DEFAULT_EXIT_SIGNALS``; once the config is read, ``retarget(cfg.train.exit_signals)`` narrows it.
A signal that arrives during start-up is thus recorded, not fatal (Slurm's ``--signal`` may come up
to 60 s early), and a recorded signal the config does not list takes its default action then.
With the PyPI MPICH wheel, ``MPI_Init`` keeps a Python handler installed before it (checked:
``tests/mpi/test_startup_signal.py``). ``restore()`` puts the previous handlers back.

``scheduler_deadline()``: the wall-clock time (epoch seconds) at which the batch job will be killed,
from ``SLURM_JOB_END_TIME`` or ``squeue -h -j $SLURM_JOB_ID -o %e``; None outside Slurm.
"""
from __future__ import annotations

import datetime as dt
import os
import signal
import time
import subprocess

from hpctrain.errors import HpcTrainError


DEFAULT_EXIT_SIGNALS = ("USR1", "TERM")  # train.exit_signals' default


class SignalFlag:
    """Records the first of ``names`` (e.g. "USR1", "TERM") that this process receives."""

    def __init__(self, names):
        self.received: str | None = None
        self.received_at: float | None = None  # time.time() of that signal (the stop's timing in metrics.jsonl)
        self._previous = {}
        for name in names:
            signum = _signum(name)
            self._previous[signum] = signal.signal(signum, self._handle)

    def retarget(self, names) -> "SignalFlag":
        """Handle exactly ``names`` from now on (validated first). A signal received before that is
        not among ``names`` takes its default action now (e.g. TERM ends the process), as it would
        have without this flag."""
        wanted = {_signum(name) for name in names}
        for signum in wanted - set(self._previous):
            self._previous[signum] = signal.signal(signum, self._handle)
        for signum in set(self._previous) - wanted:
            handler = self._previous.pop(signum)
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if self.received and _signum(self.received) not in wanted:
            early, self.received = self.received, None
            os.kill(os.getpid(), _signum(early))
        return self

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name.removeprefix("SIG")
            self.received_at = time.time()

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}


def _signum(name: str) -> int:
    try:
        return int(getattr(signal, "SIG" + name.upper().removeprefix("SIG")))
    except (AttributeError, TypeError):
        raise HpcTrainError(f"train.exit_signals: unknown signal {name!r} (e.g. USR1, USR2, TERM, INT)") from None


def scheduler_deadline(env=None) -> float | None:
    """Epoch seconds when the Slurm job reaches its time limit, or None (no Slurm, no limit, no answer)."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(env["SLURM_JOB_END_TIME"])
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True,
                             timeout=20, stdin=subprocess.DEVNULL).stdout.strip()
        return dt.datetime.fromisoformat(out).timestamp()  # local time, as squeue prints it
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None  # "UNLIMITED", "N/A", no squeue: no deadline known


def slurm_job_to_requeue(env=None) -> str | None:
    """The id ``scontrol requeue`` takes for this job (array tasks: ``ARRAYJOB_TASK``), or None."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def requeue_slurm_job(job: str) -> str | None:
    """``scontrol requeue JOB``; returns None on success, else why it failed (not requeueable, ...)."""
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job}: {exc}"
    if result.returncode != 0:
        return f"scontrol requeue {job}: {(result.stderr or result.stdout).strip() or result.returncode}"
    return None
