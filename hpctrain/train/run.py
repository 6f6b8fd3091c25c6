"""One training run's parts on this rank (``Run``): what ``train/loop.py`` builds and steps and
``train/ending.py`` ends."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpctrain.checkpoint.contract import Resumed
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.comm.grid import ProcessGrid
from hpctrain.monitor.run_monitor import RunMonitor
from hpctrain.profiling.trace import TraceRecorder
from hpctrain.runtime.signals import SignalFlag
from hpctrain.train.metrics import MetricsLog
from hpctrain.train.run_lock import RunLock
from hpctrain.train.stop import StopPolicy
from hpctrain.train.trainer import Trainer


@dataclass
class Run:
    """One training run's parts on this rank, from ``_start`` to ``ending.leave``."""
    cfg: Any
    grid: ProcessGrid
    device: Any
    trainer: Trainer
    checkpoints: CheckpointManager
    monitor: RunMonitor
    log: MetricsLog
    policy: StopPolicy
    flag: SignalFlag
    lock: RunLock
    trace: TraceRecorder | None
    kernels: Any  # the CUDA profiler of train.trace, or None
    verbose: bool
    resumed: Resumed | None  # what the run resumed from (tier, path, step), or None
    resumed_step: int | None  # its step: stopping before a step must not save it again
    last_step: int

    @property
    def is_root(self) -> bool:
        return self.grid.info.rank == 0
