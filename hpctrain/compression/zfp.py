"""ZFP fixed-rate lossy compression (Lindstrom 2014) through the ``zfpy`` package: ``zfp_rate`` bits
per value, blocks of 4 values coded with a shared exponent; the compressor of the OSU hybrid
compression study (arXiv 2409.02423). Strategy ``alltoall``. zfpy works on host numpy arrays: CUDA
chunks are copied to the host and back (a cost the benchmark shows).
"""
from __future__ import annotations

import numpy as np
import torch

from hpctrain.compression.base import Compressor, frame, pad8
from hpctrain.errors import HpcTrainError


def _zfpy():
    try:
        import zfpy
    except ImportError:
        raise HpcTrainError("compression.method='zfp' needs the zfpy package: pip install zfpy "
                            "(a manylinux wheel; it is in the project's 'compression' extra)") from None
    return zfpy


class Zfp(Compressor):
    """Payload: 8 bytes holding the stream length, then zfpy's stream (header + fixed-rate blocks)."""
    name = "zfp"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.zfpy = _zfpy()
        self._sizes: dict[tuple[int, str], int] = {}

    def _stream_bytes(self, n: int, dtype: torch.dtype) -> int:
        key = (n, str(dtype))
        if key not in self._sizes:  # fixed rate: the stream length depends on n and the type only
            probe = np.zeros(n, dtype=np.float64 if dtype == torch.float64 else np.float32)
            self._sizes[key] = len(self.zfpy.compress_numpy(probe, rate=self.cfg.zfp_rate))
        return self._sizes[key]

    def payload_nbytes(self, n, dtype):
        return pad8(8 + self._stream_bytes(n, dtype))

    def compress(self, x):
        host = x.detach().to("cpu").numpy()
        stream = self.zfpy.compress_numpy(np.ascontiguousarray(host), rate=self.cfg.zfp_rate)
        length = torch.tensor([len(stream)], dtype=torch.int64)
        body = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        return frame([length, body], self.payload_nbytes(x.numel(), x.dtype)).to(x.device)

    def decompress(self, payload, n, dtype):
        host = payload.to("cpu")
        length = int(host[:8].view(torch.int64).item())
        values = self.zfpy.decompress_numpy(host[8:8 + length].numpy().tobytes())
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(-1)[:n].to(dtype).to(payload.device)
