"""The sinks' own thread (rank 0): the training step only queues its samples; this thread sets the gauges,
writes the scalars and the textfile. The step is never slowed by a sink's work beyond a queue put, and a sink
that raises is dropped here with one warning while training goes on."""
from __future__ import annotations

import queue
import sys
import threading

CLOSE = object()


class SinkWorker:
    """``sinks``: started sinks with ``set(name, labels, value, step)``, ``clear(name)``, ``flush(step)``,
    ``close()`` and a ``name``."""

    def __init__(self, sinks: list):
        self.sinks = list(sinks)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hpctrain-monitor", daemon=True)
        self._thread.start()

    def emit(self, samples: list, step: int, flush: bool = False, clear: tuple[str, ...] = ()) -> None:
        """Queue ``samples`` [(name, labels, value)] of ``step`` (series of ``clear`` dropped first)."""
        self._queue.put((samples, step, flush, clear))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is CLOSE:
                return
            samples, step, flush, clear = item
            for sink in list(self.sinks):
                try:
                    for name in clear:
                        sink.clear(name)
                    for name, labels, value in samples:
                        sink.set(name, labels, value, step)
                    if flush:
                        sink.flush(step)
                except Exception as exc:  # noqa: BLE001 - monitoring never stops training
                    self._drop(sink, exc)

    def _drop(self, sink, exc: BaseException) -> None:
        self.sinks.remove(sink)
        print(f"hpctrain: WARNING: monitor: the {sink.name} sink failed ({type(exc).__name__}: {exc}); training "
              f"goes on without it", file=sys.stderr, flush=True)

    def close(self, clean: bool = True, timeout_s: float = 30.0) -> None:
        """Drain the queue, then (``clean``: ``hpctrain_up`` 0) close every sink. Never raises."""
        if clean:
            self.emit([("hpctrain_up", {}, 0)], 0)
        self._queue.put(CLOSE)
        self._thread.join(timeout_s)
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                self._drop(sink, exc)
        self.sinks = []
