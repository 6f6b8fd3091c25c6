"""Per-rank step times, gathered every monitor interval to find stragglers (collective over the world).

Every rank adds up, between two gathers, its steps' WORK seconds (its step time less the time it was
blocked in communication: in a synchronous step every rank's wall time is the slowest rank's, so the work
is what tells the slow rank apart) and the bytes it sent on each process group. One ``allgather_object`` of
those few numbers per interval (not per step) gives rank 0 the slowest and the median rank and the bytes
of all ranks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class RankSummary:
    slowest_rank: int
    slowest_s: float  # mean work seconds per step of the slowest rank
    median_rank: int
    median_s: float
    ratio: float  # slowest_s / median_s (1 when the median is 0)
    bytes_by_group: dict  # {group: bytes sent by all ranks in the interval}


class RankWindow:
    """This rank's work seconds and bytes since the last ``gather``."""

    def __init__(self):
        self.work_s, self.steps, self.bytes = 0.0, 0, defaultdict(int)

    def add(self, record: dict) -> None:
        self.work_s += max(0.0, record["step_time_s"] - record["comm_time_s"])
        self.steps += 1
        for group, stats in (record.get("groups") or {}).items():
            self.bytes[group] += int(stats["bytes_sent"])

    def gather(self, world) -> RankSummary:
        """Collective over ``world`` (a Communicator): every rank's window -> the summary (the same on every
        rank); the window starts over."""
        mine = (self.work_s / max(self.steps, 1), dict(self.bytes))
        self.work_s, self.steps, self.bytes = 0.0, 0, defaultdict(int)
        return summarize(world.allgather_object(mine))


def summarize(per_rank: list[tuple[float, dict]]) -> RankSummary:
    """``per_rank[r]`` = (mean work seconds, {group: bytes}) of rank r -> the slowest and the (lower) median rank."""
    order = sorted(range(len(per_rank)), key=lambda r: (per_rank[r][0], r))
    slowest, median = order[-1], order[(len(order) - 1) // 2]
    slow_s, median_s = per_rank[slowest][0], per_rank[median][0]
    totals: defaultdict[str, int] = defaultdict(int)
    for _, sent in per_rank:
        for group, n in sent.items():
            totals[group] += n
    return RankSummary(slowest, slow_s, median, median_s, slow_s / median_s if median_s > 0 else 1.0, dict(totals))

