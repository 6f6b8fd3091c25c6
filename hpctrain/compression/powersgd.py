"""PowerSGD (Vogels et al., NeurIPS 2019): a rank-r approximation P Q^T of each gradient matrix M, found by
one step of power iteration warm-started from the previous step's Q, with error feedback.

Per bucket, on the dp group (sums of P and Q are plain all-reduces: they are linear in M):
  M' = M + residual;  P = M' Q;  all-reduce P (with the bucket's dense remainder);  P = orth(P)
  Q = M'^T P;  residual = M' - P Q^T (this rank's, before summing);  all-reduce Q;  M <- P Q^T
Sent per matrix: (m + n) r values instead of m n. Only matrices where that is well below m n
(2 (m + n) r <= m n) and with at least ``min_numel`` elements are compressed; vectors, small matrices
and the bucket's padding go dense in the same all-reduce as P. Q starts as a seeded normal matrix,
identical on every rank of the group. The reduction is blocking (two dependent all-reduces).
"""
from __future__ import annotations

import zlib

import torch

from hpctrain.compression.exchange import own_block
from hpctrain.compression.reducer import CompressedReducer, Done


def compressible(shape, rank: int, min_numel: int) -> bool:
    if len(shape) != 2:
        return False
    m, n = shape
    return 2 * (m + n) * rank <= m * n and m * n >= max(1, min_numel)


class PowerSGDReducer(CompressedReducer):
    def __init__(self, flat, cfg, *, seed: int = 0, node_comms=None):
        super().__init__(flat, cfg, compressor=None, seed=seed, node_comms=node_comms)
        self.q: dict[str, torch.Tensor] = {}
        self._layouts: dict[int, tuple] = {}  # bucket index -> (compressed parameters, dense positions)
        if node_comms:  # PowerSGD's sums are all-reduces; the node split would need P and Q per part
            self.intra, self.inter = None, self.comm

    def _dense_now(self, bucket) -> bool:
        return self.step < self.cfg.warmup_steps or bucket.size < self.cfg.min_numel

    def _layout(self, bucket, device) -> tuple[list, torch.Tensor]:
        """``bucket``'s split, built once: ([(name, lo, hi, shape)] of the parameters PowerSGD compresses,
        relative to the bucket's start; the positions that go dense (small parameters, padding) as an index
        tensor on ``device``: a boolean mask would make the device count its elements for the host, a sync
        on a GPU)."""
        if bucket.index not in self._layouts:
            compressed, dense = [], torch.ones(bucket.size, dtype=torch.bool)
            for p in bucket.params:
                offset, n = self.flat.offset_of(p)
                if compressible(tuple(p.shape), self.cfg.rank, self.cfg.min_numel):
                    lo = offset - bucket.start
                    compressed.append((p.spec.name, lo, lo + n, p.shape))
                    dense[lo:lo + n] = False
            self._layouts[bucket.index] = compressed, dense.nonzero().squeeze(1).to(device)
        return self._layouts[bucket.index]

    def _warm_q(self, name: str, cols: int, dtype, device) -> torch.Tensor:
        if name not in self.q:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            self.q[name] = torch.randn(cols, self.cfg.rank, generator=generator, dtype=dtype).to(device)
        elif self.q[name].dim() == 1:  # restored from a checkpoint (stored flat)
            self.q[name] = self.q[name].view(cols, self.cfg.rank)
        return self.q[name]

    def _start(self, bucket):
        if self._dense_now(bucket):
            self._running[bucket.index] = None
            return self.dense._start(bucket)
        flat, comm = self.flat, self.comm
        grads = self.grads(bucket)
        self.note_nonfinite(grads)
        compressed, dense = self._layout(bucket, grads.device)
        matrices = [(name, grads[lo:hi].view(shape)) for name, lo, hi, shape in compressed]
        with self.clock:
            corrected = [(name, self._corrected(name, m)) for name, m in matrices]
            ps = [m @ self._warm_q(name, m.shape[1], m.dtype, m.device) for name, m in corrected]
            first = torch.cat([p.reshape(-1) for p in ps] + [grads.index_select(0, dense)])
        comm.allreduce(first)
        with self.clock:
            offset, qs = 0, []
            for (name, m), p in zip(corrected, ps):
                p = torch.linalg.qr(first[offset:offset + p.numel()].view_as(p)).Q
                offset += p.numel()
                q = m.t() @ p
                if self.memory is not None:
                    self.memory.remember(f"residual/{name}", m, p @ q.t())
                qs.append((name, p, q))
            grads.index_copy_(0, dense, first[offset:])
            second = torch.cat([q.reshape(-1) for _, _, q in qs]) if qs else None
        if second is not None:
            comm.allreduce(second)
        with self.clock:
            offset = 0
            for (name, p, q), (_, target) in zip(qs, matrices):
                assert second is not None  # qs is not empty
                q = second[offset:offset + q.numel()].view_as(q)
                offset += q.numel()
                self.q[name] = q.clone()
                target.copy_(p @ q.t())
        if flat.zero:
            bucket.slice_grad.copy_(own_block(grads, comm))
        self._running[bucket.index] = "done"
        return Done()

    def _corrected(self, name, m):
        return self.memory.corrected(f"residual/{name}", m) if self.memory is not None else m

    def _finish(self, bucket) -> None:
        if self._running.pop(bucket.index) is None:
            self.dense._finish(bucket)

    def state_dict(self):
        state = super().state_dict()
        state.update({f"q/{name}": q for name, q in self.q.items()})
        return state

    def load_state_dict(self, state):
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith("q/")})
        self.q = {k[2:]: v.to(self.flat.device) for k, v in state.items() if k.startswith("q/")}

    def signature(self) -> dict:
        return {**super().signature(), "rank": self.cfg.rank, "min_numel": self.cfg.min_numel}
