"""Step metrics out: ``<run_dir>/metrics.jsonl`` (one JSON line per step, then the stop event), a progress
display and a summary (``summary.json``). The one writer of both files.

Only world rank 0 writes; every rank holds the same numbers (they are agreed by collectives).
On a terminal the progress is a rich bar with loss and throughput; in batch logs (no TTY) it is
one plain line every ``log_interval`` steps, which reads well in a Slurm output file.

Every line is strict JSON: a non-finite number (a diverged loss, an overflowed gradient norm) is
written as ``null`` (``json_line``). Records are streamed to the file, not kept: the summary is made
from running counts and the timings of the last ``SUMMARY_WINDOW`` steps.
"""
from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from typing import Any

SUMMARY_WINDOW = 10_000  # steps whose timings the summary keeps (3 floats each)


def finite_or_none(value):
    """``value`` with every non-finite float inside (dicts, lists) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def json_line(record: dict) -> str:
    """One strict-JSON line (no bare NaN/Infinity, which JSON does not have)."""
    return json.dumps(finite_or_none(record), allow_nan=False) + "\n"


class MetricsLog:
    def __init__(self, run_dir: str, total_steps: int, *, enabled: bool, progress: bool = True,
                 log_interval: int = 1, stream=None):
        self.enabled, self.total, self.log_interval = enabled, total_steps, max(1, log_interval)
        self.stream = stream or sys.stdout
        self.steps = self.skipped = 0
        self.first_loss: float | None = None
        self.final_loss: float | None = None
        # (tokens_per_s, step_time_s, comm_time_s) of the last steps
        self.timings: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=SUMMARY_WINDOW)
        self.started = time.perf_counter()
        self.run_peak: dict | None = None  # rank 0: the whole run's peak memory (``run_peak_memory``), set at the end
        self._file = self._bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        if progress and self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total_steps, status="")
            self._bar.start()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.steps += 1
        self.skipped += bool(record.get("skipped"))
        self.first_loss = record["loss"] if self.first_loss is None else self.first_loss
        self.final_loss = record["loss"]
        self.timings.append((record["tokens_per_s"], record["step_time_s"], record["comm_time_s"]))
        assert self._file is not None  # opened when enabled
        self._file.write(json_line(record))
        self._file.flush()
        status = (f"loss {record['loss']:.4f}  "
                  + (f"val_loss {record['val_loss']:.4f}  " if "val_loss" in record else "")
                  + f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s"
                  + ("  SKIPPED (inf/NaN loss or gradients: update not applied)" if record.get("skipped") else ""))
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], status=status)
        elif record["step"] % self.log_interval == 0 or record["step"] == self.total or record.get("skipped"):
            print(f"step {record['step']}/{self.total}  {status}  grad_norm {record['grad_norm']:.3f}  "
                  f"step {record['step_time_s'] * 1000:.0f} ms (comm {record['comm_time_s'] * 1000:.0f} ms)",
                  file=self.stream, flush=True)

    def event(self, record: dict) -> None:
        """One non-step line (``{"event": "stop", ...}``), strict JSON, before ``close``."""
        if self.enabled:
            assert self._file is not None  # opened when enabled
            self._file.write(json_line(record))
            self._file.flush()

    def write_summary(self, summary: dict, **run: Any) -> None:
        """``<run_dir>/summary.json``: ``close``'s summary and the ``run``'s shape (ranks, nodes, axes)."""
        with open(os.path.join(os.path.dirname(self.path), "summary.json"), "w", encoding="utf-8") as f:
            json.dump(finite_or_none({**summary, **run}), f, indent=1, allow_nan=False)

    def close(self) -> dict:
        """Stop the display, print and return the summary."""
        if not self.enabled:
            return {}
        if self._bar is not None:
            self._bar.stop()
        assert self._file is not None  # opened when enabled
        self._file.close()
        if not self.steps:
            return {}
        timings = list(self.timings)
        tail = timings[len(timings) // 2:] if len(timings) > 1 else timings  # steady state: skip warm-up half
        summary: dict[str, Any] = {
            "steps": self.steps, "first_loss": self.first_loss, "final_loss": self.final_loss,
            "mean_tokens_per_s": sum(t[0] for t in tail) / len(tail),
            "mean_step_time_s": sum(t[1] for t in tail) / len(tail),
            "comm_fraction": sum(t[2] for t in tail) / max(1e-12, sum(t[1] for t in tail)),
            "skipped_steps": self.skipped,
            "wall_time_s": time.perf_counter() - self.started,
        }
        peak = ""
        if self.run_peak:  # the whole run's peak per rank (``run_peak_memory``)
            summary.update(self.run_peak)
            peak = (f", peak memory {self.run_peak['run_peak_memory_gib']:.2f} GiB per rank (rank "
                    f"{self.run_peak['run_peak_memory_rank']}, whole run)")
        print(f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
              f"{summary['mean_tokens_per_s']:.0f} tokens/s, comm {100 * summary['comm_fraction']:.0f}% of step "
              f"time, {summary['wall_time_s']:.1f} s{peak}; metrics in {self.path}", file=self.stream, flush=True)
        return summary


def model_state_bytes(parts) -> dict[str, int]:
    """This rank's model state kept between steps, in bytes: {"params", "grads", "optimizer"} (what ZeRO
    slices: the parameter engine, hpctrain/parallel/zero/engine.py, and hpctrain/optim/flat.py); a LoRA
    run's frozen base counts as parameters (at ZeRO-3 its slices)."""
    return {**parts.params.memory_bytes(), "optimizer": parts.optimizer.state_bytes()}


def describe_state(state: dict[str, int]) -> str:
    return ", ".join(f"{name} {state[key] / 2**20:.2f} MiB" for name, key in
                     (("parameters", "params"), ("gradients", "grads"), ("optimizer", "optimizer")))


def report_peak_memory(world, device, record: dict, state: dict[str, int] | None = None) -> None:
    """Collective over ``world`` (once, after the run's first step): every rank's peak memory (``peak_memory``)
    and model state (``model_state_bytes``) gathered on rank 0, which adds ``peak_memory_gib`` (the maximum
    over the ranks), ``peak_memory_rank``, ``peak_memory_source`` and ``model_state_bytes`` (that rank's
    {"params", "grads", "optimizer"}) to ``record`` (metrics.jsonl) and prints one line."""
    from hpctrain.runtime.peak_memory import peak_memory

    used, source = peak_memory(device)
    every = world.gather_object((used, state), root=0)
    if every is None:
        return
    top = max(range(len(every)), key=lambda r: every[r][0])
    record.update(peak_memory_gib=round(every[top][0] / 2**30, 4), peak_memory_rank=top, peak_memory_source=source)
    kept = ""
    if state is not None:
        record["model_state_bytes"] = every[top][1]
        kept = f", of which model state {describe_state(every[top][1])}"
    print(f"hpctrain train: memory per rank after step {record['step']}: peak {every[top][0] / 2**30:.3f} GiB on rank "
          f"{top} since the process started (build included){kept} (least peak {min(u for u, _ in every) / 2**30:.3f} GiB), {source}; `hpctrain plan --model "
          f"<config>` predicts it per GPU", flush=True)


def run_peak_memory(world, device) -> dict | None:
    """Collective over ``world`` (once, at the run's end): the peak of the whole run per rank -- build, steps,
    saves and resume, never reset (hpctrain/runtime/peak_memory.py) -- on rank 0 as ``run_peak_memory_gib``
    (the maximum over the ranks), ``run_peak_memory_rank`` and ``run_peak_memory_source``; None elsewhere."""
    from hpctrain.runtime.peak_memory import peak_memory

    used, source = peak_memory(device)
    every = world.gather_object(used, root=0)
    if every is None:
        return None
    top = max(range(len(every)), key=lambda r: every[r])
    return {"run_peak_memory_gib": round(every[top] / 2**30, 4), "run_peak_memory_rank": top,
            "run_peak_memory_source": source}
