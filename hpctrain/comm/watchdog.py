"""Watchdog and byte counters for every communication call (invariant: no wait is forever).

A blocking call sets ``Watchdog.blocking`` for its duration; a non-blocking one registers with
``begin`` and leaves with ``end`` when its handle completes (both cost well under a microsecond:
the message is only formatted if a call stalls). A daemon thread
checks the in-flight calls once a second; a call older than ``timeout_s`` prints which operation,
on which group, of how many bytes, has stalled on which rank, and aborts the MPI job, so a dead or
diverged peer ends the run with a message instead of hanging it until the batch job's wall time.
mpi4py releases the GIL inside MPI calls, so the thread runs while the main thread is blocked.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class OpCounter:
    calls: int = 0
    bytes: int = 0  # payload bytes handed to the network by this rank (the tensor's size)
    seconds: float = 0.0  # time blocked in this op (blocking calls and waits)


@dataclass
class CommStats:
    """Per (group, op) counters; ``total_seconds`` feeds the trainer's ``comm_time_s``."""

    ops: dict = field(default_factory=lambda: defaultdict(OpCounter))

    def total_seconds(self) -> float:
        return sum(c.seconds for c in self.ops.values())

    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.ops.values())


class Watchdog:
    """Aborts the job when one communication call outlives ``timeout_s`` (0 disables the thread)."""

    def __init__(self, rank: int, timeout_s: float = 600.0, abort=None):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self._abort = abort  # callable(exit_code); default: MPI.COMM_WORLD.Abort
        self._inflight: dict[int, tuple] = {}  # non-blocking calls: token -> (op, comm, nbytes, start)
        self.blocking = None  # the blocking call in flight on the main thread, same tuple (set directly)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = None
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
            self._thread.start()

    def begin(self, op: str, comm, nbytes: int = 0) -> int:
        """Register a call in flight; cheap (the description is only formatted if it stalls)."""
        token = next(self._ids)
        self._inflight[token] = (op, comm, nbytes, time.perf_counter())
        return token

    def end(self, token: int) -> None:
        self._inflight.pop(token, None)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            now = time.perf_counter()
            calls = list(self._inflight.values()) + ([self.blocking] if self.blocking else [])
            for op, comm, nbytes, started in calls:
                if now - started > self.timeout_s:
                    size = f" of {nbytes} bytes" if nbytes else ""
                    self._fire(f"{op}{size} on group '{comm.name}' (world ranks {list(comm.members)})", now - started)
                    return

    def _fire(self, description: str, waited: float) -> None:
        sys.stderr.write(
            f"hpctrain: rank {self.rank}: {description} did not complete in {waited:.0f} s "
            f"(timeout {self.timeout_s:.0f} s): a peer rank died, hangs, or skipped this call. "
            f"Aborting the job. Raise comm timeout (HPCTRAIN_COMM_TIMEOUT) only if the call is legitimately slow.\n")
        sys.stderr.flush()
        if self._abort is not None:
            self._abort(3)
        else:
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(3)
