"""``train.trace`` on CUDA: a torch.profiler trace of the traced steps, to see where the host waits.

The phase trace (hpctrain/profiling/trace.py) times what the host does; on a GPU the host only queues
work, so the question is where it WAITS for the device: ``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize`` or a blocking device-to-host ``cudaMemcpy`` (an ``.item()``). ``cuda_profiler``
records CPU ops, CUDA runtime calls and kernels of ``trace_steps`` steps after the first into
``<run_dir>/trace/cuda-rankNNNNN.json`` (Chrome trace: chrome://tracing or Perfetto). The sync-free step
(hpctrain/train/verdict.py) should show one ``cudaEventSynchronize`` per step, after the fused AdamW
kernel is queued (the previous step's verdict), and none between the forward and the optimizer.
"""
from __future__ import annotations

import os

import torch


def cuda_profiler(train_cfg, rank: int, device: torch.device):
    """A started ``torch.profiler.profile`` (call ``.step()`` after each training step, ``.stop()`` at the
    end), or None unless ``train_cfg.trace`` and ``device`` is CUDA."""
    if not train_cfg.trace or device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    path = os.path.join(train_cfg.run_dir, "trace", f"cuda-rank{rank:05d}.json")
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=1, warmup=0, active=train_cfg.trace_steps, repeat=1),
                       on_trace_ready=lambda p: p.export_chrome_trace(path))
    profiler.start()
    return profiler
