"""When to stop: signals, the time limit and ``--max-steps`` as ONE per-step decision agreed by all ranks.

``StopPolicy.local_reason(step)`` is what this rank alone sees: ``"signal USR1"`` (a flag set by the
handler), ``"time limit"`` (the next step plus a save would not finish before the deadline) or
``"max steps"``. ``agree_stop_reason(reason, world)`` turns the ranks' views into one answer with ONE tiny
all-reduce (max of a 4-byte code), so every rank stops after the same step even if the signal
reached them at different moments.

Time limit: stop when ``now + margin > deadline``, where margin = one step + ``safety`` x the
MEASURED duration of the last save (``record_save``); before any save was measured, the margin is
``first_margin_s`` (``train.time_limit_margin_s``).
"""
from __future__ import annotations

import signal
import time

import torch

REASONS = ("", "max steps", "time limit")  # codes 0..2; a signal is 100 + its number (highest wins)


class StopPolicy:
    def __init__(self, *, signal_flag=None, last_step: int, deadline: float | None = None,
                 first_margin_s: float = 60.0, safety: float = 2.0, clock=time.time):
        self.signal_flag, self.last_step, self.deadline = signal_flag, last_step, deadline
        self.first_margin_s, self.safety, self.clock = first_margin_s, safety, clock
        self.last_save_s: float | None = None
        self.last_step_s = 0.0

    def record_save(self, seconds: float | None) -> None:
        """The last completed save's duration; None (no save measured yet: the first async save may still
        be running) keeps the previous measurement, or ``first_margin_s`` before any."""
        if seconds is not None:
            self.last_save_s = seconds

    def record_step(self, seconds: float) -> None:
        self.last_step_s = seconds

    def margin_s(self) -> float:
        save = self.first_margin_s if self.last_save_s is None else self.safety * self.last_save_s
        return self.last_step_s + save

    def local_reason(self, step: int) -> str:
        """This rank's view after ``step`` steps: "" (go on) or why to stop."""
        if self.signal_flag is not None and self.signal_flag.received:
            return f"signal {self.signal_flag.received}"
        if self.deadline is not None and self.clock() + self.margin_s() > self.deadline:
            return "time limit"
        if step >= self.last_step:
            return "max steps"
        return ""


def encode(reason: str) -> int:
    if reason.startswith("signal "):
        return 100 + int(getattr(signal, "SIG" + reason.split()[1]))
    return REASONS.index(reason)


def decode(code: int) -> str:
    return f"signal {signal.Signals(code - 100).name.removeprefix('SIG')}" if code >= 100 else REASONS[code]


def agree_stop_reason(reason: str, world) -> str:
    """Collective over ``world`` (a Communicator): the reason every rank acts on (the highest code)."""
    code = torch.tensor([encode(reason)], dtype=torch.int32)
    if world.size > 1:
        world.allreduce(code, op="max")
    return decode(int(code.item()))


class StopAgreement:
    """``agree_stop_reason`` made every step: the 4-byte max through a persistent request on ``world``
    (``Communicator.recurring_allreduce``; building it is collective over ``world``)."""

    def __init__(self, world):
        self.code = torch.zeros(1, dtype=torch.int32)
        self._max = world.recurring_allreduce(self.code, op="max") if world.size > 1 else None

    def agree(self, reason: str) -> str:
        self.code[0] = encode(reason)
        if self._max is not None:
            self._max()
        return decode(int(self.code.item()))
