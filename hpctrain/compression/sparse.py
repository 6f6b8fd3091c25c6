"""Sparsifiers: top-k (largest |x|; strategy ``allgather``: indices + values from every rank) and
random-k (strategy ``shared``: every rank keeps the same k random indices, so the values are summed
by a plain all-reduce of k numbers and no indices travel). Both need error feedback to converge at
low density (Stich et al., 2018).
"""
from __future__ import annotations

import math

import torch

from hpctrain.compression.base import Compressor, frame, pad8


def kept(n: int, density: float) -> int:
    return max(1, min(n, math.ceil(density * n)))


class TopK(Compressor):
    """Payload: k int32 indices, then k values in the gradient's dtype."""
    name, strategy = "topk", "allgather"

    def payload_nbytes(self, n, dtype):
        k = kept(n, self.cfg.density)
        return pad8(4 * k + k * torch.empty((), dtype=dtype).element_size())

    def compress(self, x):
        k = kept(x.numel(), self.cfg.density)
        index = torch.topk(x.abs(), k, sorted=False).indices
        return frame([index.to(torch.int32), x[index]], self.payload_nbytes(x.numel(), x.dtype))

    def decompress(self, payload, n, dtype):
        k = kept(n, self.cfg.density)
        index = payload[:4 * k].view(torch.int32).to(torch.int64)
        size = torch.empty((), dtype=dtype).element_size()
        values = payload[4 * k:4 * k + size * k].view(dtype)
        return torch.zeros(n, dtype=dtype, device=payload.device).index_put_((index,), values, accumulate=True)


class RandomK(Compressor):
    """k = density * n indices drawn without replacement from a generator seeded by (train.seed,
    step, bucket): identical on every rank of the group, different every step."""
    name, strategy = "randomk", "shared"

    def indices(self, n: int, key: tuple[int, ...], device) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF)
        return torch.randperm(n, generator=generator)[:kept(n, self.cfg.density)].sort().values.to(device)

    def payload_nbytes(self, n, dtype):  # values only
        return pad8(kept(n, self.cfg.density) * torch.empty((), dtype=dtype).element_size())
