"""Handles of non-blocking calls (``Communicator(..., nonblocking=True)`` returns one)."""
from __future__ import annotations

import time

from hpctrain.comm.watchdog import Watchdog


def _end(watchdog: Watchdog, token: int, work) -> None:
    """The call's host part is over: end it, or, for device work still queued on a stream (NCCL work
    has ``device_done``), keep it watched until the device finishes (``Watchdog.end_when``)."""
    device_done = getattr(work, "device_done", None)
    if device_done is None:
        watchdog.end(token)
    else:
        watchdog.end_when(token, device_done)


class Handle:
    """A non-blocking operation in flight. ``wait`` is idempotent; ``test`` never blocks.
    ``traced``: (recorder, group, op, bytes, sent, start) when a trace is recording, else None."""

    __slots__ = ("_work", "_watchdog", "_counter", "_token", "_traced")

    def __init__(self, work, watchdog: Watchdog, counter, token: int, traced=None):
        self._work, self._watchdog, self._counter, self._token = work, watchdog, counter, token
        self._traced = traced

    def test(self) -> bool:
        done = self._work.test()
        if done:
            self._watchdog.end(self._token)
            if self._traced is not None:
                self._trace_done(time.perf_counter())
        return done

    def wait(self) -> None:
        if not self._work.done:
            start = time.perf_counter()
            self._work.wait()
            end = time.perf_counter()
            self._counter.seconds += end - start
            if self._traced is not None:
                recorder, group, op, nbytes, sent, _ = self._traced
                recorder.comm(group, "wait " + op, nbytes, sent, start, end, blocked=True)
        if self._traced is not None:
            self._trace_done(time.perf_counter())
        _end(self._watchdog, self._token, self._work)

    def _trace_done(self, end: float) -> None:
        recorder, group, op, nbytes, sent, start = self._traced
        recorder.comm(group, op, nbytes, sent, start, end, blocked=False)
        self._traced = None
