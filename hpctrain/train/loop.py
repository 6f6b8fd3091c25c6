"""The training run: set up, resume, step until an agreed stop, checkpoint; how it ends is ``train/ending.py``.

``run_training(cfg, resume, max_steps)`` is what ``hpctrain train`` calls on every rank. Each step
carries this rank's wish to stop (``train/stop.py``: a signal, ``train.exit_signals``, the scheduler's
time limit, or a node-local save that failed in the background) in its own reduction; the agreed answer
arrives with the step's verdict, which the host reads one step late (``Trainer.train_step(defer=True)``: no
host wait inside a step), so the run stops one or two steps after the request, every rank after the same
step. The end of the run and ``--max-steps`` need no agreement. metrics.jsonl gets every step's record
once its verdict is read. After each step the checkpoint tiers that are due save
(``CheckpointManager.after_step``); then ``train/ending.py`` saves, logs the stop event and leaves with the
exit code.
"""
from __future__ import annotations

import os
import sys
import time

from hpctrain.checkpoint.local_tier import newest_held
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.references import protect
from hpctrain.comm.grid import ProcessGrid
from hpctrain.errors import everywhere
from hpctrain.interop.base_ref import make_reference
from hpctrain.interop.sources import init_weights, open_source
from hpctrain.models.fp8 import check_fp8
from hpctrain.monitor.run_monitor import RunMonitor
from hpctrain.profiling.cuda_trace import cuda_profiler
from hpctrain.profiling.trace import TraceRecorder
from hpctrain.runtime.device import select_device
from hpctrain.runtime.faults import FaultInjector
from hpctrain.runtime.launcher import discover
from hpctrain.runtime.signals import SignalFlag, scheduler_deadline
from hpctrain.train.announce import announce, first_step_report
from hpctrain.train.memory_check import check_memory
from hpctrain.train.metrics import MetricsLog, model_state_bytes, report_peak_memory, run_peak_memory
from hpctrain.train.run_dir import RunDirHoldsARun, decide_start, set_aside_agreed
from hpctrain.train.run_lock import RunDirInUse, RunLock, unusable_directory
from hpctrain.train.ending import Ending, leave, save_and_stop, stronger
from hpctrain.train.run import Run
from hpctrain.train.stop import LOCAL_TIER_FAILED, StopPolicy
from hpctrain.train.trainer import Trainer



def run_training(cfg, resume: str | None, max_steps: int = 0, early_signals=None, verbose: bool = False) -> int:
    """Collective over the world; returns the process exit code (see the module docstring). ``resume``:
    "auto", "none", a checkpoint path, or None (not given: see ``hpctrain/train/run_dir.py``).
    ``early_signals``: the SignalFlag the entry point made before its imports, if any. ``verbose``: rank 0
    prints the first step's phases and torch.compile's graphs and graph breaks (``--verbose``)."""
    info = discover()
    FaultInjector.from_env(info.rank).hit("launch", 0)  # test-only: a start-up that never finishes
    # a signal during start-up is not lost: the entry point's flag is narrowed to the config's signals
    flag = early_signals.retarget(cfg.train.exit_signals) if early_signals else SignalFlag(cfg.train.exit_signals)
    device = select_device(cfg.train.device, info)
    grid = ProcessGrid.from_config(cfg, info)
    try:
        check_fp8(cfg.train, device)  # torchao and the device: before anything is built or written, on every rank
        check_memory(cfg, grid, device)  # a model that cannot fit is refused before it is allocated, on every rank
    except Exception:
        grid.close()  # every rank raises alike (agreed by one allgather): nothing is left waiting
        raise
    lock, decision = _lock_run_dir(cfg, grid, resume)
    grid.watchdog.report_path = os.path.join(cfg.train.run_dir, "hang-report.txt")  # survives a cut pipe
    try:
        run = _start(cfg, grid, device, decision, max_steps, flag, lock, verbose)
        ending = _train(run)
        return leave(run, ending)  # closes the grid
    except BaseException:
        grid.free_requests()  # the error ends the job: MPI_Finalize at exit must find no request left
        raise
    finally:
        lock.release()  # also on errors: a failed start leaves no lock behind


def _start(cfg, grid, device, decision, max_steps: int, flag, lock, verbose: bool) -> Run:
    """Collective: build the trainer, resume (or take ``model.init_from``), start the monitor, set an earlier
    run aside (only now that every start-up check has passed), say what runs, start the traces."""
    trainer = Trainer(cfg, grid, device=device)
    checkpoints = CheckpointManager(cfg.checkpoint, grid, cfg.train.run_dir)
    resumed = checkpoints.resume(trainer.state, decision.resume)
    if resumed is None and decision.resume == "auto":  # nothing could be resumed: a fresh start after all
        decision.start_over(grid.world, cfg.train.run_dir, checkpoints.dir)  # its earlier files set aside below
    if resumed:
        moved = checkpoints.set_aside_newer(trainer.step)
        if moved:
            print(f"hpctrain train: resumed at step {trainer.step}; the later checkpoints {', '.join(moved)} "
                  f"were moved to {os.path.join(checkpoints.dir, 'superseded')}/ (another lineage)", flush=True)
    if resumed is None and cfg.model.init_from:  # a fresh start (not a resume) from given weights
        init_weights(trainer.state, cfg.model.init_from, grid.world)
        if cfg.lora.rank and cfg.lora.checkpoint_base == "reference":
            trainer.state.base_reference = make_reference(cfg.model.init_from, trainer.parts.model_cfg, grid.world,
                                                          open_source)
    monitor = RunMonitor(cfg, grid.world, grid.sizes, cfg.train.run_dir)
    monitor.start(trainer.step)  # collective; a sink that cannot start stops the run here, on every rank
    try:  # every start-up check has passed: only now is an earlier run set aside
        set_aside_agreed(grid.world, decision, cfg.train.run_dir, checkpoints.dir)
    except BaseException:
        monitor.close()
        raise
    is_root = grid.info.rank == 0
    if is_root:
        if trainer.state.base_reference is not None:  # a step of another run's checkpoints: kept from its pruning
            protect(trainer.state.base_reference["path"], checkpoints.dir)
        announce(cfg, grid, trainer, device, resumed, verbose)
    last_step = cfg.train.steps if max_steps <= 0 else min(cfg.train.steps, trainer.step + max_steps)
    policy = StopPolicy(signal_flag=flag, last_step=last_step, deadline=_deadline(cfg, grid),
                        first_margin_s=cfg.train.time_limit_margin_s)
    policy.lag_steps = trainer.outcomes.lag_steps  # the request rides on a step: answered after it
    log = MetricsLog(cfg.train.run_dir, cfg.train.steps, enabled=is_root, progress=cfg.train.progress,
                     log_interval=cfg.train.log_interval)
    trace = _start_trace(cfg, grid, trainer)
    kernels = cuda_profiler(cfg.train, grid.info.rank, device)  # train.trace on CUDA: kernels and syncs
    saved = resumed is not None and resumed.is_global  # a local piece alone is no global checkpoint of its step
    return Run(cfg, grid, device, trainer, checkpoints, monitor, log, policy, flag, lock, trace, kernels, verbose,
               resumed, trainer.step if saved else None, last_step)


def _train(run: Run) -> Ending:
    """The steps, then the last save and the stop event; the outputs are closed however it ends."""
    try:
        _steps(run)
        ending = save_and_stop(run)
        run.log.run_peak = run_peak_memory(run.grid.world, run.device)  # collective: the whole run, per rank
    finally:
        run.monitor.close()
        run.flag.restore()
        summary = run.log.close()
        if run.trace is not None:
            run.trace.close()
        if run.kernels is not None:
            run.kernels.stop()
    if run.is_root and summary:
        grid = run.grid
        run.log.write_summary(summary, ranks=grid.info.size, nodes=grid.info.num_nodes, **grid.sizes)
    return ending


def _steps(run: Run) -> None:
    """Step until the last step, an agreed stop or a divergence (read identically on every rank)."""
    cfg, trainer, policy, checkpoints = run.cfg, run.trainer, run.policy, run.checkpoints
    first_step = trainer.step + 1
    while trainer.step < run.last_step:  # "max steps": the same count on every rank, nothing to agree
        with trainer.parts.timer.phase("sync"):
            request = policy.local_reason(trainer.step)  # agreed in the step's own reduction
            if checkpoints.local.failed:  # a background local save raised (agreed there): stop every rank here
                request = stronger(request, LOCAL_TIER_FAILED)
        metrics = trainer.train_step(request, defer=True)  # its verdict is read one step later
        if run.kernels is not None:
            run.kernels.step()
        policy.record_step(metrics.step_time_s)
        if run.verbose and run.is_root and trainer.step == first_step:  # its phases and compile's graph breaks
            for line in first_step_report(metrics.as_dict(), trainer.parts.compile_since, cfg.train.compile):
                print(f"hpctrain train: {line}", flush=True)
        if trainer.diverged:  # the bad update and all after it were not applied
            break
        if trainer.step == first_step:  # collective: memory per rank, once
            report_peak_memory(run.grid.world, run.device, metrics.__dict__, model_state_bytes(trainer.parts))  # logged with the step
        if cfg.train.eval_interval and (trainer.step % cfg.train.eval_interval == 0 or trainer.step == run.last_step):
            metrics.val_loss = trainer.evaluate()  # type: ignore[attr-defined]  # a key of eval steps' records only
            metrics.time_s["eval"] = round(trainer.parts.timer.take("eval"), 6)
        if checkpoints.due(trainer.step, run.last_step):
            trainer.read_pending()  # never save a step whose verdict is unread
            if trainer.diverged is None:  # both tiers; the node-local one blocks the step for a host copy only
                checkpoints.after_step(trainer.state, trainer.step)
                policy.record_save(checkpoints.last_save_s)  # None until the first global save completes
                metrics.time_s["checkpoint"] = round(trainer.parts.timer.take("checkpoint"), 6)
        _log_finished(run)
        if trainer.diverged or trainer.agreed_stop:
            break
    trainer.read_pending()
    _log_finished(run)


def _log_finished(run: Run) -> None:
    """Log the steps whose verdict was read (in step order; the same on every rank: the monitor's collective
    calls stay in step)."""
    finished = run.trainer.finished_steps()
    for metrics in finished:
        record = metrics.as_dict()  # with val_loss where the loop evaluated
        run.log.log(record)
        if run.trainer.diverged is not None and metrics is finished[-1]:  # the bad step: nothing after it
            run.monitor.on_step(record)
        else:  # collective every interval
            run.monitor.on_step(record, run.checkpoints.saved_steps, run.checkpoints.last_phases)


def _start_trace(cfg, grid, trainer):
    """Collective when ``train.trace``: a TraceRecorder on the trainer's timer and every group."""
    if not cfg.train.trace:
        return None
    first = trainer.step + 2  # the run's first step opens connections: trace the ones after it
    recorder = TraceRecorder(grid.info.rank, os.path.join(cfg.train.run_dir, "trace"), first,
                             first + cfg.train.trace_steps - 1,
                             meta={"world_size": grid.info.size, "hostname": grid.info.hostname,
                                   "node": grid.info.node, **{f"{a}_rank": c for a, c in grid.coords.items()}})
    trainer.parts.faults.hit("trace", 0)  # test-only: a rank stopped here leaves the others in the sync
    recorder.sync(grid.world)
    trainer.parts.timer.trace = recorder
    grid.set_trace(recorder)
    return recorder


def _lock_run_dir(cfg, grid, resume: str | None):
    """Collective: rank 0 takes the run directory's lock and decides what this start does with an
    earlier run there (``decide_start``); every rank raises if it is in use or refused. Returns the lock
    and the agreed StartDecision (its resume mode, "auto", "none" or a path, and what to set aside later)."""
    lock = RunLock(cfg.train.run_dir, enabled=grid.info.rank == 0, checkpoint_dir=cfg.checkpoint.dir or None)
    problem, decision = None, None
    if grid.info.rank == 0:
        problem = unusable_directory(cfg.train.run_dir, "train.run_dir") or (
            unusable_directory(cfg.checkpoint.dir, "checkpoint.dir") if cfg.checkpoint.dir else None)
    try:
        warning = None if problem else lock.acquire()
        if warning:
            print(f"hpctrain: WARNING: {warning}", file=sys.stderr, flush=True)
    except RunDirInUse as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"train.run_dir={cfg.train.run_dir}: cannot create the run directory: {exc.strerror or exc}"
    local_step = None  # the newest step any node's local tier holds of this run (checkpoint.local_dir)
    if cfg.checkpoint.local_dir:
        local_step = max((s for s in grid.world.allgather_object(newest_held(cfg.checkpoint.local_dir, cfg.train.run_dir))
                          if s is not None), default=None)
    if grid.info.rank == 0 and not problem:
        try:
            decision = decide_start(cfg.train.run_dir, cfg.checkpoint.dir or os.path.join(cfg.train.run_dir, "checkpoints"),
                                    resume, local_step if os.path.exists(os.path.join(cfg.train.run_dir, "metrics.jsonl"))
                                    else None)  # pieces of a run whose directory was deleted and made anew: not its
        except OSError as exc:
            decision = None
            problem = f"train.run_dir={cfg.train.run_dir}: cannot read the earlier run: {exc}"
    problem, decision = grid.world.broadcast_object((problem, decision), root=0)
    if problem or decision.problem:
        lock.release()
        raise everywhere(RunDirInUse(problem) if problem else RunDirHoldsARun(decision.problem))
    return lock, decision


def _deadline(cfg, grid) -> float | None:
    """``train.time_limit_s`` from now, or the scheduler's end time (rank 0 asks, all agree)."""
    if cfg.train.time_limit_s > 0:
        mine = time.time() + cfg.train.time_limit_s
    else:
        mine = scheduler_deadline() if grid.info.rank == 0 else None
    return grid.world.broadcast_object(mine, root=0)
