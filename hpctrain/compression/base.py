"""The compressor contract (the methods by name: ``COMPRESSORS`` in ``methods.py``).

A compressor maps a 1-D gradient chunk ``x`` (n elements, float32 or float64) to a uint8 payload of
``payload_nbytes(n)`` bytes (fixed for a given n, so payloads of equal chunks line up in one
all-to-all or all-gather, and a multiple of 8 so any dtype can be viewed inside), and back.
``strategy`` says how ``exchange.py`` sums payloads over a group:

- ``alltoall``: quantizers. Chunk j of every rank goes to rank j (all-to-all), which decompresses and
  sums them in float32 (float64 for float64 grads): a compressed reduce-scatter; then each rank
  compresses its summed chunk again and all-gathers (a compressed all-gather).
- ``allgather``: sparse methods. Every rank's payload goes to every rank, which sums all of them.
- ``shared``: random-k. All ranks pick the SAME indices (a shared seed), so the kept values are
  summed by a plain all-reduce of k numbers.
"""
from __future__ import annotations

import torch


def pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class Compressor:
    name = ""
    strategy = "alltoall"

    def __init__(self, cfg):
        self.cfg = cfg

    def payload_nbytes(self, n: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """(n,) float -> (payload_nbytes(n),) uint8 on x's device."""
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """(payload_nbytes(n),) uint8 -> (n,) ``dtype``."""
        raise NotImplementedError


def frame(parts: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    """Concatenate tensors' raw bytes into one uint8 payload of ``nbytes`` (zero padded)."""
    raw = [p.contiguous().view(torch.uint8).reshape(-1) for p in parts]
    used = sum(r.numel() for r in raw)
    if used < nbytes:
        raw.append(torch.zeros(nbytes - used, dtype=torch.uint8, device=raw[0].device))
    return torch.cat(raw)
