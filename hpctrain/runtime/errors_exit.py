"""Turning exceptions into one clear message per rank and a job-wide non-zero exit, never a hang."""
from __future__ import annotations

import sys
import time
import traceback

from hpctrain.errors import HpcTrainError
from hpctrain.runtime import env

USER_ERROR_EXIT = 2
INTERNAL_ERROR_EXIT = 1


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

    A user error (HpcTrainError) usually happens on every rank at once (they validate the same
    input): each prints its message, and after a grace period ``HPCTRAIN_ERROR_GRACE_S`` (1 s) the job
    is aborted with exit code 2, so a rank that failed alone cannot leave its peers waiting forever in a
    collective. Any other exception prints its traceback and aborts with exit code 1.
    """
    exc_value = None
    try:
        return main(argv) or 0
    except HpcTrainError as exc:
        code, text, exc_value = USER_ERROR_EXIT, str(exc), exc
    except KeyboardInterrupt:
        code, text = 130, "interrupted"
    except BrokenPipeError:
        return 0
    except Exception:  # noqa: BLE001 - report, then end the job
        code, text = INTERNAL_ERROR_EXIT, "internal error:\n" + traceback.format_exc()
    rank, size, mpi_world = _world()
    prefix = f"rank {rank}: " if size > 1 else ""
    if code == USER_ERROR_EXIT and size > 1 and getattr(exc_value, "everywhere", False):
        prefix = f"all {size} ranks: "  # the same error on every rank: printed once, by rank 0
        text = text if rank == 0 else ""
    if text:
        sys.stderr.write(f"hpctrain: error: {prefix}{text}\n")
        sys.stderr.flush()
    sys.stdout.flush()
    if mpi_world is not None and size > 1:
        time.sleep(abort_grace_s())
        mpi_world.Abort(code)
    return code


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
