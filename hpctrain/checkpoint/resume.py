"""Resuming a run from its checkpoints: choosing one, loading it on every rank, falling back together.

Contract: every rank loads the same checkpoint or none. With ``--resume auto`` rank 0 lists the
directory once and broadcasts the candidates, newest first; every rank tries them in that order, each
try's problems are agreed on by all ranks (an allgather), so the ranks fall back from a corrupt,
unreadable or partial checkpoint together, and either all apply the same one or all raise the same
CheckpointError. All communication runs on the manager's "checkpoint" communicator
(``CheckpointManager.comm``, a duplicate of the world). With ``checkpoint.local_dir`` set, "auto" first asks
the node-local tier (local_tier.py) for a step at least as new as the newest global one. ``manager`` below is the run's
CheckpointManager (what is used of it: ``dir``, ``comm``, ``rank``, ``size``, ``timer``, ``agree``, ``local``;
``last_phases`` is set). The callers' entry points are ``CheckpointManager.resume`` and
``CheckpointManager.set_aside_newer``.
"""
from __future__ import annotations

import os
import sys
import time

from hpctrain.checkpoint.compression_state import ANOTHER_METHOD, OTHER_FREEZE
from hpctrain.checkpoint.contract import Resumed, TrainState
from hpctrain.checkpoint.directory import fsync_path, list_checkpoints, read_latest, recover_replaced, resolve_latest
from hpctrain.checkpoint.format import COMPLETE_MARKER, LATEST_POINTER
from hpctrain.checkpoint.reader import CheckpointReader
from hpctrain.checkpoint.transfer import ANOTHER_MODEL, BASE_UNUSABLE, CheckpointError, apply_state, read_state
from hpctrain.errors import HpcTrainError, everywhere


def resume(manager, state: TrainState, what: str = "auto") -> Resumed | None:
    """Load ``what`` ("auto": newest usable in ``manager.dir``; "none"; or a path) into the run
    (``trainer.state``; collective on ``manager.comm``). "auto": rank 0 lists the directory once
    (putting back a step directory an interrupted save moved aside) and broadcasts the candidates,
    newest first; every rank tries them in that order and falls back together from a corrupt,
    unreadable or partial one, warning on rank 0. If complete checkpoints exist and none loads,
    raises (never a silent fresh start). Returns what was loaded (``Resumed``: tier, path, step), or None
    (fresh start: nothing to resume)."""
    if what == "none":
        return None
    if what != "auto":  # rank 0 resolves a run or checkpoints directory to its step: one answer for all
        what = manager.comm.broadcast_object(resolve_latest(what) if manager.rank == 0 else None, root=0)
        problem = try_load(manager, what, state)
        if problem:
            raise everywhere(CheckpointError(f"cannot resume from {what}: {problem}"))
        return Resumed("global", what, state.root_state().step)
    choice = None
    if manager.rank == 0:  # one view of the directory, chosen once (ranks may see it at different moments)
        recover_replaced(manager.dir)
        records = list_checkpoints(manager.dir)
        latest = [r for r in records if r["latest"]]
        named = read_latest(manager.dir)
        if named and not latest:
            print(f"hpctrain: WARNING: {os.path.join(manager.dir, LATEST_POINTER)} names {named}, which does not "
                  f"exist; looking for the newest complete checkpoint instead", file=sys.stderr, flush=True)
        others = sorted((r for r in records if r["complete"] and not r["latest"]), key=lambda r: -r["step"])
        choice = ([r["path"] for r in latest + others], max((r["step"] for r in latest + others), default=None))
    candidates, newest_step = manager.comm.broadcast_object(choice, root=0)
    local = manager.local.resume(state, newest_step)  # the node-local tier, when as new as the newest global one
    if local:
        return local
    if not candidates and manager.local.offered and not manager.local.other_layout:
        # the tier held the only state of this run and none of it could be used (each said above): an announced
        # start-over, the pieces kept aside; pieces of another layout are usable there: refused below
        aside = manager.local.set_aside()
        if manager.rank == 0:
            print(f"hpctrain: local tier: none of this run's pieces could be used (see the lines above) and "
                  f"{manager.dir} holds no checkpoint: starting over from step 0; the pieces are kept in {aside} "
                  f"on each node", file=sys.stderr, flush=True)
        return None
    if not candidates and manager.local.offered:  # never a silent restart from step 0 over a run's local pieces
        raise everywhere(CheckpointError(
            f"--resume auto: the node-local tier ({manager.local.root}) holds steps of this run but none could be "
            f"resumed (see the lines above), and {manager.dir} holds no checkpoint to fall back to. Nothing was "
            f"changed: resume in the layout that wrote them, or start over with --resume none"))
    failures = []
    for path in candidates:
        problem = try_load(manager, path, state)
        if problem and ANOTHER_MODEL in problem:  # a config typo must not start over and prune this run
            raise everywhere(CheckpointError(f"--resume auto: the newest checkpoint of {manager.dir} was {ANOTHER_MODEL} "
                                             f"than this config ({problem}). Nothing was changed. Make model.* match "
                                             f"the run's config.json, or use another train.run_dir, or --resume none"))
        if problem and any(s in problem for s in (BASE_UNUSABLE, ANOTHER_METHOD, OTHER_FREEZE)):  # config: no fallback
            raise everywhere(CheckpointError(f"--resume auto: cannot resume from {path}: {problem}. Nothing "
                                             f"was changed"))
        if not problem:
            if path != candidates[0] and manager.rank == 0:
                print(f"hpctrain: resumed from the older checkpoint {path}", file=sys.stderr, flush=True)
            return Resumed("global", path, state.root_state().step)
        failures.append(f"{os.path.basename(path)}: {problem}")
        if manager.rank == 0:
            print(f"hpctrain: WARNING: checkpoint {path} is unusable ({problem}); "
                  f"falling back to the previous complete checkpoint", file=sys.stderr, flush=True)
    if failures:  # never a silent restart from step 0 over a run whose checkpoints exist
        raise everywhere(CheckpointError(
            f"--resume auto: none of the {len(failures)} complete checkpoint(s) in {manager.dir} could be loaded "
            f"({'; '.join(failures[:3])}). Nothing was changed: fix the cause (file system, permissions, "
            f"config) and run again, or start over with --resume none"))
    return None


def set_aside_newer(directory: str, step: int) -> list[str]:
    """Local (rank 0's job, through ``CheckpointManager.set_aside_newer``), after resuming at ``step``:
    move ``directory``'s step directories of later steps (another lineage: a rollback with
    ``--resume PATH``, or ones that failed to load) into ``superseded/<UTC time>/``, so pruning and a
    later ``--resume auto`` see only the lineage being trained. Nothing is deleted. Returns the names moved."""
    newer = [r for r in list_checkpoints(directory) if r["step"] > step]
    if not newer:
        return []
    target = os.path.join(directory, "superseded", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    os.makedirs(target, exist_ok=True)
    for record in newer:
        os.rename(record["path"], os.path.join(target, os.path.basename(record["path"])))
    fsync_path(directory)
    return [os.path.basename(r["path"]) for r in newer]


def try_load(manager, path: str, state: TrainState) -> str | None:
    """Collective on ``manager.comm``; returns the agreed problem (None = loaded; sets
    ``manager.last_phases``). Phases, agreed between: open; read what this rank needs, checking CRCs
    on those bytes (the run is untouched); verify the boxes no rank read; then apply. Every byte is
    read once."""
    reader, error, staged, timer = None, None, None, manager.timer
    started = time.perf_counter()
    timer.collect(0.0)
    try:
        with timer.phase("open"):
            reader = CheckpointReader(path)
        if not reader.complete:
            error = f"no {COMPLETE_MARKER} marker: partial checkpoint"
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    try:
        for phase in ("open", "read", "verify"):
            if error is None and phase == "read":
                try:
                    with timer.phase("read + CRC"):
                        staged = read_state(state, reader)
                except HpcTrainError as exc:
                    error = str(exc)
                except Exception as exc:  # noqa: BLE001 - a damaged file on one rank (ValueError, OSError,
                    error = f"{type(exc).__name__}: {exc}"  # KeyError, ...): agreed, then fallen back from
            elif phase == "verify":
                mine: tuple = ([], None)
                if error is None and reader is not None and staged is not None:  # no error: opened and read
                    mine = (sorted(reader.checked), staged.compression_note)
                with timer.phase("agree"):
                    read_by_anyone, notes = zip(*manager.comm.allgather_object(mine))
                note = next((n for n in notes if n), None)
                if error is None and reader is not None:
                    skip = set().union(*map(set, read_by_anyone))
                    try:
                        with timer.phase("verify"):
                            problems = reader.problems + reader.verify(manager.rank, manager.size, skip=skip)
                    except Exception as exc:  # noqa: BLE001 - agreed below like any other problem
                        problems = [f"{type(exc).__name__}: {exc}"]
                    error = "; ".join(problems[:3]) or None
            try:
                manager.agree(error, "")
            except CheckpointError as exc:
                return str(exc).removeprefix(" failed: ")
    finally:
        if reader is not None:
            reader.close()
    assert staged is not None  # agreed: no rank had a problem, every rank read its state
    with timer.phase("apply"):
        apply_state(state, staged)
    manager.last_phases = timer.collect(time.perf_counter() - started)
    if note and manager.rank == 0:
        print(f"hpctrain: WARNING: compression state (error-feedback residuals, PowerSGD Q) not restored: "
              f"{note}; it starts from zero (docs/compression.md)", file=sys.stderr, flush=True)
    return None
