"""Gradient compression in the performance model: the dp reduction's bytes on the wire, and 1-bit Adam's
dense warm-up.

``dp_wire_fraction(method, zero)`` is the bytes a compressed dp reduction sends over the bytes of the
dense one it replaces (``Options.dp_compression``; cost.py charges ``grads x fraction`` to the same
collective). The fractions are the compressors' payloads (hpctrain/compression/quantize.py, zfp.py), per
float32 gradient value, and match ``compression_ratio`` in metrics.jsonl:

- fp16 / bf16: 2 of 4 bytes; int8: 1 byte + a float32 scale per 256 values; zfp: ``zfp_rate`` bits;
  onebit: 1 bit (its one scale per compressed vector is negligible);
- onebit-adam, after ``compression.warmup_steps`` dense steps: 1 bit + a float32 scale per 2048 values
  (31.5x less), sent twice: a compressed all-to-all, then a compressed all-gather, i.e. an all-reduce's
  traffic. Without ZeRO that replaces a dense all-reduce (fraction 1/31.5); with ZeRO-1 it replaces the
  reduce-scatter, half an all-reduce (fraction 2/31.5, the ``compression_ratio`` of about 16x the engine
  reports), and ZeRO-1's dense parameter all-gather stays.

Not modelled: compress/decompress time (``compress_s`` in metrics.jsonl: 5-20 ms per million values on one
CPU core, docs/benchmarks.md) and the methods whose traffic depends on the data or the shapes (topk,
randomk: index and value counts; powersgd: the rank against each matrix's shape): ``hpctrain plan``
refuses them in one line rather than guess.
"""
from __future__ import annotations

from hpctrain.plan.devices import PlanError

INT8_BLOCK, ONEBIT_ADAM_BLOCK = 256, 2048
MODELLED = ("none", "fp16", "bf16", "int8", "zfp", "onebit", "onebit-adam")


def payload_fraction(method: str, zfp_rate: float = 8.0) -> float:
    """Bytes of ``method``'s payload per byte of float32 gradients it replaces (1.0 for "none")."""
    fractions = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": (1 + 4 / INT8_BLOCK) / 4,
                 "zfp": zfp_rate / 32, "onebit": 1 / 32, "onebit-adam": (1 / 8 + 4 / ONEBIT_ADAM_BLOCK) / 4}
    if method not in fractions:
        raise PlanError(f"--compression {method}: the planner models {', '.join(MODELLED)}; the traffic of "
                        f"topk, randomk and powersgd depends on the data and the matrix shapes (measure it: "
                        f"compression_ratio in metrics.jsonl)")
    return fractions[method]


def dp_wire_fraction(method: str, zero: int, zfp_rate: float = 8.0) -> float:
    """Bytes on the wire over the dense dp reduction's (all-reduce, or ZeRO-1's reduce-scatter)."""
    fraction = payload_fraction(method, zfp_rate)
    if method == "onebit-adam" and zero >= 1:  # all-to-all + all-gather in place of a reduce-scatter
        return min(1.0, 2 * fraction)
    return fraction


def warmup_average_step_s(dense_step_s: float, compressed_step_s: float, warmup_steps: int, steps: int) -> float:
    """onebit-adam: a run's mean step time, its first ``warmup_steps`` of ``steps`` dense."""
    if steps <= 0:
        return compressed_step_s
    dense = min(warmup_steps, steps)
    return (dense * dense_step_s + (steps - dense) * compressed_step_s) / steps
