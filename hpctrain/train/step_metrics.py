"""One training step's record: what ``Trainer.train_step`` returns and metrics.jsonl logs, and the per-group
communication deltas that go into it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepMetrics:
    step: int
    loss: float | None  # None until the step's verdict is read (Trainer._resolve), as grad_norm, loss_scale, skipped
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    step_time_s: float
    comm_time_s: float
    mfu: float | None
    loss_scale: float | None
    skipped: bool | None
    bytes_sent: int = 0  # bytes this rank sent on all groups this step (Communicator's wire model)
    compression_ratio: float = 1.0  # gradient traffic: dense bytes / bytes sent
    compress_s: float = 0.0  # seconds in compress + decompress
    time_s: dict = field(default_factory=dict)  # {phase: seconds} of this rank (hpctrain/profiling/timers.py), exclusive
    groups: dict = field(default_factory=dict)  # {group: {"comm_s": blocked seconds, "bytes_sent": bytes}} of this rank

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def group_deltas(before: dict, after: dict) -> dict:
    """Per-group blocked seconds and bytes sent between two ``CommStats.by_group`` readings."""
    out = {}
    for group, (seconds, sent) in after.items():
        s0, b0 = before.get(group, (0.0, 0))
        if seconds > s0 or sent > b0:
            out[group] = {"comm_s": round(seconds - s0, 6), "bytes_sent": sent - b0}
    return out
