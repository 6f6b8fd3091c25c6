"""When to stop: signals, the time limit and ``--max-steps`` as ONE per-step decision agreed by all ranks.

``StopPolicy.local_reason(step)`` is what this rank alone sees: ``"signal USR1"`` (a flag set by the
handler), ``"time limit"`` (the next step plus a save would not finish before the deadline) or
``"max steps"``. The ranks' views become one answer (the highest code) so every rank stops after the
same step even if the signal reached them at different moments.

Time limit: stop when ``now + margin > deadline``, where margin = one step + ``safety`` x the
MEASURED duration of the last save (``record_save``); before any save was measured, the margin is
``first_margin_s`` (``train.time_limit_margin_s``).

In the training loop the request rides on the step's own reduction (hpctrain/train/verdict.py): a rank's
reason becomes a one-hot entry (``stop_slot``) of the step's float64 vector summed over the world, and
``reason_from_slots`` takes the highest set slot (= the highest code, as the max all-reduce would). The
answer arrives with the step's verdict, one step after the request (or two when the host reads the step
late), so the time-limit margin counts ``lag_steps`` more steps. ``"max steps"`` needs no agreement (every
rank counts the same steps).
"""
from __future__ import annotations

import signal
import time

REASONS = ("", "max steps", "time limit", "local checkpoint failed")  # codes 0..3; a signal: 100 + its number
LOCAL_TIER_FAILED = REASONS[3]  # a background save of the node-local tier raised (agreed there): an error ending


class StopPolicy:
    def __init__(self, *, signal_flag=None, last_step: int, deadline: float | None = None,
                 first_margin_s: float = 60.0, safety: float = 2.0, clock=time.time):
        self.signal_flag, self.last_step, self.deadline = signal_flag, last_step, deadline
        self.first_margin_s, self.safety, self.clock = first_margin_s, safety, clock
        self.last_save_s: float | None = None
        self.last_step_s = 0.0
        self.lag_steps = 0  # steps that run between a request and the agreed answer (a piggy-backed request)
        self.signal_seen_after: int | None = None  # steps done when this rank first saw the signal

    def record_save(self, seconds: float | None) -> None:
        """The last completed save's duration; None (no save measured yet: the first async save may still
        be running) keeps the previous measurement, or ``first_margin_s`` before any."""
        if seconds is not None:
            self.last_save_s = seconds

    def record_step(self, seconds: float) -> None:
        self.last_step_s = seconds

    def margin_s(self) -> float:
        save = self.first_margin_s if self.last_save_s is None else self.safety * self.last_save_s
        return (1 + self.lag_steps) * self.last_step_s + save

    def local_reason(self, step: int) -> str:
        """This rank's view after ``step`` steps: "" (go on) or why to stop."""
        if self.signal_flag is not None and self.signal_flag.received:
            if self.signal_seen_after is None:
                self.signal_seen_after = step
            return f"signal {self.signal_flag.received}"
        if self.deadline is not None and self.clock() + self.margin_s() > self.deadline:
            return "time limit"
        if step >= self.last_step:
            return "max steps"
        return ""


    def signal_timing(self, stop_step: int) -> dict:
        """How long a signal stop took, for the stop event: ``signal_seen_after_step`` (steps done when this
        rank first saw the flag; the signal arrived during the step after it or later), ``steps_after_signal``
        (steps run after that: 1 + ``lag_steps`` at most) and ``signal_to_saved_s`` (from the signal to now,
        the final save done). Empty when no signal stopped the run."""
        if self.signal_seen_after is None or self.signal_flag is None or self.signal_flag.received_at is None:
            return {}
        return {"signal_seen_after_step": self.signal_seen_after,
                "steps_after_signal": stop_step - self.signal_seen_after,
                "signal_to_saved_s": round(self.clock() - self.signal_flag.received_at, 3)}


def encode(reason: str) -> int:
    if reason.startswith("signal "):
        return 100 + int(getattr(signal, "SIG" + reason.split()[1]))
    return REASONS.index(reason)


def decode(code: int) -> str:
    return f"signal {signal.Signals(code - 100).name.removeprefix('SIG')}" if code >= 100 else REASONS[code]


STOP_SLOTS = len(REASONS) + 65  # one-hot slots: codes 0..3, then signals 0..64 (code 100 + n -> slot 4 + n)


def stop_slot(reason: str) -> int | None:
    """The slot of ``reason``'s one-hot entry in a summed stop vector (None: no request)."""
    code = encode(reason)
    return None if code == 0 else (code if code < 100 else len(REASONS) + code - 100)


def reason_from_slots(slots) -> str:
    """The agreed reason from the world's summed one-hot slots (a sequence of counts): the highest one set."""
    for slot in range(len(slots) - 1, 0, -1):
        if slots[slot] > 0:
            return decode(slot if slot < len(REASONS) else 100 + slot - len(REASONS))
    return ""
