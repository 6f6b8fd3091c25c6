"""Test-only fault injection: one rank dies, stops or stalls at a named point of a named step.

Set ``HPCTRAIN_FAULT`` to ``rank=R,step=N,phase=P,action=A`` (the tests in ``tests/mpi/test_faults.py``
and ``tests/mpi/test_hang_report.py`` do):

- ``phase``: ``forward`` (before the step's pipeline forward/backward), ``backward`` (after it, before
  the data-parallel reduction completes), ``optimizer`` (before the update) of training step N; ``corpus``
  (before the corpus broadcast), ``trace`` (before the trace's clock sync) and ``launch`` (after MPI_Init,
before the process grid is built: the others wait in its first collective, as behind a launch stuck in
the PMI), all at start-up: step 0
  (counted from 1); ``write``, ``verify``, ``publish`` of the checkpoint of step N (``publish``: on
  rank 0 after the step directory is renamed into place, before ``latest`` is updated); ``shm``: N counts
  this rank's barriers in a shared-memory window instead (comm.intra_node, hpctrain/comm/shm.py): after
  its N-th, inside the exchange, where its peers wait for it at the next one; ``copy``: the background copy
  of this rank's node-local piece of step N (checkpoint.local_dir);
- ``action``: ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself), ``sleep:S`` (stall S seconds in
  Python, the watchdog thread still alive), ``exit`` (``os._exit(9)``: dies without MPI_Finalize),
  ``nan`` (fills the tensor the hook passes, this rank's parameters at ``optimizer``, with NaN: a
  diverged state, for the divergence guard and the checkpoint writers' finite check), ``enospc``
  (at ``write``: this rank's checkpoint write fails with "No space left on device"), ``slow:S`` (sleep S
  seconds at that phase of step N and of EVERY later step: a straggler rank), ``raise`` (raises
  RuntimeError there, as a CUDA error in a background copy would).

With ``HPCTRAIN_FAULT_ONCE=PATH`` the fault fires only if PATH does not exist yet, and creates it first: the
first launch fails, a resubmitted or requeued one runs clean (``tests/integration/test_slurm_sweep.py``).

Without the variable every hook is one attribute test. Nothing in a real run sets it.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

from hpctrain.runtime import env

PHASES = ("forward", "backward", "weight", "optimizer", "write", "verify", "publish", "corpus", "trace", "launch", "shm",
          "copy")
ENV = "HPCTRAIN_FAULT"


@dataclass(frozen=True)
class FaultInjector:
    rank: int = -1  # -1: inactive
    step: int = 0
    phase: str = ""
    action: str = ""
    once_marker: str = ""  # $HPCTRAIN_FAULT_ONCE: fire only while this file does not exist

    @classmethod
    def from_env(cls, my_rank: int, environ=None) -> "FaultInjector":
        """This rank's fault from ``$HPCTRAIN_FAULT`` (``environ``: a mapping instead of os.environ)."""
        spec = env.fault_spec(environ)
        if not spec:
            return cls()
        try:
            fields = dict(part.split("=", 1) for part in spec.split(","))
            fault = cls(int(fields["rank"]), int(fields["step"]), fields["phase"], fields["action"],
                        env.fault_once_marker(environ))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{ENV}={spec!r}: expected rank=R,step=N,phase=P,action=A ({exc})") from None
        if fault.phase not in PHASES or fault.action.split(":")[0] not in ("kill", "stop", "sleep", "exit", "nan", "enospc", "slow", "raise"):
            raise ValueError(f"{ENV}={spec!r}: phase must be one of {PHASES}; action kill, stop, sleep:S, exit, nan, enospc, slow:S or raise")
        return fault if fault.rank == my_rank else cls()

    def __bool__(self) -> bool:
        return self.rank >= 0

    def hit(self, phase: str, step: int, tensor=None) -> None:
        """Called at each named point; acts once the (phase, step) matches on the chosen rank. ``tensor``:
        what ``nan`` poisons (ignored by the other actions)."""
        if self.rank < 0 or phase != self.phase or step < self.step:
            return
        action, _, argument = self.action.partition(":")
        if action == "slow":  # every step from N on, silently (a straggler, not an event)
            time.sleep(float(argument))
            return
        if step != self.step or not self._first_time():
            return
        sys.stderr.write(f"hpctrain: fault injection: rank {self.rank} {self.action} at {phase} of step {step}\n")
        sys.stderr.flush()
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "exit":
            os._exit(9)
        elif action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(injected at {phase} of step {step})")
        elif action == "raise":
            raise RuntimeError(f"injected error at {phase} of step {step}")
        elif action == "nan":
            if tensor is None:
                raise ValueError(f"{ENV}: action nan needs a hook that passes a tensor (phase optimizer)")
            tensor.fill_(float("nan"))
        else:
            time.sleep(float(argument or 3600))

    def _first_time(self) -> bool:
        """False once an earlier launch fired this fault (its ``once_marker`` exists); True otherwise."""
        if not self.once_marker:
            return True
        try:
            os.close(os.open(self.once_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
