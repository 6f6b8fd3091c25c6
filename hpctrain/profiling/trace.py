"""Per-rank Chrome-trace / Perfetto JSON of a run's phases and every collective (``train.trace = true``).

``TraceRecorder`` is attached to the trainer's ``PhaseTimer`` and to every ``Communicator`` of the grid.
While a traced step runs (``train.trace_steps`` steps, starting with step 2: step 1 opens connections),
it keeps, in memory:
  - each phase (track ``phases``): name, start, end;
  - each communication call on its group's track (``comm dp``, ``comm tp``, ...): ``op``, payload
    ``bytes``, ``sent`` (wire-model bytes), and whether the caller was blocked for it (a blocking call
    or a ``wait``, category ``blocked``) or it ran in flight behind other work (a non-blocking call from
    start to observed completion, category ``inflight``);
  - one ``step N`` span per step (track ``steps``), from its start to the next step's start.
When the last traced step ends (or the run stops first) it writes ``<run_dir>/trace/rankRRRRR.json``
atomically: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``. Times are
microseconds since a barrier all ranks passed together (``sync``), so the ranks' files line up;
``hpctrain trace RUN_DIR`` merges them into ``trace.json`` (open it in https://ui.perfetto.dev or
chrome://tracing) and prints where each rank's time went (``hpctrain/profiling/report.py``).
"""
from __future__ import annotations

import json
import os
import time

TRACKS = {"steps": 0, "phases": 1}  # groups get the tids after these, in the order they first appear


class TraceRecorder:
    """One rank's trace. ``first_step``..``last_step`` (1-based, inclusive) are recorded."""

    def __init__(self, rank: int, directory: str, first_step: int, last_step: int, meta: dict | None = None):
        self.rank, self.directory = rank, directory
        self.first_step, self.last_step = first_step, last_step
        self.meta = dict(meta or {})
        self.active = False
        self.written: str | None = None
        self.events: list[dict] = []
        self.tracks = dict(TRACKS)
        self.origin = time.perf_counter()
        self._step: tuple[int, float] | None = None

    def sync(self, comm) -> None:
        """Collective over ``comm`` (a Communicator: its barrier is watched, so a rank that never arrives
        ends the job with a hang report): the common time origin of all ranks."""
        comm.barrier()
        self.origin = time.perf_counter()
        self.meta["origin_unix_s"] = time.time()

    # ---------------------------------------------------------------- recording
    def begin_step(self, step: int) -> None:
        """Step ``step`` (1-based) starts now, and the previous one ends: a ``step N`` span is the loop's
        cadence, from the step's start to the next step's start, so what runs between two steps (the
        checkpoint save, the agreement to go on) belongs to the step before. Recording follows the
        traced window."""
        self._end_step()
        if self.active and step > self.last_step:
            self.write()
        self.active = self.first_step <= step <= self.last_step and self.written is None
        if self.active:
            self._step = (step, time.perf_counter())

    def _end_step(self) -> None:
        if self._step is not None:
            step, start = self._step
            self._event(f"step {step}", "step", "steps", start, time.perf_counter(), {"step": step})
            self._step = None

    def phase(self, name: str, start: float, end: float, exclusive: float) -> None:
        """A phase from ``start`` to ``end``; ``exclusive``: its seconds without the phases inside it."""
        self._event(name, "phase", "phases", start, end, {"exclusive_us": round(exclusive * 1e6, 3)})

    def comm(self, group: str, op: str, nbytes: int, sent: int, start: float, end: float, blocked: bool) -> None:
        """A call on ``group``: ``blocked`` for the time the caller waited, else its in-flight span."""
        self._event(op, "blocked" if blocked else "inflight", f"comm {group}", start, end,
                    {"group": group, "bytes": nbytes, "sent": sent})

    def span(self, name: str, track: str, start: float, end: float, **args) -> None:
        """A named span of work on ``track`` (e.g. an MoE layer's dispatch all-to-all, "moe layers.3 dispatch")."""
        self._event(name, "span", track, start, end, args)

    def _event(self, name, cat, track, start, end, args) -> None:
        tid = self.tracks.setdefault(track, len(self.tracks))
        event = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                 "ts": round((start - self.origin) * 1e6, 3), "dur": round((end - start) * 1e6, 3)}
        if args:
            event["args"] = args
        self.events.append(event)

    # ---------------------------------------------------------------- output
    def document(self) -> dict:
        names = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        names += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": track}}
                  for track, tid in self.tracks.items()]
        return {"traceEvents": names + self.events, "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "first_step": self.first_step, "last_step": self.last_step,
                              **self.meta}}

    def write(self) -> str | None:
        """Write the file once (atomically: a partial file never has the final name); returns its path."""
        if self.written is not None:
            return self.written
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"rank{self.rank:05d}.json")
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.document(), f)
        os.replace(tmp, path)
        self.written, self.events, self.active = path, [], False
        return path

    def close(self) -> None:
        """End of the run: write what was recorded (a run that stopped inside the traced window)."""
        self._end_step()
        if self.events:
            self.write()
