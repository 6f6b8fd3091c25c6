"""One job per run directory: a lock file that a dead job's successor takes over, a live job's never.

``<run_dir>/.hpctrain.lock`` holds JSON {host, pid, job, started}. Rank 0 creates it atomically
(``O_CREAT | O_EXCL``) and refreshes its modification time while training (``heartbeat``, at most
every ``HEARTBEAT_S``); ``release`` deletes it. A lock found at start is:

- **live** (refuse, exit 2, nothing touched): its process runs on this host, or, on another host, its
  heartbeat is younger than ``STALE_S``;
- **stale** (taken over, with a warning): its pid is gone on this host, or its heartbeat is older
  than ``STALE_S`` (a job on another node that was killed, or a node that died).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

from hpctrain.errors import HpcTrainError
from hpctrain.runtime import env

LOCK_NAME = ".hpctrain.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


class RunDirInUse(HpcTrainError):
    """Another live job trains in this run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        return f"{key}={path}: {probe} is not writable by this user (or is on a read-only file system)"
    return None


class RunLock:
    """Rank 0's lock on a run directory (other ranks hold a disabled one)."""

    def __init__(self, run_dir: str, enabled: bool):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.enabled, self.held, self._beat = enabled, False, 0.0

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale lock was taken over. Raises RunDirInUse."""
        if not self.enabled:
            return None
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        warning = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                warning = self._judge_existing()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid(), "job": env.slurm_job_id(),
                           "started": time.time()}, f)
            self.held = True
            return warning
        raise RunDirInUse(f"cannot take the lock {self.path}: another job took it at the same moment")

    def _judge_existing(self) -> str:
        """Remove a stale lock (returning a warning) or raise for a live one."""
        try:
            with open(self.path, encoding="utf-8") as f:
                owner = json.load(f)
            age = time.time() - os.stat(self.path).st_mtime
        except (OSError, ValueError):
            owner, age = {}, STALE_S + 1  # unreadable or vanished: treat as stale
        same_host = owner.get("host") == socket.gethostname()
        live = _alive(int(owner.get("pid", -1))) if same_host else age < STALE_S
        if live:
            raise RunDirInUse(f"run directory {os.path.dirname(self.path)} is in use by {_describe(owner)} "
                              f"(lock {self.path}, refreshed {age:.0f} s ago): wait for it, stop it, or use "
                              f"another train.run_dir. A lock whose job died is taken over automatically "
                              f"(at once on the same host, after {STALE_S:.0f} s elsewhere)")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return f"took over the stale lock of {_describe(owner)} ({self.path})"

    def heartbeat(self) -> None:
        now = time.time()
        if self.held and now - self._beat >= HEARTBEAT_S:
            self._beat = now
            try:
                os.utime(self.path)
            except OSError as exc:
                print(f"hpctrain: WARNING: cannot refresh {self.path}: {exc}", file=sys.stderr, flush=True)

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
