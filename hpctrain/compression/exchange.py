"""Compressed sums over one group: payloads MPI can move but not add, summed after decompression in the
gradient's dtype (float32 main grads; float64 in float64 runs). Each class launches its first exchange
non-blocking in the constructor (so backward overlaps it) and completes in ``finish``:

- ``AlltoallSum`` (quantizers): compressed reduce-scatter by all-to-all (chunk j of every rank ->
  rank j), then, unless only this rank's chunk is wanted (ZeRO-1), the summed chunk is compressed
  again (with its own error feedback: the "server side" of 1-bit Adam) and all-gathered.
- ``AllgatherSum`` (top-k): every rank's payload to every rank; the sum of all decompressed payloads.
- ``SharedIndexSum`` (random-k): the same k indices on every rank; an all-reduce of k values.

``local`` is what this rank's contribution looks like after compression (for error feedback);
``finish()`` returns the whole sum (n elements) or, with ``slice_only``, this rank's chunk (n / p).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from hpctrain.profiling.timers import NULL_TIMER

if TYPE_CHECKING:
    from hpctrain.comm.handle import Handle


class Stopwatch:
    """Seconds spent compressing and decompressing (metrics.jsonl ``compress_s``); also the
    ``compress`` phase of ``timer`` (a PhaseTimer)."""

    def __init__(self, timer=NULL_TIMER):
        self.seconds, self.timer = 0.0, timer

    def __enter__(self):
        self.timer.begin("compress")
        self._start = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._start
        self.timer.end()


class _InFlight:
    """A reduction whose first exchange (``self.handle``) is in flight."""

    handle: Handle  # started by the subclass's __init__

    def test(self) -> bool:
        return self.handle.test()


class AlltoallSum(_InFlight):
    def __init__(self, comm, compressor, x, *, slice_only, server_memory, server_key, clock, **_):
        self.comm, self.compressor, self.dtype, self.clock = comm, compressor, x.dtype, clock
        self.slice_only, self.memory, self.key = slice_only, server_memory, server_key
        p = comm.size
        self.chunk = x.numel() // p
        with clock:
            self.payload = torch.stack([compressor.compress(piece) for piece in x.view(p, self.chunk)])
            self.local = torch.cat([self._decompress(row) for row in self.payload])
        self.received = torch.empty_like(self.payload)
        self.handle = comm.alltoall(self.received.view(-1), self.payload.view(-1), nonblocking=True)

    def _decompress(self, row):
        return self.compressor.decompress(row, self.chunk, self.dtype)

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        with self.clock:
            partial = torch.zeros(self.chunk, dtype=self.dtype, device=self.payload.device)
            for row in self.received:
                partial += self._decompress(row)
        if self.slice_only:
            return partial
        with self.clock:
            if self.memory is not None:
                partial = self.memory.corrected(self.key, partial)
            mine = self.compressor.compress(partial)
            if self.memory is not None:
                self.memory.remember(self.key, partial, self._decompress(mine))
        gathered = torch.empty((self.comm.size, mine.numel()), dtype=torch.uint8, device=mine.device)
        self.comm.allgather(gathered.view(-1), mine)
        with self.clock:
            return torch.cat([self._decompress(row) for row in gathered])


class AllgatherSum(_InFlight):
    def __init__(self, comm, compressor, x, *, slice_only, clock, **_):
        self.comm, self.compressor, self.n, self.dtype, self.clock = comm, compressor, x.numel(), x.dtype, clock
        self.slice_only = slice_only
        with clock:
            payload = compressor.compress(x)
            self.local = compressor.decompress(payload, self.n, self.dtype)
        self.gathered = torch.empty((comm.size, payload.numel()), dtype=torch.uint8, device=payload.device)
        self.handle = comm.allgather(self.gathered.view(-1), payload, nonblocking=True)

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        with self.clock:
            total = torch.zeros(self.n, dtype=self.dtype, device=self.gathered.device)
            for row in self.gathered:  # the same order on every rank: bitwise-identical sums
                total += self.compressor.decompress(row, self.n, self.dtype)
        return own_block(total, self.comm) if self.slice_only else total


class SharedIndexSum(_InFlight):
    def __init__(self, comm, compressor, x, *, slice_only, key, clock, **_):
        self.comm, self.n, self.slice_only = comm, x.numel(), slice_only
        with clock:
            self.index = compressor.indices(self.n, key, x.device)
            self.values = x[self.index].contiguous()
            self.local = torch.zeros_like(x).index_copy_(0, self.index, self.values)
        self.handle = comm.allreduce(self.values, nonblocking=True)

    def finish(self) -> torch.Tensor:
        self.handle.wait()
        total = torch.zeros(self.n, dtype=self.values.dtype, device=self.values.device)
        total.index_copy_(0, self.index, self.values)
        return own_block(total, self.comm) if self.slice_only else total


def own_block(total: torch.Tensor, comm) -> torch.Tensor:
    """Group rank r's block r of ``total`` (its ZeRO-1 slice): the one place that cuts it."""
    n = total.numel() // comm.size
    return total[comm.rank * n:(comm.rank + 1) * n]


STRATEGIES = {"alltoall": AlltoallSum, "allgather": AllgatherSum, "shared": SharedIndexSum}
