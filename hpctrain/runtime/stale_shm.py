"""A killed Slurm task's MPICH segment, removed before a requeued attempt of the same job step attaches to it.

At ``MPI_Init`` MPICH (the PyPI wheel, 5.0.2; ch4 POSIX shared memory) opens one segment per node,
``/dev/shm/mpich_shm_<id>_<node>`` (and ``mpich_vci_<id>_<node>`` with several VCIs), with
``<id>`` = the 32-bit FNV-1a hash of the PMI job id in hex: under Slurm's pmi2 plugin "JOBID.STEPID"
(``$SLURM_PMI2_PMI_JOBID`` when set). The first rank to arrive creates it, the others attach to it, and
the last to finalise unlinks it. A task killed before ``MPI_Finalize`` (kill -9, OOM, node trouble,
``srun --kill-on-bad-exit``) leaves it behind (1-2 MiB per node), and a requeued job keeps its job id
and numbers its steps from 0 again, so the requeued attempt's ranks find the dead attempt's segment
under their own name, attach to its stale queues and counters, and the job breaks (measured: docs/
fault-tolerance.md, "Shared memory after a killed task"). hpctrain's own window is not such a file:
MPICH unlinks it once every rank has mapped it (hpctrain/comm/shm_memory.py).

``remove_stale_mpich_segments()`` runs on every rank of a Slurm step before MPI starts and removes only
files that are provably a dead earlier attempt's: named for THIS job step, owned by this user, and
neither mapped nor open in any process (checked through /proc: a process of this user that cannot be
inspected, other than a container's pid 1, stops the removal; under an ``flock`` of /dev/shm shared
by the ranks of the node, so a rank never removes the live segment a faster peer has just created). When
any of that cannot be established (no lock within 10 s, an uninspectable process) it removes nothing.
Other users' files, other jobs' files, and files in use are never touched. Cost: one listing of
/dev/shm; the /proc scan (0.12 s for 101 processes here) only when a file of this step's name exists. (Left open: a peer inside
``shm_open`` at the very instant of the check, between the file's creation and its descriptor.)
"""
from __future__ import annotations

import fcntl
import os
import time

from hpctrain.runtime import env

SHM_DIR = "/dev/shm"
LOCK_WAIT_S = 10.0


def mpich_segment_id(pmi_job_id: str) -> str:
    """MPICH's ``<id>`` for a PMI job id (FNV-1a, 32 bits, lower-case hex): "12.0" -> "..." ."""
    h = 2166136261
    for byte in pmi_job_id.encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return f"{h:x}"


def slurm_pmi_job_id(environ=None) -> str | None:
    """The PMI job id MPICH sees in this Slurm step ("JOBID.STEPID"), or None outside an srun step."""
    explicit = env.slurm_pmi2_jobid(environ)
    job, step = env.slurm_job_id(environ), env.slurm_step_id(environ)
    return explicit or (f"{job}.{step}" if job and step else None)


def _in_use(paths: set[str]) -> set[str] | None:
    """The subset of ``paths`` that some process maps or holds open; None if a process of this user
    could not be inspected (then nothing can be proven unused)."""
    used, me = set(), os.getuid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                used |= {p for line in f for p in paths if p in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    used.add(target)
        except FileNotFoundError:  # the process ended meanwhile
            continue
        except PermissionError:  # another user's process cannot open our 0600 file; this user's might
            try:
                if os.stat(f"/proc/{pid}").st_uid == me and pid != "1":  # pid 1: a container's init, never a rank
                    return None
            except OSError:
                pass
    return used


def remove_stale_mpich_segments(directory: str = SHM_DIR, environ=None) -> list[str]:
    """Before ``MPI_Init`` on each rank of a Slurm step: remove this step's MPICH segments that a dead
    earlier attempt left (see the module docstring). Returns the removed paths (usually [])."""
    job = slurm_pmi_job_id(environ)
    if job is None:
        return []
    prefixes = tuple(f"mpich_{kind}_{mpich_segment_id(job)}_" for kind in ("shm", "vci"))
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefixes)]
    except OSError:
        return []
    if not names:
        return []
    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return []
                time.sleep(0.01)
        mine = set()
        for name in names:
            path = os.path.join(directory, name)
            try:
                if os.stat(path).st_uid == os.getuid():
                    mine.add(path)
            except FileNotFoundError:
                continue
        used = _in_use(mine) if mine else set()
        if used is None:
            return []
        removed = []
        for path in sorted(mine - used):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                continue
        return removed
    finally:
        os.close(lock)  # releases the flock
