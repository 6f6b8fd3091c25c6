"""Quantizers (strategy ``alltoall``): fp16 / bf16 casts, int8 with a scale per 256 values, and
1-bit (sign + one scale per chunk, after Seide et al. 2014 and DeepSpeed's 1-bit Adam).

Bytes per value: fp16/bf16 2, int8 1 + 4/256, onebit 1/8 (+ 8 bytes per chunk).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.compression.base import Compressor, frame, pad8

INT8_BLOCK = 256


class _Cast(Compressor):
    wire_dtype = torch.float16

    def payload_nbytes(self, n, dtype):
        return pad8(2 * n)

    def compress(self, x):
        return frame([x.to(self.wire_dtype)], self.payload_nbytes(x.numel(), x.dtype))

    def decompress(self, payload, n, dtype):
        return payload[:2 * n].view(self.wire_dtype).to(dtype)


class Fp16(_Cast):
    """IEEE half: 10-bit mantissa, overflows above 65504 (a float16 run's loss scaler then skips the step)."""
    name, wire_dtype = "fp16", torch.float16


class Bf16(_Cast):
    """bfloat16: float32's range, 7-bit mantissa."""
    name, wire_dtype = "bf16", torch.bfloat16


class Int8(Compressor):
    """Symmetric int8, one float32 scale (max |x| / 127) per block of 256 values; round to nearest."""
    name = "int8"

    def payload_nbytes(self, n, dtype):
        return pad8(4 * -(-n // INT8_BLOCK) + n)

    def compress(self, x):
        n, blocks = x.numel(), -(-x.numel() // INT8_BLOCK)
        xb = F.pad(x, (0, blocks * INT8_BLOCK - n)).view(blocks, INT8_BLOCK)
        scale = (xb.abs().amax(dim=1) / 127).to(torch.float32)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(xb / scale[:, None].to(x.dtype)).clamp(-127, 127).to(torch.int8).reshape(-1)[:n]
        return frame([scale, q], self.payload_nbytes(n, x.dtype))

    def decompress(self, payload, n, dtype):
        blocks = -(-n // INT8_BLOCK)
        scale = payload[:4 * blocks].view(torch.float32).to(dtype)
        q = payload[4 * blocks:4 * blocks + n].view(torch.int8).to(dtype)
        return (F.pad(q, (0, blocks * INT8_BLOCK - n)).view(blocks, INT8_BLOCK) * scale[:, None]).reshape(-1)[:n]


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[n] -> [ceil(n / 8)] uint8: bit i of byte j is ``x[8 j + i] >= 0`` (little-endian bit order, the tail
    padded with 0). Host tensors go through numpy's packbits (one pass; the torch form below is 3-4x slower on a
    CPU), device tensors through torch ops on the device; the bytes are the same."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.packbits((x >= 0).numpy(), bitorder="little"))
    bits = F.pad((x >= 0).to(torch.uint8), (0, -x.numel() % 8)).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``pack_signs``'s inverse as +1 / -1 values: [ceil(n / 8)] uint8 -> [n] of ``dtype`` (a new tensor)."""
    if packed.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little"))
    else:
        bits = ((packed[:, None] & _BIT_WEIGHTS.to(packed.device)) > 0).reshape(-1)[:n]
    return bits.to(dtype).mul_(2).sub_(1)


class OneBit(Compressor):
    """Sign bits (x >= 0 -> +1) packed 8 per byte, times one scale per chunk: mean |x|, which
    minimises the L2 error of sign(x) * s. Only useful with error feedback."""
    name = "onebit"

    def payload_nbytes(self, n, dtype):
        return pad8(8 + -(-n // 8))

    def compress(self, x):
        n = x.numel()
        scale = x.abs().mean().to(torch.float64).reshape(1) if n else torch.zeros(1, dtype=torch.float64)
        return frame([scale.to(x.device), pack_signs(x)], self.payload_nbytes(n, x.dtype))

    def decompress(self, payload, n, dtype):
        scale = payload[:8].view(torch.float64).to(dtype)
        return unpack_signs(payload[8:8 + -(-n // 8)], n, dtype).mul_(scale)


ONEBIT_BLOCK = 2048


class BlockOneBit(Compressor):
    """Sign bits packed 8 per byte, times one float32 scale (mean |x|) per block of ``ONEBIT_BLOCK`` values:
    1 + 32 / 2048 bits per value. The momentum compressor of onebit-adam (a bucket mixes parameters whose
    momenta differ by orders of magnitude; a scale per chunk would drown the small ones)."""
    name = "onebit-blocks"

    def payload_nbytes(self, n, dtype):
        return pad8(4 * -(-n // ONEBIT_BLOCK) + -(-n // 8))

    def compress(self, x):
        n, blocks = x.numel(), -(-x.numel() // ONEBIT_BLOCK)
        magnitude, full = x.abs(), n // ONEBIT_BLOCK  # blocks' sums without a padded copy
        sums = torch.empty(blocks, dtype=x.dtype, device=x.device)
        torch.sum(magnitude[:full * ONEBIT_BLOCK].view(full, ONEBIT_BLOCK), dim=1, out=sums[:full])
        if blocks > full:
            sums[full] = magnitude[full * ONEBIT_BLOCK:].sum()
        counts = torch.full((blocks,), ONEBIT_BLOCK, dtype=x.dtype, device=x.device)
        counts[-1] = n - (blocks - 1) * ONEBIT_BLOCK
        scale = (sums / counts).to(torch.float32)
        return frame([scale, pack_signs(x)], self.payload_nbytes(n, x.dtype))

    def decompress(self, payload, n, dtype):
        blocks, full = -(-n // ONEBIT_BLOCK), n // ONEBIT_BLOCK
        scale = payload[:4 * blocks].view(torch.float32).to(dtype)
        values = unpack_signs(payload[4 * blocks:4 * blocks + -(-n // 8)], n, dtype)
        values[:full * ONEBIT_BLOCK].view(full, ONEBIT_BLOCK).mul_(scale[:full, None])  # in place, no expanded scale
        if blocks > full:
            values[full * ONEBIT_BLOCK:].mul_(scale[full])
        return values
