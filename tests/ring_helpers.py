"""Shared by the ring attention tests: the single-process reference and a cp group of threads.

``reference_attention``: plain causal (sliding-window) GQA attention over a whole sequence, what ring
attention must equal. ``ThreadRing``: a cp group of threads in one process whose ``exchange`` behaves as
ring attention uses it (sends queued, receives waited), recording every rank's posts. ``ring_of_threads``
runs ring attention forward and backward on such a ring and returns the merged global results.
"""
import collections
import queue
import threading

import torch

from hpctrain.parallel.context_parallel import ring_attention, zigzag_merge, zigzag_split


def reference_attention(q, k, v, window=0):
    """Plain causal (sliding-window) GQA attention over the whole sequence: [B, H, S, Dh]."""
    group, seq = q.shape[1] // k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    ones = torch.ones(seq, seq, dtype=torch.bool)
    allowed = ones.tril() & ~ones.tril(-window) if window else ones.tril()
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


class ThreadRing:
    """A cp group of threads in one process: ``exchange`` as ring attention uses it (sends are queued,
    receives wait), enough to run the ring's plan and arithmetic without MPI."""

    def __init__(self, rank, size, queues, posts=None):
        self.rank, self.size, self.queues = rank, size, queues
        self.posts = [] if posts is None else posts  # the plan as issued: [[("send" | "recv", peer, tag)]]

    def exchange(self, sends=(), recvs=()):
        self.posts.append([("send", dst, tag) for _, dst, tag in sends] + [("recv", src, tag) for _, src, tag in recvs])
        for tensor, dst, tag in sends:
            self.queues[(self.rank, dst, tag)].put(tensor.clone())
        return _Received(self, recvs)


class _Received:
    def __init__(self, ring, recvs):
        self.ring, self.recvs = ring, recvs

    def test(self):
        return False

    def wait(self):
        for tensor, src, tag in self.recvs:
            tensor.copy_(self.ring.queues[(src, self.ring.rank, tag)].get(timeout=30))


def ring_of_threads(q, k, v, grad, cp, plans=None, **kwargs):
    """Ring attention of global q [B, Hq, S, Dh], k, v [B, Hkv, S, Dh] on cp threads (each its zig-zag
    chunks), backward with output gradient ``grad``; ``kwargs`` go to ``ring_attention``; ``plans``: a list
    of cp lists receiving each rank's posts. Returns the global [out, dq, dk, dv] (zig-zag merged); asserts
    every rank finished and every message was received."""
    queues, results = collections.defaultdict(queue.Queue), [None] * cp
    plans = plans if plans is not None else [[] for _ in range(cp)]

    def rank_main(rank):
        local = [zigzag_split(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, ThreadRing(rank, cp, queues, plans[rank]), **kwargs)
        results[rank] = [out.detach()] + list(torch.autograd.grad((out * zigzag_split(grad, rank, cp, dim=2)).sum(),
                                                                  local))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results), "a rank of the ring failed"
    assert all(q.empty() for q in queues.values())  # every message received
    return [zigzag_merge(list(parts), dim=2) for parts in zip(*results)]
