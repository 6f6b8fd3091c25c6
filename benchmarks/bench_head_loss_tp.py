#!/usr/bin/env python
"""The fused LM head + loss under tensor parallelism on the CPU: how it talks over tp.

    mpiexec -n 2 python benchmarks/bench_head_loss_tp.py --tokens 2048 --chunks 256,2048 --repeats 3

Every rank is one tp rank (tp = the world size) holding its slab of a GPT-2-small head (hidden 768,
vocabulary 50257 padded to 128 x tp). Two measurements, printed by rank 0:
- per-call latency of the collectives each variant makes: the training path's all-gather of [4, c] float32
  per chunk of c tokens, and the loss pass's all-reduce of [3, N] (its max all-reduce is smaller);
- ``--repeats`` steps (loss = sum / tokens, backward) per chunk size of the training path (dh and dW
  formed in forward, one all-gather a chunk) against the recomputing one (the loss pass's two all-reduces
  for all chunks, backward recomputing the logits; float16's path): median CPU seconds and range, and the
  tp group's blocked seconds (collective calls including waiting for the slower rank).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from hpctrain.comm.grid import ProcessGrid  # noqa: E402
from hpctrain.parallel.head_loss import _RecomputedHeadCrossEntropy, fused_head_cross_entropy  # noqa: E402
from hpctrain.runtime.launcher import discover  # noqa: E402


def _latency(tp, calls: int, fn) -> float:
    """Median over 5 rounds of the seconds per call of ``fn`` (every rank in step)."""
    rounds = []
    for _ in range(5):
        tp.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--chunks", default="256,2048")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = discover()
    grid = ProcessGrid.build(info, tp=info.size)
    tp = grid.comm("tp")
    chunks = [int(c) for c in args.chunks.split(",")]
    say = print if tp.rank == 0 else (lambda *a, **k: None)
    for c in sorted(set(chunks + [args.tokens])):
        mine, every, rows = torch.randn(4, c), torch.empty(tp.size, 4, c), torch.randn(3, c)
        gather = _latency(tp, 200, lambda: tp.allgather(every, mine))
        reduce = _latency(tp, 200, lambda: tp.allreduce(rows))
        say(f"tp={tp.size} c={c:6}: all-gather [4, c] {gather * 1e6:6.0f} us, all-reduce [3, c] {reduce * 1e6:6.0f} us",
            flush=True)
    local = -(-args.vocab // (128 * tp.size)) * 128
    start = tp.rank * local
    n_valid = max(0, min(args.vocab - start, local))
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(local * tp.size, args.hidden, generator=g) * 0.02)[start:start + local].clone()
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    for chunk in chunks:
        for path in ("recompute", "fused"):
            cpu, blocked = [], []
            for _ in range(args.repeats):
                h.grad = weight.grad = None
                tp.barrier()
                before, begin = grid.stats.by_group().get("tp", (0.0, 0))[0], time.process_time()
                if path == "fused":
                    total = fused_head_cross_entropy(h, weight, targets, tp, start, n_valid, chunk)
                else:
                    total = _RecomputedHeadCrossEntropy.apply(h, weight, targets, tp, start, n_valid, chunk).sum()
                (total / args.tokens).backward()
                cpu.append(time.process_time() - begin)
                blocked.append(grid.stats.by_group().get("tp", (0.0, 0))[0] - before)
            say(f"chunk {chunk:5} {path:9}: CPU s {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}), "
                f"tp blocked s {statistics.median(blocked):.3f} ({min(blocked):.3f}-{max(blocked):.3f}), "
                f"loss {float(total.detach()) / args.tokens:.6f}", flush=True)


if __name__ == "__main__":
    main()
