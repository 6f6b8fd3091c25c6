"""One job per run directory (and per checkpoint directory): a lock that a dead job's successor takes
over, a live job's never.

``<dir>/.hpctrain.lock`` holds JSON {host, pid, job, restart, started, token}; rank 0 holds one in the
run directory and one in ``checkpoint.dir`` when that lies elsewhere (two runs sharing a checkpoint
directory would prune each other's checkpoints and flip ``latest``). A lock found at start is:

- **live** (refuse, exit 2, nothing touched): its process runs on this host, or, on another host, its
  modification time (the heartbeat) is younger than ``STALE_S``;
- **stale** (taken over, with a warning): its pid is gone on this host; its heartbeat is older than
  ``STALE_S``; or it belongs to an earlier attempt of THIS Slurm job (same ``SLURM_JOB_ID``, lower
  ``SLURM_RESTART_COUNT``: Slurm ends an attempt before requeueing it, on whatever node it ran), or, on
  another host, to an earlier job step of this attempt (same job and restart count, lower ``SLURM_STEP_ID``)
  when the batch script says that every earlier step has returned (``HPCTRAIN_EARLIER_STEPS_ENDED=1``:
  ``slurm/train.sbatch --restarts`` starts its next ``srun`` only once the failed one has ended). Without
  that word an earlier step's lock on another host is live while its heartbeat is: two ``srun`` of one
  script running at once never share a run directory.

Every step is atomic on POSIX file systems, NFS and Lustre alike, using only operations those
guarantee to be atomic on the server: a lock is created complete (written to a private file, then
``link()``-ed to the lock name, which fails if it exists), so no reader sees a half-written lock; a
takeover first creates ``.hpctrain.lock.takeover`` exclusively (one contender wins), re-reads the lock
and acts only if it is still the owner it judged stale, then ``rename()``-s its own complete file over
it. ``heartbeat`` and ``release`` act only on a lock whose token is this job's. A background thread
refreshes the heartbeat every ``HEARTBEAT_S`` (file system calls only, no MPI), so a resume, save or
evaluation longer than ``STALE_S`` does not look stale from another host. What is relied on: ``link``
and ``rename`` atomic, modification times set by ``utime`` visible to other clients within
``STALE_S`` (NFS attribute caching is seconds), and clocks of the nodes within ``STALE_S`` of each other.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from hpctrain.errors import HpcTrainError
from hpctrain.runtime import env
from hpctrain.runtime.container import bind_fix, container_kind
from hpctrain.runtime.errors_exit import process_alive

LOCK_NAME = ".hpctrain.lock"
TAKEOVER_SUFFIX = ".takeover"
HEARTBEAT_S = 30.0
STALE_S = 300.0
TAKEOVER_STALE_S = 60.0  # a takeover file this old was left by a contender that died mid-takeover


def _step_id(environ) -> int | None:
    """``$SLURM_STEP_ID`` as a number (a batch script's relaunched ``srun`` gets the next one), else None."""
    text = env.slurm_step_id(environ)
    return int(text) if text is not None and text.isdigit() else None


class RunDirInUse(HpcTrainError):
    """Another live job trains in this run (or checkpoint) directory."""


def _describe(owner: dict) -> str:
    job = f"job {owner['job']}, " if owner.get("job") else ""
    return f"{job}pid {owner.get('pid')} on {owner.get('host')}"


def unusable_directory(path: str, key: str) -> str | None:
    """Why ``path`` cannot be (or become) a writable directory, or None. Creates nothing: the nearest
    existing ancestor must be a writable directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        what = "is" if probe == os.path.abspath(path) else f"is inside {probe}, which is"
        return f"{key}={path} {what} a regular file, not a directory; choose another path"
    if not os.access(probe, os.W_OK | os.X_OK):
        fix = bind_fix(container_kind(), probe)
        return (f"{key}={path}: {probe} is not writable by this user (or is on a read-only file system)"
                + (f"; in this container: {fix}" if fix else ""))
    return None


def _read(path: str) -> tuple[dict | None, float]:
    """(owner, age in seconds) of a lock file; (None, 0) if it vanished; ({}, inf) if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
        return owner, time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None, 0.0
    except (OSError, ValueError):
        return {}, float("inf")


class DirectoryLock:
    """This job's lock on one directory (``acquire`` / ``heartbeat`` / ``release``)."""

    def __init__(self, directory: str, key: str, environ=None):
        self.directory, self.key = directory, key
        self.path = os.path.join(directory, LOCK_NAME)
        self.held = False
        self.created: list[str] = []  # directories ``acquire`` made (absent before), deepest first
        self.me: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.slurm_job_id(environ),
                   "restart": env.slurm_restart_count(environ), "step": _step_id(environ), "started": time.time(),
                   "token": uuid.uuid4().hex}
        self.earlier_steps_ended = env.earlier_steps_ended(environ)

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale lock was taken over. Raises RunDirInUse."""
        path, self.created = os.path.abspath(self.directory), []
        while not os.path.isdir(path) and os.path.dirname(path) != path:
            self.created.append(path)  # deepest first: ``release`` removes them again while they are empty
            path = os.path.dirname(path)
        os.makedirs(self.directory, exist_ok=True)
        mine = f"{self.path}.{self.me['token']}"
        with open(mine, "w", encoding="utf-8") as f:
            json.dump(self.me, f)
        try:
            for _ in range(3):
                try:
                    os.link(mine, self.path)  # atomic, complete, fails if a lock exists (NFS-safe)
                    self.held = True
                    return None
                except FileExistsError:
                    pass
                owner, age = _read(self.path)
                if owner is None:
                    continue  # released meanwhile: try again
                reason = self._stale_because(owner, age)
                if reason is None:
                    raise RunDirInUse(f"{self.key}={self.directory} is in use by {_describe(owner)}{self._step_of(owner)} "
                                      f"(lock {self.path}, refreshed {age:.0f} s ago): wait for it, stop it, or use "
                                      f"another {self.key}. A lock whose job died is taken over automatically (at once "
                                      f"on the same host, by a requeue of the same Slurm job, or by a step relaunched "
                                      f"with HPCTRAIN_EARLIER_STEPS_ENDED=1 as slurm/train.sbatch does; after "
                                      f"{STALE_S:.0f} s elsewhere)")
                if self._take_over(mine, owner):
                    self.held = True
                    return f"took over the stale lock of {_describe(owner)} ({self.path}: {reason})"
            raise RunDirInUse(f"cannot take the lock {self.path}: other jobs are taking it at the same moment")
        finally:
            try:
                os.unlink(mine)
            except FileNotFoundError:
                pass

    def _stale_because(self, owner: dict, age: float) -> str | None:
        if not owner:
            return "unreadable"
        if owner.get("job") and owner.get("job") == self.me["job"] and int(owner.get("restart") or 0) < self.me["restart"]:
            return f"an earlier attempt of this Slurm job (restart {owner.get('restart') or 0})"
        if owner.get("host") == self.me["host"]:
            return None if process_alive(int(owner.get("pid", -1))) else "its process is gone"
        if self.earlier_steps_ended and self._earlier_step(owner):
            return f"an earlier job step of this Slurm job (step {owner['step']}, ended: relaunched inside the allocation)"
        return f"no heartbeat for {age:.0f} s" if age >= STALE_S else None

    def _earlier_step(self, owner: dict) -> bool:
        """``owner`` is an earlier job step of this Slurm job's attempt (same job and restart, lower step id)."""
        return bool(owner.get("job")) and owner.get("job") == self.me["job"] \
            and int(owner.get("restart") or 0) == self.me["restart"] \
            and owner.get("step") is not None and self.me["step"] is not None and owner["step"] < self.me["step"]

    def _step_of(self, owner: dict) -> str:
        """", an earlier step of this job (step N) still running" where that is what holds the lock."""
        return f", an earlier step of this job (step {owner['step']}) still running" if self._earlier_step(owner) else ""

    def _take_over(self, mine: str, judged: dict) -> bool:
        """Replace the lock ``judged`` stale with ``mine``, atomically against other contenders."""
        takeover = self.path + TAKEOVER_SUFFIX
        try:
            os.link(mine, takeover)  # one contender at a time
        except FileExistsError:
            _, age = _read(takeover)
            if age > TAKEOVER_STALE_S:
                try:
                    os.unlink(takeover)
                except FileNotFoundError:
                    pass
            return False
        try:
            owner, _ = _read(self.path)
            if owner != judged and owner is not None:
                return False  # someone else took it (or the owner came back): judge again
            os.rename(mine, self.path) if owner is not None else os.link(mine, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            try:
                os.unlink(takeover)
            except FileNotFoundError:
                pass

    def _is_mine(self) -> bool:
        owner, _ = _read(self.path)
        return bool(owner and owner.get("token") == self.me["token"])

    def heartbeat(self) -> None:
        if self.held and self._is_mine():
            os.utime(self.path)
        elif self.held:
            self.held = False
            print(f"hpctrain: WARNING: the lock {self.path} was taken over by another job; this job no longer "
                  f"holds it", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Drop the lock, and the directories ``acquire`` made if nothing was written in them (a failed start
        leaves no trace)."""
        if self.held:
            self.held = False
            if self._is_mine():
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
        for path in self.created:
            try:
                os.rmdir(path)  # only while empty
            except OSError:
                break
        self.created = []


class RunLock:
    """Rank 0's locks on the run directory and the checkpoint directory (other ranks hold a disabled
    one), kept fresh by a heartbeat thread from ``acquire`` to ``release``."""

    def __init__(self, run_dir: str, enabled: bool, checkpoint_dir: str | None = None, environ=None,
                 heartbeat_s: float = HEARTBEAT_S):
        self.enabled, self.heartbeat_s = enabled, heartbeat_s
        self.locks = [DirectoryLock(run_dir, "train.run_dir", environ)]
        inside = checkpoint_dir is None or os.path.abspath(os.path.dirname(checkpoint_dir.rstrip(os.sep))) == \
            os.path.abspath(run_dir)
        if checkpoint_dir is not None and not inside:
            self.locks.append(DirectoryLock(checkpoint_dir, "checkpoint.dir", environ))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return any(lock.held for lock in self.locks)

    def acquire(self) -> str | None:
        """Take every lock (releasing those taken if one fails); returns the takeover warnings, or None."""
        if not self.enabled:
            return None
        warnings = []
        try:
            for lock in self.locks:
                warnings.append(lock.acquire())
        except BaseException:
            self.release()
            raise
        self._thread = threading.Thread(target=self._beat, name="hpctrain-lock-heartbeat", daemon=True)
        self._thread.start()
        return "; ".join(w for w in warnings if w) or None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            for lock in self.locks:
                try:
                    lock.heartbeat()
                except OSError as exc:
                    print(f"hpctrain: WARNING: cannot refresh {lock.path}: {exc}", file=sys.stderr, flush=True)

    def heartbeat(self) -> None:
        """Refresh now (the thread does it every HEARTBEAT_S anyway)."""
        for lock in self.locks:
            lock.heartbeat()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for lock in self.locks:
            lock.release()
