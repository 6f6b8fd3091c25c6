"""Which device a rank trains on, and what that device can do (peak FLOP/s for MFU).

``select_device(choice, info)`` turns ``train.device`` into a ``torch.device``:
- ``cpu``: the host;
- ``cuda``: the GPU that ``bind_device`` picks for this node-local rank, or a ``DeviceError`` naming
  the host and ``CUDA_VISIBLE_DEVICES`` when torch sees none;
- ``auto``: that GPU when CUDA is available, else the host.
ROCm builds of torch report AMD GPUs as ``cuda`` too, so the same choices apply there (untested).

``peak_tflops(device, dtype)``: the published dense peak of a known GPU model for the training
dtype (tensor cores; TF32 for float32 when ``allow_tf32``), or 0.0 when unknown (then MFU is not
reported unless ``train.peak_tflops`` is set); ``gpu_peak_tflops(name, dtype)`` is that table lookup by
the GPU's name alone (testable without a GPU).
"""
from __future__ import annotations

import socket

import torch

from hpctrain.errors import HpcTrainError
from hpctrain.runtime import env
from hpctrain.runtime.launcher import RankInfo, bind_device

DEVICE_CHOICES = ("auto", "cpu", "cuda")

# Dense peak TFLOP/s from the vendors' data sheets: (name fragment, {dtype: peak}); first match wins,
# so more specific names come first. float32 uses the TF32 tensor-core peak (with allow_tf32).
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 494.0, "float64": 67.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0, "float64": 51.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 494.0, "float64": 67.0}),  # SXM
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0, "float64": 19.5}),
    ("V100", {"float16": 125.0, "float32": 15.7, "float64": 7.8}),
    ("MI250X", {"bfloat16": 383.0, "float16": 383.0, "float32": 47.9, "float64": 95.7}),
    ("MI300X", {"bfloat16": 1307.0, "float16": 1307.0, "float32": 653.7, "float64": 81.7}),
)


class DeviceError(HpcTrainError):
    """The requested device does not exist on this rank."""


def select_device(choice: str, info: RankInfo) -> torch.device:
    """``train.device`` -> this rank's device (binds the CUDA device of a GPU choice)."""
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"train.device={choice!r}: expected one of {', '.join(DEVICE_CHOICES)}")
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if choice == "auto":
            return torch.device("cpu")
        visible = env.cuda_visible_devices()
        visible = "<unset>" if visible is None else visible
        raise DeviceError(f"train.device='cuda' but torch sees no CUDA device on {socket.gethostname()} "
                          f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
                          f"CUDA_VISIBLE_DEVICES={visible}); use train.device=cpu or auto, or a GPU node")
    return bind_device(info)


def peak_tflops(device: torch.device, dtype: torch.dtype, allow_tf32: bool = True) -> float:
    """Published dense peak of ``device`` for ``dtype`` in TFLOP/s, or 0.0 when unknown."""
    if device.type != "cuda":
        return 0.0
    key = str(dtype).removeprefix("torch.")
    if key == "float32" and not allow_tf32:
        return 0.0  # plain FP32 peaks are rarely what a run is compared with; set train.peak_tflops
    return gpu_peak_tflops(torch.cuda.get_device_name(device), dtype)


def gpu_peak_tflops(name: str, dtype: torch.dtype) -> float:
    """Published dense peak of the GPU model ``name`` (as ``torch.cuda.get_device_name`` reports it) for
    ``dtype`` in TFLOP/s (float32: the TF32 peak), or 0.0 when unknown; the first ``GPU_PEAKS`` match wins."""
    key = str(dtype).removeprefix("torch.")
    for fragment, peaks in GPU_PEAKS:
        if fragment in name:
            return peaks.get(key, 0.0)
    return 0.0


def configure_matmul(device: torch.device, allow_tf32: bool) -> None:
    """TF32 tensor cores for float32 matmuls and convolutions on NVIDIA GPUs (Ampere and newer)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32


def describe(device: torch.device) -> str:
    """One line for logs: ``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
