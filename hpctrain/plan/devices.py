"""Device presets for the performance model: published peaks, memory, and achievable efficiency.

Units: TFLOP/s (1e12 FLOP/s), GiB (2**30 bytes), GB/s (1e9 bytes/s). No torch: hpctrain/runtime/device.py
holds the same peaks for the trainer's MFU (keep the two in step).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.errors import HpcTrainError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


class PlanError(HpcTrainError):
    """A planning request that cannot be answered (unknown device, bad profile, missing link level)."""


@dataclass(frozen=True)
class Device:
    """One rank's accelerator.

    ``peak_tflops``: published dense peak per training dtype (tensor cores; TF32 for float32), TFLOP/s.
    ``efficiency``: the fraction of that peak a LARGE matrix multiplication of a transformer layer reaches
    end to end (calibrated; see DEVICES). ``gemm_half_dim``: the GEMM curve (``gemm_efficiency``): a
    multiplication whose smallest dimension on the rank is ``n`` runs at ``efficiency x n / (n +
    gemm_half_dim)`` (0: no curve, every GEMM at ``efficiency``; measured profiles use 0, their
    efficiency is already the measured block's). ``hbm_gbps``: memory bandwidth, GB/s, for the
    memory-bound element-wise work. ``memory_gib``: capacity per rank, GiB (None: the host's memory
    shared by the ranks of a node, for ``cpu``).
    """

    name: str
    peak_tflops: dict[str, float]
    memory_gib: float | None
    efficiency: float
    hbm_gbps: float
    note: str = ""
    optimizer_s_per_param: float = 0.0  # measured AdamW seconds per parameter (0: from bytes / hbm_gbps)
    intra_gbps: float = 24.0  # default per-rank bandwidth inside a node, Gbit/s (NVLink; shared memory on a CPU)
    gemm_half_dim: float = 0.0

    def peak(self, dtype: str) -> float:
        """Dense peak for ``dtype`` in TFLOP/s; PlanError when the device has none for it."""
        if dtype not in self.peak_tflops:
            raise PlanError(f"device {self.name} has no published {dtype} peak (it has "
                            f"{', '.join(self.peak_tflops)}); choose another --dtype or give --peak-tflops")
        return self.peak_tflops[dtype]

    def gemm_efficiency(self, smallest_dim: float) -> float:
        """Fraction of peak a GEMM reaches whose smallest per-rank dimension is ``smallest_dim``: the
        tile-quantisation and memory-bound tail of thin tensor-parallel shards (Narayanan et al. 2021,
        Fig. 8-9: throughput per GPU falls as d_model / tp shrinks)."""
        c = self.gemm_half_dim
        return self.efficiency * (smallest_dim / (smallest_dim + c) if c > 0 else 1.0)


# Dense peaks from the vendors' data sheets (the same numbers as hpctrain/runtime/device.py's GPU_PEAKS,
# which needs torch; keep the two in step). ``efficiency`` and ``gemm_half_dim`` (the GEMM curve):
#   a100: 0.70 with gemm_half_dim 128, calibrated on the Megatron-LM PTD-P weak-scaling table (Narayanan
#         et al., SC21, Table 1: full recomputation, unfused attention; ptdp.py) and on two rows of
#         Korthikanti et al. 2022 (22B on 8 GPUs, 175B on 64: selective recomputation + SP;
#         published.py, calibration=True). 128 is the smallest dimension at which a GEMM reaches half
#         the large-GEMM rate (tile quantisation and the memory-bound tail of thin tp shards: a 2304-wide
#         model at tp=1 runs its GEMMs at 0.95 of the large rate, a 6144-wide one at tp=8 (768 per rank) at
#         0.86); 0.70 of 312 = 218 TFLOP/s for large GEMMs, below the ~250 cuBLAS reaches in isolation,
#         because it also absorbs what the model leaves out (kernel launches, imperfect overlap).
#   h100: 0.62 with the same curve, calibrated on ONE published H100 run (Nemotron-4 340B on 1536 H100,
#         NVIDIA 2024 technical report, Table 2: 42.4% MFU with tp 8, pp 12, SP, distributed optimizer);
#         checked without tuning on Nemotron-4 at 3072/6144 GPUs and Llama 3 405B at 8192/16384 GPUs
#         (published.py, docs/scaling.md).
#   h200: the h100's constants (same compute die; more and faster memory): an assumption.
#   mi250x, v100, cpu: assumptions, not calibrated: a measured run is better. v100 0.55: Megatron-LM
#         v1.0 reached 48% of peak end to end on a 1.2B GPT. mi250x 0.45: lower GEMM efficiency of the
#         ROCm stack. No GEMM curve (gemm_half_dim 0) for these.
DEVICES: dict[str, Device] = {
    "a100": Device("a100", {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0, "float64": 19.5},
                   80.0, 0.70, 2039.0, "A100 SXM 80 GB", intra_gbps=2400.0, gemm_half_dim=128.0),
    "h100": Device("h100", {"bfloat16": 989.0, "float16": 989.0, "float32": 494.0, "float64": 67.0},
                   80.0, 0.62, 3350.0, "H100 SXM 80 GB", intra_gbps=3600.0, gemm_half_dim=128.0),
    "h200": Device("h200", {"bfloat16": 989.0, "float16": 989.0, "float32": 494.0, "float64": 67.0},
                   141.0, 0.62, 4800.0, "H200 SXM 141 GB (nvidia-smi: ~140 GiB)", intra_gbps=3600.0,
                   gemm_half_dim=128.0),
    "mi250x": Device("mi250x", {"bfloat16": 383.0, "float16": 383.0, "float32": 47.9, "float64": 95.7},
                     128.0, 0.45, 3277.0, "whole package = 2 GCDs; one rank usually drives one GCD: mi250x-gcd", intra_gbps=800.0),
    "mi250x-gcd": Device("mi250x-gcd", {"bfloat16": 191.5, "float16": 191.5, "float32": 23.9, "float64": 47.9},
                         64.0, 0.45, 1638.0, "one GCD of an MI250X (Frontier, LUMI: one rank per GCD)", intra_gbps=800.0),
    "v100": Device("v100", {"float16": 125.0, "float32": 15.7, "float64": 7.8}, 32.0, 0.55, 900.0,
                   "V100 SXM2 32 GB; no bfloat16", intra_gbps=1200.0),
    # One rank on one CPU core: a conservative constant (AVX2/AVX-512 cores reach 0.05-0.2 TFLOP/s in
    # float32 GEMMs); give --peak-tflops from a measurement (e.g. a numpy matmul) for better numbers.
    "cpu": Device("cpu", {"bfloat16": 0.05, "float16": 0.05, "float32": 0.1, "float64": 0.05}, None, 0.5, 10.0,
                  "one core per rank; memory: the host's RAM divided by the ranks per node"),
}


def device_preset(name: str, peak_tflops: float = 0.0, memory_gib: float = 0.0,
                  efficiency: float = 0.0, optimizer_s_per_param: float = 0.0) -> Device:
    """The preset ``name`` with optional overrides (``with_overrides``)."""
    if name not in DEVICES:
        raise PlanError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")
    return with_overrides(DEVICES[name], peak_tflops, memory_gib, efficiency, optimizer_s_per_param)


def with_overrides(d: Device, peak_tflops: float = 0.0, memory_gib: float = 0.0, efficiency: float = 0.0,
                   optimizer_s_per_param: float = 0.0) -> Device:
    """``d`` with each value > 0 replacing its own (a peak override applies to every dtype)."""
    if peak_tflops > 0:
        d = replace(d, peak_tflops={k: peak_tflops for k in DTYPE_BYTES})
    if memory_gib > 0:
        d = replace(d, memory_gib=memory_gib)
    if efficiency > 0:
        d = replace(d, efficiency=efficiency)
    if optimizer_s_per_param > 0:
        d = replace(d, optimizer_s_per_param=optimizer_s_per_param)
    return d
