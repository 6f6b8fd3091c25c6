"""Quantizers (strategy ``alltoall``): fp16 / bf16 casts, int8 with a scale per 256 values, and
1-bit (sign + one scale per chunk, after Seide et al. 2014 and DeepSpeed's 1-bit Adam).

Bytes per value: fp16/bf16 2, int8 1 + 4/256, onebit 1/8 (+ 8 bytes per chunk).
"""
from __future__ import annotations

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


class OneBit(Compressor):
    """Sign bits (x >= 0 -> +1) packed 8 per byte, times one scale per chunk: mean |x|, which
    minimises the L2 error of sign(x) * s. Only useful with error feedback."""
    name = "onebit"

    def payload_nbytes(self, n, dtype):
        return pad8(8 + -(-n // 8))

    def compress(self, x):
        n = x.numel()
        scale = x.abs().mean().to(torch.float64).reshape(1) if n else torch.zeros(1, dtype=torch.float64)
        bits = F.pad((x >= 0).to(torch.uint8), (0, -n % 8)).view(-1, 8)
        packed = (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)
        return frame([scale.to(x.device), packed], self.payload_nbytes(n, x.dtype))

    def decompress(self, payload, n, dtype):
        scale = payload[:8].view(torch.float64).to(dtype)
        packed = payload[8:8 + -(-n // 8)]
        bits = (packed[:, None] & _BIT_WEIGHTS.to(payload.device)) > 0
        signs = bits.reshape(-1)[:n].to(dtype) * 2 - 1
        return signs * scale


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
        xb = F.pad(x.abs(), (0, blocks * ONEBIT_BLOCK - n)).view(blocks, ONEBIT_BLOCK)
        counts = torch.full((blocks,), ONEBIT_BLOCK, dtype=x.dtype, device=x.device)
        counts[-1] = n - (blocks - 1) * ONEBIT_BLOCK
        scale = (xb.sum(dim=1) / counts).to(torch.float32)
        bits = F.pad((x >= 0).to(torch.uint8), (0, -n % 8)).view(-1, 8)
        packed = (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)
        return frame([scale, packed], self.payload_nbytes(n, x.dtype))

    def decompress(self, payload, n, dtype):
        blocks = -(-n // ONEBIT_BLOCK)
        scale = payload[:4 * blocks].view(torch.float32).to(dtype)
        packed = payload[4 * blocks:4 * blocks + -(-n // 8)]
        bits = (packed[:, None] & _BIT_WEIGHTS.to(payload.device)) > 0
        signs = bits.reshape(-1)[:n].to(dtype) * 2 - 1
        return signs * scale.repeat_interleave(ONEBIT_BLOCK)[:n]
