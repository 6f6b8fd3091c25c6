"""Saving and resuming: atomic publication, keep-last-K, asynchronous writes; ``CheckpointManager``
holds one run's checkpoint directory and communicator (resuming, with fallback on load: resume.py).

Save protocol (invariant: ``latest`` only ever names a complete, verified checkpoint):
  1. snapshot the state to host memory (``checkpoint.async``: on the save's thread, from a ``FrozenState``, while
     the next forward and backward run; that step's update waits for it: the stall is only the wait for the
     previous save and the copy of the RNG and reducer state);
  2. write into ``<dir>/.tmp-step-NNNNNNNN/`` (mpio or shards writer), fsync every file;
  3. verify: every rank recomputes the checksums of a share of the boxes, reading the files back;
  4. rank 0 writes ``COMPLETE``, renames the directory to ``step-NNNNNNNN``, fsyncs the parent, and
     atomically replaces ``latest`` (write ``latest.tmp``, fsync, rename); then prunes beyond ``keep``.
Any failure on any rank is agreed on by all ranks (allgather of errors), the temporary directory is
removed, and CheckpointError names the failing rank and cause: nothing published is touched.

All checkpoint communication runs on a ``Communicator`` named "checkpoint" over a duplicate of the
world communicator, so a background (async) save never interleaves with the training step's
collectives, and every checkpoint exchange is watched (a rank stopped mid-save is named).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

from hpctrain.checkpoint import resume as resuming
from hpctrain.checkpoint.background import BackgroundJob
from hpctrain.checkpoint.contract import Resumed, TrainState
from hpctrain.checkpoint.directory import (REPLACED_SUFFIX, RETIRED_PREFIX, enospc_detail, free_bytes, fsync_path,
                                           human_size, list_checkpoints, read_latest, recover_replaced, retire,
                                           space_shortfall)
from hpctrain.checkpoint.local_tier import LocalTier
from hpctrain.checkpoint.format import COMPLETE_MARKER, LATEST_POINTER, STEP_PREFIX, step_dirname
from hpctrain.checkpoint.reader import CheckpointReader
from hpctrain.checkpoint.references import kept_note, referenced
from hpctrain.checkpoint.frozen_state import FrozenState
from hpctrain.checkpoint.transfer import CheckpointError, snapshot
from hpctrain.checkpoint.writers import WriteFailed, has_parallel_h5py, write_mpio, write_shards
from hpctrain.comm.collectives import Communicator
from hpctrain.errors import everywhere
from hpctrain.profiling.timers import PhaseTimer
from hpctrain.runtime.faults import FaultInjector
from hpctrain.runtime.launcher import missing_thread_multiple


def raise_if_any_failed(comm, error: str | None, what: str, note: str = "") -> None:
    """Collective: raise CheckpointError on every rank if any rank reported an error (once when every rank
    reported the same one; ``note``, e.g. what is still intact, ends the message)."""
    errors = [(r, e) for r, e in enumerate(comm.allgather_object(error)) if e]
    if errors:
        same = len(errors) == comm.size > 1 and len({e for _, e in errors}) == 1  # e.g. another model: said once
        details = errors[0][1] if same else "; ".join(f"rank {r}: {e}" for r, e in errors[:4])
        raise everywhere(CheckpointError(f"{what} failed: {details}"
                                         + (f" (and {len(errors) - 4} more)" if len(errors) > 4 and not same else "")
                                         + (f"; {note}" if note else "")))


class CheckpointManager:
    """Saves and resumes one run's checkpoints (collective). ``poll_sleep_s`` > 0 is a diagnosis hook
    (``benchmarks/bench_checkpoint.py --sleeping-waits``): every agreement between the ranks first waits
    in a watched non-blocking barrier, sleeping that long between tests, instead of MPI's busy polling
    inside its allgather (the wait counts in the ``agree`` phase). Results: ``last_save_s``, ``last_phases``."""

    def __init__(self, ckpt_cfg, grid, run_dir: str, *, poll_sleep_s: float = 0.0):
        self.dir = ckpt_cfg.dir or os.path.join(run_dir, "checkpoints")
        self.keep, self.async_save, self.interval = ckpt_cfg.keep, ckpt_cfg.async_, ckpt_cfg.interval
        problem = missing_thread_multiple("checkpoint.async=true (the save runs on a thread while training goes on)")
        if self.async_save and problem:  # the same on every rank: refused without communication
            raise everywhere(CheckpointError(problem + "; or set checkpoint.async=false"))
        self.writer = ckpt_cfg.writer
        if self.writer == "auto":
            self.writer = "mpio" if has_parallel_h5py() else "shards"
        if self.writer == "mpio" and not has_parallel_h5py():
            raise CheckpointError("checkpoint.writer='mpio' needs h5py built with MPI (h5py.get_config().mpi is "
                                  "False); use writer='shards' or 'auto', or see docs/checkpoint-format.md")
        world = grid.world
        with world.watched("checkpoint communicator (Dup)"):  # collective: a missing rank is reported
            duplicate = world.mpi.Dup()
        self.comm = Communicator(duplicate, "checkpoint", world.members, grid.watchdog, grid.stats,
                                 check=world.check)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.faults = FaultInjector.from_env(self.rank)
        self.poll_sleep_s = poll_sleep_s
        self._job = BackgroundJob("hpctrain-ckpt")  # the asynchronous save in flight
        self._cleaned = False
        self.saved_steps: list[int] = []
        self._space_warned = False  # the low-space warning is printed once per run
        self._kept_referenced: set[str] = set()  # steps kept for a run that refers to them (said once each)
        self.last_save_s: float | None = None  # wall time of the last completed write + verify + publish
        # the last save's or resume's phases (prepare, write, fsync, verify, publish, agree; open, read + CRC,
        # verify, apply, agree), in seconds: one save or resume runs at a time, on one thread
        self.timer = PhaseTimer()
        self.last_phases: dict[str, float] = {}
        self.local = LocalTier(ckpt_cfg, grid, run_dir, faults=self.faults)  # checkpoint.local_dir (off when empty)

    # ------------------------------------------------------------------ saving
    def due(self, step: int, last_step: int) -> bool:
        """A tier saves after ``step``: the global one every ``checkpoint.interval`` steps, the node-local one
        every ``checkpoint.local_interval``; never at ``last_step``, which the run's ending saves."""
        return step < last_step and (bool(self.interval and step % self.interval == 0) or self.local.due(step))

    def after_step(self, state: TrainState, step: int) -> None:
        """The one after-step call of the training loop, when ``due``: the global tier's save (async unless
        configured otherwise), then the node-local tier's (collective on both tiers' communicators)."""
        if self.interval and step % self.interval == 0:
            self.save(state)
        if self.local.due(step):
            self.local.save(state)

    def save(self, state: TrainState, sync: bool = False) -> None:
        """Checkpoint the run (``trainer.state``) at its current step (collective). Async unless ``sync`` or
        config says no. The blocking part (waiting for the previous save; a synchronous save's snapshot and
        write) is the ``checkpoint`` phase of ``state.timer``; an asynchronous save's snapshot is taken by its
        thread before the next update (``TrainState.before_next_update``)."""
        with state.timer.phase("checkpoint"):
            self.wait()
            if self.async_save and not sync:
                frozen, taken = FrozenState(state), threading.Event()
                self._job.start(self._run_async, frozen, taken)
                state.before_next_update(lambda: None if taken.wait() else None)  # the snapshot reads until then
            else:
                self.save_snapshot(snapshot(state))

    def _run_async(self, frozen: FrozenState, taken: threading.Event) -> None:
        try:
            snap = snapshot(frozen)  # while the next forward and backward run: they change none of it
        finally:
            taken.set()
        self.save_snapshot(snap)

    @property
    def pending(self) -> bool:
        """True while an asynchronous save still runs in the background (this rank's view)."""
        return self._job.running

    def wait(self) -> None:
        """Block until the previous asynchronous save is published; re-raise its error."""
        self._job.wait()

    def close(self) -> None:
        try:
            self.wait()
            self.local.close()
        finally:
            self.comm.mpi.Free()

    def agree(self, error: str | None, what: str, note: str = "") -> None:
        """Collective on ``comm``: raise CheckpointError on every rank if any rank reported ``error``
        (``raise_if_any_failed``); the wait is the ``agree`` phase."""
        self._arrive_sleeping()
        with self.timer.phase("agree"):
            raise_if_any_failed(self.comm, error, what, note)

    def _intact(self) -> str:
        """What a failed save leaves: the newest published checkpoint, named."""
        latest = read_latest(self.dir)
        return (f"the previous checkpoints are intact (latest: {os.path.join(self.dir, latest)})" if latest
                else "no earlier checkpoint of this run")

    def _space_problem(self, tmp: str, needed: int, step: int) -> str | None:
        """Rank 0, before writing: the data of every rank must fit in the free space of ``tmp``'s file
        system (plus 1 MiB of HDF5 metadata: ``space_shortfall``); below twice that, warn once."""
        free = free_bytes(tmp)
        problem = space_shortfall(step, needed, free, self.dir)
        if problem:
            return problem
        if 2 * needed > free and not self._space_warned:
            self._space_warned = True
            print(f"hpctrain: WARNING: {human_size(free)} free in {self.dir}, less than twice a checkpoint "
                  f"({human_size(needed)}): the next saves may not fit", file=sys.stderr, flush=True)
        return None

    def _arrive_sleeping(self) -> None:
        """With ``poll_sleep_s`` > 0: wait for every rank in a watched Ibarrier, sleeping between tests."""
        if self.poll_sleep_s <= 0:
            return
        with self.timer.phase("agree"), self.comm.watched("sleeping barrier"):
            request = self.comm.mpi.Ibarrier()
            while not request.Test():
                time.sleep(self.poll_sleep_s)

    def save_snapshot(self, snap) -> None:
        """Write, fsync, verify and publish ``snap`` (a ``Snapshot``), synchronously (collective): what
        ``save`` does after taking the snapshot. Sets ``last_save_s`` and ``last_phases``."""
        started = time.perf_counter()
        self.timer.collect(0.0)
        self._write_verify_publish(snap)
        self.last_save_s = time.perf_counter() - started
        self.last_phases = self.timer.collect(self.last_save_s)

    def _write_verify_publish(self, snap) -> None:
        final = os.path.join(self.dir, step_dirname(snap.step))
        tmp = os.path.join(self.dir, f".tmp-{step_dirname(snap.step)}")
        error = None
        timer = self.timer
        if self.rank == 0:
            try:
                with timer.phase("prepare"):
                    self._remove_leftovers()
                    os.makedirs(self.dir, exist_ok=True)
                    shutil.rmtree(tmp, ignore_errors=True)
                    os.makedirs(os.path.join(tmp, "shards"))
            except OSError as exc:
                error = f"cannot create {tmp}: {exc.strerror or exc}"
        self.agree(error, f"checkpoint of step {snap.step} in {self.dir}")
        try:
            with timer.phase("prepare"):
                needed = sum(self.comm.allgather_object(sum(item.data.nbytes for item in snap.items)))
                error = self._space_problem(tmp, needed, snap.step) if self.rank == 0 else None
            self.agree(error, f"saving the checkpoint of step {snap.step}", self._intact())
            error = None
            try:
                with timer.phase("write"):
                    written = (write_mpio if self.writer == "mpio" else write_shards)(
                        self.comm, tmp, snap, before_write=lambda: self.faults.hit("write", snap.step))
                with timer.phase("fsync"):
                    for path in written:
                        fsync_path(path)
                    if self.rank == 0:  # the new directory entries too
                        fsync_path(os.path.join(tmp, "shards"))
                        fsync_path(tmp)
            except WriteFailed as exc:  # names the file and the OS error
                error = str(exc)
            except OSError as exc:  # fsync
                error = f"{exc.filename or tmp}: {exc.strerror or exc}"
            except Exception as exc:  # noqa: BLE001 - agreed below
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                error = enospc_detail(error, needed, tmp, self.dir)
            if error is None and snap.nonfinite:  # a diverged state is never published
                error = (f"non-finite values (inf/NaN) in {', '.join(snap.nonfinite[:3])}"
                         + (f" and {len(snap.nonfinite) - 3} more" if len(snap.nonfinite) > 3 else "")
                         + "; not published, the previous checkpoints are kept")
            self.agree(error, f"writing checkpoint of step {snap.step} ({self.writer} writer)", self._intact())
            problems = []
            self.faults.hit("verify", snap.step)
            try:
                with timer.phase("verify"), CheckpointReader(tmp) as reader:
                    problems = reader.verify(self.rank, self.size)
            except Exception as exc:  # noqa: BLE001
                problems = [f"{type(exc).__name__}: {exc}"]
            self.agree("; ".join(problems[:3]) or None, f"verifying checkpoint of step {snap.step}")
            with timer.phase("publish"):
                error = self._publish(tmp, final, snap.step) if self.rank == 0 else None
            self.agree(error, f"publishing checkpoint of step {snap.step}")
        except CheckpointError:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.saved_steps.append(snap.step)

    def _publish(self, tmp: str, final: str, step: int) -> str | None:
        try:
            marker = os.path.join(tmp, COMPLETE_MARKER)
            with open(marker, "w", encoding="utf-8") as f:
                json.dump({"step": step, "writer": self.writer}, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp)
            replaced = None
            if os.path.exists(final):  # the same step saved again (e.g. preempted right after resuming)
                replaced = final + REPLACED_SUFFIX
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(final, replaced)
            os.rename(tmp, final)
            fsync_path(self.dir)
            self.faults.hit("publish", step)  # published, but `latest` still names the previous one
            pointer = os.path.join(self.dir, LATEST_POINTER)
            with open(pointer + ".tmp", "w", encoding="utf-8") as f:
                f.write(os.path.basename(final) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(pointer + ".tmp", pointer)
            fsync_path(self.dir)
            if replaced:
                shutil.rmtree(replaced, ignore_errors=True)
            self._prune()
        except OSError as exc:
            return f"{exc.filename or self.dir}: {exc.strerror or exc}"
        return None

    def _prune(self) -> None:
        """Retire the published checkpoints beyond ``keep``, except one another run refers to as its LoRA
        base (checkpoint/references.py), which is kept (said once per step)."""
        if self.keep <= 0:
            return
        markers = referenced(self.dir)
        for record in [r for r in list_checkpoints(self.dir) if r["complete"]][:-self.keep]:
            name = os.path.basename(record["path"])
            if name not in markers and not record["latest"]:
                retire(record["path"])
            elif name in markers and name not in self._kept_referenced:
                self._kept_referenced.add(name)
                print(kept_note(record["path"], self.keep, *markers[name][0]), flush=True)

    def _remove_leftovers(self) -> None:
        """Rank 0, before the first save: delete what crashed earlier saves and prunes left behind
        (``.tmp-step-*`` never published, ``.retired-*`` half deleted, ``*.replaced``)."""
        if self._cleaned or not os.path.isdir(self.dir):
            return
        self._cleaned = True
        recover_replaced(self.dir)
        for name in os.listdir(self.dir):
            if name.startswith((".tmp-" + STEP_PREFIX, RETIRED_PREFIX)) or name.endswith(REPLACED_SUFFIX):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    # ------------------------------------------------------------------ resuming (checkpoint/resume.py)
    def resume(self, state: TrainState, what: str = "auto") -> Resumed | None:
        """Load ``what`` ("auto": the newest usable checkpoint of this run's dir or its node-local tier; "none";
        or a path) into the run (``trainer.state``; collective): every rank loads the same one, falling back
        together (``resume.resume``). Returns what was loaded (tier, path, step), or None (a fresh start)."""
        loaded = resuming.resume(self, state, what)
        if loaded is None or loaded.tier != "local":
            self.local.clear()  # another lineage from here on: its local pieces must never be taken
        return loaded

    def set_aside_newer(self, step: int) -> list[str]:
        """Rank 0, after resuming at ``step``: move the step directories of later steps into
        ``superseded/<UTC time>/`` (``resume.set_aside_newer``). Returns the names moved (other ranks: [])."""
        return resuming.set_aside_newer(self.dir, step) if self.rank == 0 else []
