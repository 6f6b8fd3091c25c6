"""The hang report: when a call outlives the timeout, name the ranks that never reached it.

Runs on the watchdog threads only, over ``Watchdog.status_comm`` (a duplicate of the world
communicator that no training or checkpoint call uses), with non-blocking probes and sends, so it
works while the main threads are stuck in a collective.

Protocol: the rank that notices a stalled call (group, op, sequence number) sends a query to every
rank and collects their ``status`` for a few seconds: the calls each has in flight, the last
collective each completed per group, and where its main thread is in Python. A rank that does not
answer is stopped, dead, or blocked in C code while holding the interpreter; on the same host its
process state is read from ``/proc``. To print ONE report per job, a rank defers to a lower rank that
has noticed a stall too (and reports anyway if that rank has not aborted the job soon after).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

QUERY_TAG, ANSWER_TAG = 901, 902
# where torch.compile runs: dynamo, inductor, Triton, and the fake tensors that dynamo and AOT autograd trace with
# (a compiled function's backward compiles at its first call, from autograd, through AOT autograd's fake copies
# of the saved tensors before inductor is on the stack; fake tensors serve tracing only)
COMPILER_PATHS = tuple(os.sep.join(("", *parts, "")) for parts in (("torch", "_dynamo"), ("torch", "_inductor"),
                                                                   ("torch", "_subclasses"), ("triton",)))
PROCESS_STATES = {"T": "stopped (SIGSTOP, or a debugger)", "t": "stopped by a debugger",
                  "Z": "dead (a zombie process)", "X": "dead",
                  "D": "blocked in uninterruptible I/O (a hung file system?)"}


def group_key(comm) -> str:
    return f"{comm.name}{list(comm.members)}"


def _top_frame(thread_name: str | None = None):
    """The current frame of the main thread (or of the thread called ``thread_name``), or None."""
    if thread_name is None:
        ident = threading.main_thread().ident
    else:
        ident = next((t.ident for t in threading.enumerate() if t.name == thread_name), None)
    return sys._current_frames().get(ident) if ident is not None else None


def where(thread_name: str | None = None, depth: int = 3) -> str:
    """Innermost ``depth`` frames of the main thread (or of the thread called ``thread_name``)."""
    frame = _top_frame(thread_name)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)[-depth:]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return " < ".join(f"{os.path.relpath(f.filename, root) if f.filename.startswith(root) else f.filename}:"
                      f"{f.lineno} in {f.name}" for f in reversed(frames))


def compiling(thread_name: str | None = None) -> bool:
    """Is the main thread (or ``thread_name``) inside torch.compile: a frame of dynamo, inductor, Triton or the
    fake tensors of tracing (``COMPILER_PATHS``) anywhere on its stack (a compile waits in subprocess or thread
    pools below them)?"""
    frame = _top_frame(thread_name)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in COMPILER_PATHS):
            return True
        frame = frame.f_back
    return False


def status(watchdog) -> dict:
    """This rank's answer: calls in flight, last completed collective per group, Python position."""
    now = time.monotonic()
    inflight = [{"group": group_key(c.comm), "name": c.comm.name, "members": list(c.comm.members), "op": c.op,
                 "seq": c.seq, "peer": c.peer, "peer_world": None if c.peer is None else c.comm.members[c.peer],
                 "age": now - c.start, "text": c.describe()} for c in watchdog.inflight()]
    done = {group_key(g): (g.done_op, g.done_seq, now - g.done_at if g.done_at else None) for g in watchdog.groups}
    stacks = {"main thread": where(depth=4)}
    if any(t.name == "hpctrain-ckpt" for t in threading.enumerate()):
        stacks["checkpoint thread"] = where("hpctrain-ckpt")
    blocked = "hpctrain/comm/" in stacks["main thread"].split(" < ")[-1] or "hpctrain/comm/" in stacks["main thread"]
    return {"rank": watchdog.rank, "noticed": watchdog.noticed is not None, "inflight": inflight, "blocked": blocked,
            "done": done, "started": {group_key(g): g.seq for g in watchdog.groups}, "where": stacks,
            "compiling": compiling()}


def answer(watchdog) -> None:
    """Answer every pending status query (non-blocking sends; the requests are kept until done)."""
    from mpi4py import MPI

    comm, probe = watchdog.status_comm, MPI.Status()
    pending = getattr(watchdog, "_answers", [])
    pending[:] = [r for r in pending if not r.Test()]
    while comm.iprobe(source=MPI.ANY_SOURCE, tag=QUERY_TAG, status=probe):
        source = probe.Get_source()
        comm.recv(source=source, tag=QUERY_TAG)
        pending.append(comm.isend(status(watchdog), dest=source, tag=ANSWER_TAG))
    watchdog._answers = pending


def collect(watchdog, window_s: float) -> dict[int, dict]:
    """Ask every rank for its status; answers that arrive within ``window_s``, by world rank."""
    from mpi4py import MPI

    comm, probe = watchdog.status_comm, MPI.Status()
    size = comm.Get_size()
    requests = [comm.isend(watchdog.rank, dest=r, tag=QUERY_TAG) for r in range(size) if r != watchdog.rank]
    answers = {watchdog.rank: status(watchdog)}
    deadline = time.monotonic() + window_s
    while len(answers) < size and time.monotonic() < deadline and not watchdog.closed:
        answer(watchdog)  # a rank that noticed too asks us at the same time
        while comm.iprobe(source=MPI.ANY_SOURCE, tag=ANSWER_TAG, status=probe):
            source = probe.Get_source()
            answers[source] = comm.recv(source=source, tag=ANSWER_TAG)
        time.sleep(0.02)
    watchdog._queries = requests  # keep the buffers alive; never waited for (a peer may be gone)
    return answers


def investigate(watchdog, call) -> tuple[str, list[int]]:
    """On the watchdog thread of a rank whose ``call`` stalled: (the report to print, the ranks that cause the
    stall when every one of them is alive inside torch.compile, else []). When a lower rank has noticed a
    stall too, this one first serves queries for a while (that rank reports and aborts the job)."""
    if watchdog.status_comm is None:
        answers = {watchdog.rank: status(watchdog)}
        return format_report(watchdog, call, answers, window_s=0), compiling_causes(call, answers)
    window = 2 * watchdog.period + 2.0
    answers = collect(watchdog, window)
    soon = watchdog.timeout_s - 2 * watchdog.period - 1
    lower = [r for r, a in answers.items() if r < watchdog.rank
             and (a["noticed"] or any(c["age"] > soon for c in a["inflight"]))]
    if lower:
        deadline = time.monotonic() + 2 * window + 10
        while time.monotonic() < deadline and not watchdog.closed:
            answer(watchdog)
            time.sleep(0.1)
        answers = collect(watchdog, window)
    return format_report(watchdog, call, answers, window), compiling_causes(call, answers)


def missing_ranks(call, answers: dict[int, dict]) -> list[int]:
    """The world ranks ``call`` waits for: its peer, or the members of its group not inside it (through a
    shared-memory window: those that have not arrived at the barrier this rank waits in, ``shm_progress``)."""
    if call.peer is not None:
        return [call.comm.members[call.peer]]
    progress = shm_progress(call)
    if progress is not None:
        return [m for m in call.comm.members if not progress[m][1]]
    key = group_key(call.comm)
    return [m for m in call.comm.members if not _in_call(answers.get(m), key, call.seq)]


def shm_progress(call) -> dict[int, tuple[bool, bool]] | None:
    """For ``call`` made through its group's shared-memory window on this node (comm.intra_node's route):
    {world rank: (it has entered the call, it has arrived at the barrier this rank waits in)}, read from the
    window's headers (shm.py ``progress``), which a stopped rank cannot hide. None for any other call, with
    no arrival counts, or while this rank's window works on another call (comm.shm_progress = thread)."""
    if call.peer is not None or getattr(call, "route", "") != "shared memory":
        return None
    progress = getattr(getattr(getattr(call.comm, "shm", None), "shm", None), "progress", None)
    state = progress() if progress is not None else None
    if state is None:
        return None
    entries, arrivals, target, me = state
    if entries[me] != call.seq:
        return None
    return {call.comm.members[j]: (entries[j] == call.seq, arrivals[j] >= target) for j in range(len(entries))}


def compiling_causes(call, answers: dict[int, dict]) -> list[int]:
    """The ranks that ``call``'s stall comes down to (``wait_chain``) when each of them answered from inside
    torch.compile (a first step compiling its graphs: slow, not hung); [] otherwise. When every member has
    entered ``call`` (a nonblocking collective, e.g. a bucket's reduction launched in the backward) it still
    cannot complete while a member compiles: MPI advances it only inside MPI calls. Those members are then
    the causes."""
    missing = missing_ranks(call, answers)
    if not missing and call.peer is None:
        compiling = [m for m in call.comm.members if (answers.get(m) or {}).get("compiling")]
        return compiling
    causes, _ = wait_chain(answers, missing)
    return causes if causes and all((answers.get(r) or {}).get("compiling") for r in causes) else []


def process_state(rank: int, peers) -> str:
    """What ``/proc`` says about world rank ``rank``'s process, or why it cannot be read."""
    if not peers:
        return "state unknown"
    host, _node, pid = peers[rank]
    if host != socket.gethostname():
        return f"on host {host}: stopped, dead, or blocked in C code holding its interpreter"
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "dead (no such process)"
    return PROCESS_STATES.get(state, f"running (state {state}) but not answering: blocked in C code "
                                     f"while holding its Python interpreter")


def who(rank: int, peers) -> str:
    if not peers:
        return f"rank {rank}"
    host, node, pid = peers[rank]
    return f"rank {rank} (node {node} {host}, pid {pid})"


def _in_call(info: dict | None, group: str, seq: int) -> bool:
    return info is not None and any(c["group"] == group and c["seq"] == seq and c["peer"] is None
                                    for c in info["inflight"])


def wait_chain(answers: dict[int, dict], start: list[int]) -> tuple[list[int], dict[int, str]]:
    """Follow who waits for whom from ``start``: (the ranks at the end of the chains, i.e. the causes,
    {rank: what it waits in}). A rank whose main thread is blocked in communication waits for the peer
    of its point-to-point call, or for the members missing from its collective; a rank that did not
    answer, or is not blocked, is a cause."""
    causes, waits, seen, frontier = [], {}, set(), list(start)
    while frontier:
        rank = frontier.pop(0)
        if rank in seen:
            continue
        seen.add(rank)
        info = answers.get(rank)
        if info is None or not info["inflight"] or not info["blocked"]:
            causes.append(rank)
            continue
        oldest = max(info["inflight"], key=lambda c: c["age"])
        waits[rank] = oldest["text"]
        if oldest["peer"] is not None:
            frontier.append(oldest["peer_world"])
        else:
            frontier += [m for m in oldest["members"] if not _in_call(answers.get(m), oldest["group"], oldest["seq"])]
    return causes, waits


def format_report(watchdog, call, answers: dict[int, dict], window_s: float) -> str:
    """One report: the stalled call, who waits in it, the ranks that never reached it and, following
    who waits for whom, the rank(s) that cause the hang: stopped, dead, or busy elsewhere."""
    peers, key = watchdog.peers, group_key(call.comm)
    age = time.monotonic() - call.start
    lines = [f"hpctrain: hang report from {who(watchdog.rank, peers)}: {call.describe()} has not completed "
             f"in {age:.0f} s (comm.timeout_s = {watchdog.timeout_s:g})."]
    missing = missing_ranks(call, answers)
    if call.peer is None:
        lines.append(f"  in the call: ranks {[m for m in call.comm.members if m not in missing]}")
    causes, waits = wait_chain(answers, missing)
    for rank in causes:
        lines.insert(1, f"  cause: {_state(rank, answers.get(rank), peers, window_s)}")
    progress = shm_progress(call)
    for member in missing:
        entered = progress is not None and progress[member][0]
        lines.append("  " + _missing_line(member, call, key, answers.get(member), peers, window_s, entered))
    for rank, text in sorted(waits.items()):
        lines.append(f"  rank {rank} waits in {text}")
    lines.append(f"Aborting the job (exit 3). A stopped or hung rank is the usual cause; raise comm.timeout_s "
                 f"(or HPCTRAIN_COMM_TIMEOUT) only if the call is legitimately slow; comm.check = true names "
                 f"mismatched collectives.")
    return "\n".join(lines)


def _state(rank: int, info: dict | None, peers, window_s: float) -> str:
    if info is None:
        return f"{who(rank, peers)}: it did not answer in {window_s:.0f} s: {process_state(rank, peers)}"
    busy = "; ".join(c["text"] for c in info["inflight"])
    now = f"it is in {busy}" if busy else "it is in no communication call"
    if info.get("compiling"):
        now += " (inside torch.compile)"
    stacks = "; ".join(f"{name} at {text}" for name, text in info["where"].items() if text)
    return f"{who(rank, peers)}: {now}; {stacks}"


def _missing_line(member: int, call, key: str, info: dict | None, peers, window_s: float,
                  entered: bool = False) -> str:
    """One line on a rank ``call`` waits for; ``entered``: the shared-memory window shows it inside the call."""
    route = f" ({call.route})" if getattr(call, "route", "") else ""
    verb = (f"has not entered {call.op} #{call.seq}{route} on group {call.comm.name} {list(call.comm.members)}"
            if call.peer is None else f"(the peer of this {call.op})")
    if entered:
        verb = (f"entered {call.op} #{call.seq}{route} on group {call.comm.name} {list(call.comm.members)} and "
                f"is inside the shared-memory exchange, but has not arrived at the barrier this rank waits in")
    if info is None:
        return f"{who(member, peers)} {verb}: it did not answer in {window_s:.0f} s: {process_state(member, peers)}"
    op, seq, ago = info["done"].get(key, (None, 0, None))
    last = f"its last completed call there: {op} #{seq}, {ago:.1f} s ago" if op else "it has completed no call there"
    if call.peer is None and seq >= call.seq:
        last = (f"it has already completed call #{seq} ({op}) there: the ranks called different collectives "
                f"(run with comm.check = true to find the first mismatch)")
    return f"{who(member, peers)} {verb}; {last}; " + _state(member, info, peers, window_s).split(": ", 1)[1]
