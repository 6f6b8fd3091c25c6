"""``train.trace`` on CUDA: a torch.profiler trace of the traced steps, to see where the host waits.

The phase trace (hpctrain/profiling/trace.py) times what the host does; on a GPU the host only queues
work, so the question is where it WAITS for the device: ``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize`` or a blocking ``cudaMemcpy`` (an ``.item()``). ``cuda_profiler``
records CPU ops, CUDA runtime calls and kernels of ``trace_steps`` steps after the first into
``<run_dir>/trace/cuda-rankNNNNN.json`` (Chrome trace: chrome://tracing or Perfetto). ``host_waits``
reads one back: per profiled step (``ProfilerStep#N``), the host waits made before the step queued its
optimizer (``aten::_fused_adamw_``, or the last CPU op of the step without one) and after it;
``hpctrain trace RUN_DIR`` prints them. The sync-free step (hpctrain/train/verdict.py) should show none
before and one ``cudaEventSynchronize`` after (the previous step's verdict).
"""
from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the training run anyway; `hpctrain trace` does without it
    import torch

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
OPTIMIZER_OPS = ("aten::_fused_adamw_", "aten::_fused_adam_")


def cuda_profiler(train_cfg, rank: int, device: torch.device):
    """A started ``torch.profiler.profile`` (call ``.step()`` after each training step, ``.stop()`` at the
    end), or None unless ``train_cfg.trace`` and ``device`` is CUDA."""
    if not train_cfg.trace or device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    path = os.path.join(train_cfg.run_dir, "trace", f"cuda-rank{rank:05d}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)  # kineto only logs a missing directory, writes nothing
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=1, warmup=0, active=train_cfg.trace_steps, repeat=1),
                       on_trace_ready=lambda p: p.export_chrome_trace(path))
    profiler.start()
    return profiler


def is_host_wait(name: str) -> bool:
    """A CUDA runtime call that blocks the host until the device catches up."""
    return name in WAITS or (name.startswith("cudaMemcpy") and "Async" not in name)


def host_waits(events: list[dict]) -> list[dict]:
    """Per profiled step of a torch.profiler Chrome trace's ``events``: {"step", "before_optimizer": [names],
    "after_optimizer": [names], "wait_ms"} (host waits, by the host's clock, split at the step's first
    optimizer op; all are "before" in a step without one)."""
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e),
                   key=lambda e: e["ts"])
    waits = [e for e in events if is_host_wait(str(e.get("name", ""))) and "dur" in e]
    rows = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        optimizer = min((e["ts"] for e in events if e.get("name") in OPTIMIZER_OPS and lo <= e["ts"] <= hi),
                        default=hi)
        inside = sorted((e for e in waits if lo <= e["ts"] <= hi), key=lambda e: e["ts"])
        rows.append({"step": step["name"], "before_optimizer": [e["name"] for e in inside if e["ts"] < optimizer],
                     "after_optimizer": [e["name"] for e in inside if e["ts"] >= optimizer],
                     "wait_ms": round(sum(e["dur"] for e in inside) / 1e3, 3)})
    return rows


def host_wait_lines(run_dir: str) -> list[str]:
    """``hpctrain trace``'s lines on the CUDA traces of ``run_dir`` (none without them)."""
    lines = []
    for path in sorted(glob.glob(os.path.join(run_dir, "trace", "cuda-rank*.json"))):
        with open(path, encoding="utf-8") as f:
            rows = host_waits(json.load(f).get("traceEvents", []))
        before = sum(len(r["before_optimizer"]) for r in rows)
        lines.append(f"{os.path.basename(path)}: {len(rows)} profiled steps; host waits before the optimizer is "
                     f"queued: {before}{' (none: the step queues its work without waiting)' if not before else ''}")
        lines += [f"  {r['step']}: before {r['before_optimizer'] or '-'}, after {r['after_optimizer'] or '-'}, "
                  f"{r['wait_ms']} ms waiting" for r in rows]
    return lines
