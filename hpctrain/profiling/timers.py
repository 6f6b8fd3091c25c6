"""Where a step's time goes: exclusive per-phase wall-clock timers, cheap enough to be always on.

``PhaseTimer`` accumulates seconds per named phase. Phases nest (a pipeline receive inside a forward,
a compression inside a backward hook) and time is EXCLUSIVE: a phase's seconds exclude the phases
opened inside it, so the phases of a step add up to the step's wall time (what no phase covers is
reported as ``other``). A timing costs two ``perf_counter`` calls and a dict update (~1 us); with a
``TraceRecorder`` attached and active, every phase is also an event in the rank's Chrome trace.

The phases the package records (docs/scaling.md):
  data       next global batch from the sampler, copy to the device
  forward    stage forward (and the loss on the last stage)
  backward   stage backward (DP bucket launches from its hooks included); zb-h1/zb-v: B, the input gradient
  weight     zb-h1/zb-v: W, the deferred weight gradients (and the DP bucket launches their hooks make)
  pp_wait    pipeline receives and send completion: the bubble and pipeline communication
  pp_drain   after the schedule's last action, waiting for the other pipeline stages to finish theirs: the
             drain part of the bubble (1F1B's last stage idles here while the first runs its last backwards)
  compress   gradient compression and decompression (compressed reducers)
  dp_wait    exposed data-parallel reduction: waiting for buckets after the last backward
  loss       agreeing the step's loss over pp and dp
  grad_norm  global gradient norm (local sum of squares and its allreduce)
  optimizer  the optimizer update
  checkpoint the blocking part of the checkpoint save after the step (a stall outside ``step_time_s``;
             the training loop adds it to the step's record)
  eval       after the step: the validation loss (``train.eval_interval``), outside ``step_time_s``
  sync       before the step: all ranks agree whether to go on (signals, time limit; outside
             ``step_time_s``: a rank that arrives late shows here on the others)

Components take a timer argument and default to ``NULL_TIMER`` (a no-op with the same interface), so
a FlatParams or PipelineExecutor built by hand in a test needs none.
"""
from __future__ import annotations

import time

BETWEEN_STEPS = ("checkpoint", "sync", "eval")  # phases the training loop runs outside ``Trainer.train_step``


class PhaseTimer:
    """Exclusive seconds per phase since the last ``collect``; ``trace``: optional TraceRecorder."""

    def __init__(self, trace=None):
        self.trace = trace
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [name, start, child_seconds]

    def phase(self, name: str) -> "_Phase":
        """``with timer.phase("forward"): ...`` times the block into ``name``."""
        return _Phase(self, name)

    def begin(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def end(self) -> None:
        name, start, children = self._stack.pop()
        now = time.perf_counter()
        total = now - start
        self.seconds[name] = self.seconds.get(name, 0.0) + total - children
        if self._stack:
            self._stack[-1][2] += total
        trace = self.trace
        if trace is not None and trace.active:
            trace.phase(name, start, now, total - children)

    def add(self, name: str, seconds: float) -> None:
        """Account ``seconds`` measured elsewhere to ``name`` (not nested in an open phase)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self, name: str) -> float:
        """Remove and return the seconds accumulated in ``name`` (0 if none)."""
        return self.seconds.pop(name, 0.0)

    def collect(self, wall: float) -> dict[str, float]:
        """The phases since the last collect, plus ``other``: the part of ``wall`` (the step's seconds)
        that no phase inside the step covered (``BETWEEN_STEPS`` phases are outside it); resets."""
        phases, self.seconds = self.seconds, {}
        phases["other"] = max(0.0, wall - sum(v for k, v in phases.items() if k not in BETWEEN_STEPS))
        return phases


class _Phase:
    __slots__ = ("timer", "name")

    def __init__(self, timer, name):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.timer.begin(self.name)
        return self

    def __exit__(self, *exc):
        self.timer.end()
        return False


class _NullPhase:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class NullTimer:
    """The default timer of every component: does nothing, costs one call."""

    trace = None
    _phase = _NullPhase()

    def phase(self, name: str) -> _NullPhase:
        return self._phase

    def begin(self, name: str) -> None:
        pass

    def end(self) -> None:
        pass

    def add(self, name: str, seconds: float) -> None:
        pass

    def take(self, name: str) -> float:
        return 0.0

    def collect(self, wall: float) -> dict[str, float]:
        return {}


NULL_TIMER = NullTimer()
