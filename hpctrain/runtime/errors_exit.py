"""Turning exceptions into one clear message per rank and a job-wide non-zero exit, never a hang."""
from __future__ import annotations

import atexit
import sys
import time
import traceback

from hpctrain.errors import HpcTrainError, NodeFailure
from hpctrain.runtime import env

from hpctrain.exit_codes import INTERNAL_ERROR as INTERNAL_ERROR_EXIT
from hpctrain.exit_codes import USER_ERROR as USER_ERROR_EXIT


def _world():
    """(rank, size, COMM_WORLD) if MPI is initialised, else (0, 1, None)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0, 1, None
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size(), mpi.COMM_WORLD


def abort_grace_s() -> float:
    """``$HPCTRAIN_ERROR_GRACE_S`` for the path to an abort, which must not fail: a bad value is
    reported on stderr and the default (1 s) used."""
    try:
        return env.error_grace_s()
    except env.EnvError as exc:
        sys.stderr.write(f"hpctrain: warning: {exc}; using 1 s\n")
        return 1.0


def run_and_exit(main, argv=None) -> int:
    """Call ``main(argv)``; on error print ``hpctrain: error: rank R: ...`` and end the whole job.

    A user error (HpcTrainError) usually happens on every rank at once (they validate the same input):
    each prints its message (one marked ``everywhere`` is printed once, by rank 0, when every rank raised
    it with the same message; else by each rank that raised it), and the ranks agree on the ending
    (``agree_to_exit``, bounded by the grace
    period ``HPCTRAIN_ERROR_GRACE_S``, 1 s): when every rank is here with the same exit code, each returns
    it (2) through ``leave_with`` (MPI finalised, rank 0 carries the code and leaves last, so that
    ``srun --kill-on-bad-exit`` reports 2 rather than killing a peer mid-finalisation), and MPICH removes its
    /dev/shm segment (an abort leaves it: 2 MiB per job and node, until a small /dev/shm is full and a later
    job dies of SIGBUS).
    Otherwise (a rank failed alone, its peers wait in a collective, or is gone) the job is aborted with
    the code, so nothing waits forever. Any other exception prints its traceback and ends the job the
    same way with exit code 1.
    """
    exc_value = None
    try:
        return main(argv) or 0
    except HpcTrainError as exc:
        code, text, exc_value = getattr(exc, "exit_code", USER_ERROR_EXIT), str(exc), exc  # NodeFailure: 5
    except KeyboardInterrupt:
        code, text = 130, "interrupted"
    except BrokenPipeError:
        return 0
    except Exception:  # noqa: BLE001 - report, then end the job
        code, text = INTERNAL_ERROR_EXIT, "internal error:\n" + traceback.format_exc()
    rank, size, mpi_world = _world()
    prefix = f"rank {rank}: " if size > 1 else ""
    if rank == 0 and isinstance(exc_value, NodeFailure) and exc_value.hosts:  # the nodes a relaunch leaves out
        _write_failed_nodes(exc_value.hosts)
    # an error every rank should raise alike is printed once, by rank 0, but only once the ranks agree that
    # they all raised it: an input that differs between nodes (a file missing on one) fails a rank alone
    once = exc_value is not None and size > 1 and mpi_world is not None and getattr(exc_value, "everywhere", False)
    if text and not once:
        _say(f"hpctrain: error: {prefix}{text}")
    sys.stdout.flush()
    if mpi_world is not None and size > 1:
        grace = abort_grace_s()
        peers = agree_to_exit(mpi_world, code, grace, same_as=text if once else None)
        if once and (peers is None or rank == 0):
            _say(f"hpctrain: error: {prefix if peers is None else f'all {size} ranks: '}{text}")
            if peers is None and rank == 0:  # peers that raised another message print it on rank 0's answer
                time.sleep(min(0.3, grace))
        if peers is not None:
            _leave_by(EXIT_DEADLINE_S)  # if MPI_Finalize never returns, the kernel ends the process
            # the Python exit handlers now, as the interpreter would at exit (the watchdog's stops its thread,
            # which must not call MPI after leave_with's MPI_Finalize); mpi4py's own runs at C level, later
            atexit._run_exitfuncs()
            return leave_with(code, rank, peers[rank][1], peers)
        mpi_world.Abort(code)
    return code


def _write_failed_nodes(hosts) -> None:
    """Append the failed nodes' names to ``$HPCTRAIN_NODE_FAILURE_FILE`` (where set), one per line."""
    try:
        path = env.node_failure_file()
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.writelines(f"{host}\n" for host in hosts)
    except (OSError, env.EnvError) as exc:  # the exit itself must not fail
        _say(f"hpctrain: warning: cannot record the failed nodes {', '.join(hosts)}: {exc}")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


AGREE_TAG = 32001  # point-to-point tag on the world communicator used by ``agree_to_exit`` alone
EXIT_DEADLINE_S = 30  # after an agreed error: the longest the interpreter's exit (MPI_Finalize) may take


def agree_to_exit(world, code: int, grace_s: float, poll_s: float = 0.002, same_as: str | None = None) -> list | None:
    """Whether every rank of ``world`` (an mpi4py communicator) is leaving with ``code`` (and, given ``same_as``,
    the same message): each sends its code, host, pid and message to rank 0, which answers every rank once all
    have arrived with the same code and message, or when its
    wait of ``grace_s`` is over or a code differs. Returns the peers [(host, host, pid)] per rank, as
    ``leave_with`` takes them, when all agree; None otherwise (abort). The other ranks wait ``2 x grace_s``
    for the answer (rank 0 may arrive up to ``grace_s`` after them): a rank that is gone or stuck in a
    collective never answers, so the others stop waiting. Non-blocking point-to-point only, on a tag nothing
    else uses."""
    import os
    import socket

    rank, size = world.Get_rank(), world.Get_size()
    mine = (code, socket.gethostname(), os.getpid(), same_as)
    if rank != 0:
        world.isend(mine, dest=0, tag=AGREE_TAG)  # left pending if rank 0 never receives it: an abort follows
        answer = _wait_for(world.irecv(source=0, tag=AGREE_TAG), 2 * grace_s, poll_s)
        return answer if isinstance(answer, list) else None
    arrived = {0: mine}
    pending = {r: world.irecv(source=r, tag=AGREE_TAG) for r in range(1, size)}
    deadline, same = time.monotonic() + grace_s, True
    while pending and same and time.monotonic() < deadline:
        for r, request in list(pending.items()):
            done, value = request.test()
            if done:
                del pending[r]
                arrived[r] = value
                same = same and value[0] == code and value[3] == same_as
        if pending:
            time.sleep(poll_s)
    peers = [(arrived[r][1], arrived[r][1], arrived[r][2]) for r in range(size)] if same and not pending else None
    answers = [world.isend(peers or False, dest=r, tag=AGREE_TAG) for r in range(1, size)]
    if peers is not None:  # every rank waits for its answer: the sends complete
        _wait_for(_All(answers), grace_s, poll_s)
    return peers


class _All:
    """``test`` of several requests: (all done, None)."""

    def __init__(self, requests):
        self.requests = requests

    def test(self):
        self.requests = [r for r in self.requests if not r.test()[0]]
        return not self.requests, None


def _wait_for(request, timeout_s: float, poll_s: float):
    """The value of ``request`` (an mpi4py request), or None when it is not done within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, value = request.test()
        if done:
            return value if value is not None else True
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def _leave_by(seconds: int) -> None:
    """A kernel alarm that ends this process ``seconds`` from now unless it has exited (a finalisation that
    hangs: the launcher then ends the others); no thread, so it works after Python stops running code."""
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)


def leave_with(code: int, rank: int, node: int, peers, settle_s: float = 1.0, timeout_s: float = 10.0) -> int:
    """The code this rank exits with, so that the launcher reports ``code`` (non-zero: MPI is finalised here).

    ``srun --kill-on-bad-exit`` (slurm/train.sbatch) and hydra end every task the moment one exits
    non-zero: a peer still tearing down (interpreter exit after ``MPI_Finalize``: torch, atexit; ~0.1-1 s)
    then dies by SIGTERM and the job reports 143 instead of ``code`` (seen under Slurm, 2026-11-24). So
    a non-zero ``code`` is carried by rank 0 alone, and rank 0 leaves last: it waits (up to
    ``timeout_s``) until the processes of its node's peers are gone, and ``settle_s`` more when peers
    run on other nodes (it cannot see them). The others return 0. ``peers``: [(hostname, node, pid)]
    per world rank (``Watchdog.peers``), or None (one rank). ``code`` 0 returns 0 at once."""
    if code == 0 or not peers or len(peers) == 1:
        return code  # MPI is finalised at exit, as usual
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    if rank != 0:
        return 0
    local = [pid for r, (_, peer_node, pid) in enumerate(peers) if r != rank and peer_node == node]
    deadline = time.monotonic() + timeout_s
    while local and time.monotonic() < deadline:
        local = [pid for pid in local if process_alive(pid)]
        if local:
            time.sleep(0.02)
    if any(peer_node != node for _, peer_node, _ in peers):
        time.sleep(settle_s)
    return code


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, exited but not yet reaped, does not;
    another user's process does)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (its launcher has not reaped it yet) has exited
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
