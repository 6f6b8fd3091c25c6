"""One background job at a time (an asynchronous save, a local-tier save): started on a daemon thread, its
error kept and raised by ``wait`` on the caller's thread."""
from __future__ import annotations

import threading
from typing import Callable


class BackgroundJob:
    """Runs ``start(fn, *args)`` on a thread named ``name``; ``wait()`` joins it and re-raises what it raised."""

    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable, *args) -> None:
        """Start ``fn(*args)``; the previous job must have been waited for."""
        assert self._thread is None, "wait() for the previous job first"
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # raised by wait() on the caller's thread
            self._error = exc

    @property
    def failed(self) -> bool:
        """The job ended with an error that ``wait`` has not raised yet."""
        return self._thread is not None and not self._thread.is_alive() and self._error is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the job ends; raise its error, if any (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
