"""Watchdog and byte counters for every communication call (invariant: no wait is forever).

Every call made through a ``Communicator`` is registered here while it is in flight, with its group
and a per-group sequence number: collectives are numbered 1, 2, ... on each group (every member makes
them in the same order, so ``allreduce #57 on dp`` is one call on every member), point-to-point
calls separately, with their peer. Registering costs well under a microsecond: a description is
only formatted if a call stalls.

A daemon thread (mpi4py releases the GIL inside MPI calls, so it runs while the main thread waits)
does two things once a period:
- answers status queries from other ranks (``hang_report.answer``) on its own duplicate of the
  world communicator, a channel that does not depend on any stuck collective;
- checks this rank's calls: one older than ``timeout_s`` starts a hang report
  (``hang_report.investigate``): ask every rank where it is, name the ranks that never reached the
  call (a rank that does not answer is stopped, dead or stuck in C code: its process state is read
  from ``/proc`` when it runs on this node), print ONE report job-wide, then abort the MPI job (exit
  code 3). A stall whose causes are all alive inside torch.compile (``train.compile``'s first step
  compiling graphs: a pipeline stage waits for its neighbour's compile) is not a hang: the watchdog
  says so once and restarts the call's stall clock, for at most ``COMPILE_PATIENCE_S`` more; once the
  compile is over, the call gets one more full ``timeout_s``. A call that completes while the ranks are
  asked (seconds), or a grid closed meanwhile (``close``), is no hang: nothing is reported.
"""
from __future__ import annotations

import atexit
import itertools
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hpctrain.runtime.errors_exit import abort_grace_s
from hpctrain.exit_codes import HANG

IDLE = math.inf  # a Slot's call record between calls: "started" never, so never stalled, whoever reads it
COMPILE_PATIENCE_S = 3600.0  # a stall whose causes are all inside torch.compile is reported after this much more
# the watchdog's clock is time.monotonic(); perf_counter reads the same clock where both are CLOCK_MONOTONIC
# (Linux, macOS), so one reading serves a ``Slot`` and the call's timing; elsewhere use monotonic
clock = time.perf_counter if time.get_clock_info("perf_counter").implementation == \
    time.get_clock_info("monotonic").implementation else time.monotonic


@dataclass
class OpCounter:
    calls: int = 0
    bytes: int = 0  # payload bytes handed to the network by this rank (the tensor's size)
    sent: int = 0  # bytes this rank puts on the wire for them (bandwidth-optimal algorithms; Communicator)
    seconds: float = 0.0  # time blocked in this op (blocking calls and waits)


@dataclass
class CommStats:
    """Per (group, op) counters; ``by_group`` feeds the trainer's ``comm_time_s`` and ``groups``."""

    ops: dict = field(default_factory=lambda: defaultdict(OpCounter))

    def total_sent(self) -> int:
        """Bytes this rank sent on all groups (metrics.jsonl ``bytes_sent`` is its per-step difference)."""
        return sum(c.sent for c in self.ops.values())

    def by_group(self) -> dict[str, tuple[float, int]]:
        """{group: (blocked seconds, bytes sent)} summed over ops (metrics.jsonl ``groups``: per-step
        differences)."""
        out: dict[str, tuple[float, int]] = {}
        for (group, _op), c in self.ops.items():
            seconds, sent = out.get(group, (0.0, 0))
            out[group] = (seconds + c.seconds, sent + c.sent)
        return out


class Call:
    """One call in flight: ``op`` on ``comm`` (a Communicator), collective number ``seq`` on that group
    (or, for point-to-point, this rank's ``seq``-th message with group rank ``peer``)."""

    __slots__ = ("op", "comm", "nbytes", "seq", "peer", "start", "numbered", "route", "origin")

    def __init__(self, op: str, comm, nbytes: int, seq: int, peer: int | None = None):
        self.op, self.comm, self.nbytes, self.seq, self.peer = op, comm, nbytes, seq, peer
        self.numbered = True
        self.route = ""  # how it travels when not MPI: "shared memory" (comm.intra_node's route)
        self.origin: Call | None = None  # the record a snapshot (``copy``) was taken of
        self.start = time.monotonic()

    def copy(self) -> "Call":
        """A snapshot of a reused record (a ``Slot``'s). ``start`` is read last: the record's call may end and
        the next begin meanwhile (its fields are written before its ``start``), and a start too new only makes
        the call look younger, never stalled."""
        new = Call.__new__(Call)
        new.op, new.comm, new.nbytes, new.seq, new.peer = self.op, self.comm, self.nbytes, self.seq, self.peer
        new.numbered, new.route, new.origin = self.numbered, self.route, self
        new.start = self.start
        return new

    def key(self) -> tuple[int, int]:
        """The same for every snapshot of one call (a reused record's calls differ by ``seq``)."""
        return id(self.origin if self.origin is not None else self), self.seq

    def describe(self) -> str:
        route = f" ({self.route})" if self.route else ""
        size = f" of {self.nbytes} bytes" if self.nbytes else ""
        peer = f" with group rank {self.peer} (world rank {self.comm.members[self.peer]})" if self.peer is not None else ""
        return (f"{self.op} #{self.seq}{route}{size}{peer} on group '{self.comm.name}' "
                f"(world ranks {list(self.comm.members)})")


class Slot:
    """A call made again and again (a persistent collective; a group's blocking host collectives of one op),
    registered with the watchdog once: the same ``Call`` record every time, in flight while ``call.start``
    is a time (``IDLE`` between calls), so a call allocates nothing and touches no shared table (the hot path of small collectives).
    One call at a time (``idle``). Numbered like every collective on its group, so hang reports and
    ``done_seq`` are unchanged. ``counter``: the group's ``OpCounter`` for the op, for the caller.
    (``Communicator._host_call`` writes ``begin``/``end`` out, to save a call on its hot path.)"""

    __slots__ = ("call", "counter")

    def __init__(self, call: Call, counter: OpCounter):
        self.call, self.counter = call, counter
        call.start = IDLE

    @property
    def idle(self) -> bool:
        return self.call.start == IDLE

    def begin(self, now: float) -> None:
        """``now``: a ``clock()`` reading (the watchdog's clock; the caller's reading serves its own timing too)."""
        call = self.call
        comm = call.comm
        comm.seq += 1
        call.seq = comm.seq
        call.start = now

    def end(self, now: float) -> None:
        call = self.call
        call.start = IDLE
        comm = call.comm
        if call.seq > comm.done_seq:
            comm.done_seq, comm.done_op, comm.done_at = call.seq, call.op, now


class Watchdog:
    """Aborts the job with a hang report when a call outlives ``timeout_s`` (0 disables the thread).

    ``peers``: [(hostname, node, pid)] per world rank and ``status_comm`` (a duplicate of the world
    communicator, used only by the watchdog threads) make the report job-wide; without them (a
    watchdog built by hand) the report covers this rank only. ``abort(code)``: how to end the job
    (default ``MPI.COMM_WORLD.Abort``); ``report_path``: a file that also gets the report (the run
    directory's ``hang-report.txt``), since an abort can cut a pipe before it is flushed.
    """

    def __init__(self, rank: int, timeout_s: float = 600.0, abort=None, status_comm=None, peers=None):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.status_comm, self.peers = status_comm, peers
        self._abort = abort
        self.report_path: str | None = None
        self.groups: list = []  # every Communicator on this watchdog (their sequence numbers)
        self._inflight: dict[int, Call] = {}
        self._slots: list[Slot] = []  # registered once, in flight while their call's start is set
        self._device: dict[int, Callable[[], bool]] = {}  # token -> done(): calls whose host part returned, device work queued
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.noticed: Call | None = None  # the stalled call this rank is reporting on
        # call.key() -> (its stall clock restarted at, still waiting for a compile): calls whose peers compile
        self._compile_waits: dict[tuple[int, int], tuple[float, bool]] = {}
        self._thread = None
        self._firing = False  # the thread is printing its report and aborting the job (``close`` does not wait)
        self.period = min(1.0, self.timeout_s / 4) if self.timeout_s > 0 else 1.0
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.close)  # runs before mpi4py's MPI_Finalize (registered earlier)

    # ---------------------------------------------------------------- the hot path
    def begin(self, op: str, comm, nbytes: int = 0, peer: int | None = None, seq: int | None = None) -> int:
        """Register a call on ``comm`` (numbered on its group, unless ``seq`` is given: a preliminary of
        call ``seq``, as comm.check's exchange); returns the token for ``end``."""
        if seq is not None:
            peer = -1  # not a numbered call: ``end`` does not record it as completed
        elif peer is None:
            comm.seq += 1
            seq = comm.seq
        else:
            comm.p2p_seq += 1
            seq = comm.p2p_seq
        token = next(self._ids)
        self._inflight[token] = Call(op, comm, nbytes, seq, peer if peer != -1 else None)
        if peer == -1:
            self._inflight[token].numbered = False
        return token

    def set_route(self, token: int, route: str) -> None:
        """Call ``token`` travels by ``route`` ("shared memory"): its reports say so."""
        call = self._inflight.get(token)
        if call is not None:
            call.route = route

    def end(self, token: int) -> None:
        call = self._inflight.pop(token, None)
        if call is not None and call.peer is None and call.numbered and call.seq > call.comm.done_seq:
            comm = call.comm
            comm.done_seq, comm.done_op, comm.done_at = call.seq, call.op, time.monotonic()

    def slot(self, op: str, comm, counter: OpCounter, nbytes: int = 0) -> Slot:
        """A registration for calls of ``op`` on ``comm`` made one at a time, again and again (comm/persistent.py,
        ``Communicator``'s blocking host calls); lives as long as the watchdog."""
        slot = Slot(Call(op, comm, nbytes, 0), counter)
        self._slots.append(slot)
        return slot

    def unslot(self, slot: Slot) -> None:
        """Forget ``slot`` (its owner is freed or closed; idempotent)."""
        if slot in self._slots:
            self._slots.remove(slot)

    def end_when(self, token: int, done) -> None:
        """The host part of call ``token`` returned but its device work (an NCCL kernel on a stream) may
        still be queued: keep it in flight until ``done()`` (a CUDA event query) is true. The watchdog
        thread polls it every period, so a collective that never completes on the GPU is reported like
        one that never returns, instead of blocking a later host synchronisation forever. Without a watchdog
        thread (``timeout_s`` 0) nothing polls: the call ends now."""
        if self._thread is None or done():
            self.end(token)
        else:
            self._device[token] = done

    def _finish_device_calls(self) -> None:
        for token, done in list(self._device.items()):
            try:
                finished = done()
            except Exception:  # noqa: BLE001 - a broken query must not kill the watchdog; keep watching
                finished = False
            if finished:
                self._device.pop(token, None)
                self.end(token)

    def inflight(self) -> list[Call]:
        """The calls in flight now; a slot's call as a copy (its record is reused by its next call)."""
        calls = list(self._inflight.values())
        for slot in list(self._slots):
            copy = slot.call.copy()
            if copy.start != IDLE:
                calls.append(copy)
        return calls

    def in_flight(self, call: Call) -> bool:
        """Whether ``call`` (an ``inflight()`` entry, maybe a slot's snapshot) has not yet ended."""
        if call.origin is not None:  # a snapshot of a slot's record: the same call while its number is the same
            return call.origin.seq == call.seq and call.origin.start != IDLE
        return any(c is call for c in list(self._inflight.values()))

    def close(self) -> None:
        """Stop the thread and wait for it (it must not be inside MPI when MPI is finalised)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread() and not self._firing:
            self._thread.join(timeout=self.period + 5)  # an investigation under way sees ``closed`` and ends

    @property
    def closed(self) -> bool:
        """``close()`` was called: the thread ends, an investigation under way stops asking and reports nothing."""
        return self._stop.is_set()

    # ---------------------------------------------------------------- the thread
    def _watch(self) -> None:
        from hpctrain.comm import hang_report

        while not self._stop.wait(self.period):
            if self.status_comm is not None:
                hang_report.answer(self)
            self._finish_device_calls()
            now = time.monotonic()
            inflight = self.inflight()
            live = {c.key() for c in inflight}
            self._compile_waits = {k: v for k, v in self._compile_waits.items() if k in live}
            clock = {k: restarted for k, (restarted, _) in self._compile_waits.items()}
            stalled = [c for c in inflight if now - max(c.start, clock.get(c.key(), 0.0)) > self.timeout_s]
            if stalled:
                self.noticed = call = min(stalled, key=lambda c: c.start)
                report, compiling = hang_report.investigate(self, call)
                if self.closed or not self.in_flight(call):
                    # the call completed while the ranks were asked (seconds, more when a lower rank reports), or
                    # the run closed its grid meanwhile: no hang (its answers describe a later moment)
                    self.noticed = None
                elif compiling and now - call.start < self.timeout_s + COMPILE_PATIENCE_S:
                    self._wait_for_compile(call, compiling)
                elif call.key() in self._compile_waits and self._compile_waits[call.key()][1]:
                    # the ranks it waited for have finished compiling (maybe just now): a full timeout from here
                    self.noticed, self._compile_waits[call.key()] = None, (time.monotonic(), False)
                else:
                    self.fire(report)
                    return

    def _wait_for_compile(self, call, compiling: list[int]) -> None:
        """``call`` waits for ranks that are inside torch.compile (a first step compiling): slow, not hung. Its
        stall clock restarts now; the call's lowest waiting rank says so once."""
        import sys

        now = time.monotonic()
        told = call.key() in self._compile_waits
        self.noticed, self._compile_waits[call.key()] = None, (now, True)
        if not told and self.rank == min(set(call.comm.members) - set(compiling), default=self.rank):
            sys.stderr.write(f"hpctrain: rank {self.rank}: {call.describe()} has waited {now - call.start:.0f} s "
                             f"for rank(s) {compiling}, inside torch.compile (train.compile: the first step compiles "
                             f"the graphs): not a hang; the hang report waits for them (at most "
                             f"{COMPILE_PATIENCE_S / 60:.0f} min beyond comm.timeout_s)\n")
            sys.stderr.flush()

    def fire(self, report: str) -> None:
        """Print ``report`` (stderr and ``report_path``), give the launcher time to forward it, abort."""
        import sys

        self._firing = True
        sys.stderr.write(report if report.endswith("\n") else report + "\n")
        sys.stderr.flush()
        if self.report_path:
            try:
                with open(self.report_path, "a", encoding="utf-8") as f:
                    f.write(report + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                pass
        time.sleep(abort_grace_s() + 1.0)  # the pipe, then the abort
        if self._abort is not None:
            self._abort(HANG)
        else:
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(HANG)
