#!/usr/bin/env python
"""Ring attention (context parallelism): one attention layer's forward + backward on cp = the world size,
full causal against sliding windows; the blocks a window skips and the time it saves.

    mpiexec -n 2 python benchmarks/bench_ring_attention.py --seq 8192 --windows 0,512,2048 --json ring.json

Every rank holds its S/cp zig-zag tokens of q [B, Hq, S/cp, Dh] and k, v [B, Hkv, S/cp, Dh] (float32, random)
and runs ``ring_attention`` forward and backward (hpctrain/parallel/context_parallel.py), the K/V blocks
travelling around the ring while it computes.

Method (as benchmarks/bench_pipeline.py): ``--warmup`` untimed steps of each window, then ``--rounds`` rounds
of ``--steps`` timed steps of every window in turn, the order rotated each round; a step is timed from a
barrier to its end, the max over ranks; reported: the median and min. ``blocks`` are the query chunk x key
chunk blocks computed per step, summed over ranks, forward + backward (``skipped``: the rest);
``exchange_wait_ms``: time per step blocked waiting for the ring's exchanges (mean over ranks): what the
computation did not hide. One thread per rank (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.bench.report import run_benchmark, timed_rounds, write_records  # noqa: E402
from hpctrain.comm.grid import ProcessGrid  # noqa: E402
from hpctrain.parallel.context_parallel import RingStats, ring_attention  # noqa: E402
from hpctrain.runtime.launcher import discover  # noqa: E402

FIELDS = ["cp", "seq", "heads", "kv_heads", "head_dim", "tile", "window", "blocks", "skipped", "step_ms", "step_ms_min",
          "exchange_wait_ms"]


class RingStep:
    """One timed step: forward + backward of ring attention with ``window``."""

    def __init__(self, ring, args, window: int):
        self.ring, self.window, self.tile, self.name = ring, window, args.tile, f"window={window}"
        gen = torch.Generator().manual_seed(ring.rank)
        local = args.seq // ring.size
        self.inputs = [torch.randn(args.batch, h, local, args.head_dim, generator=gen).requires_grad_()
                       for h in (args.heads, args.kv_heads, args.kv_heads)]
        self.grad = torch.randn(args.batch, args.heads, local, args.head_dim, generator=gen)
        self.stats, self.wait_s = RingStats(), 0.0

    def step(self) -> None:
        counter = self.ring.stats.ops[(self.ring.name, "exchange")]
        waited = counter.seconds
        out = ring_attention(*self.inputs, self.ring, window=self.window, stats=self.stats, tile=self.tile)
        torch.autograd.grad(out, self.inputs, self.grad)
        self.wait_s += counter.seconds - waited


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--windows", default="0,512,2048", help="comma-separated; 0 = full causal")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tile", type=int, default=1024, help="longest query / key run of a block (0 = whole chunks)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--csv")
    args = ap.parse_args()
    grid = ProcessGrid.build(discover())
    ring, world = grid.world, MPI.COMM_WORLD
    impls = [RingStep(ring, args, int(w)) for w in args.windows.split(",")]
    for impl in impls:
        for _ in range(args.warmup):
            impl.step()
        impl.stats, impl.wait_s = RingStats(), 0.0
    times = timed_rounds(impls, args.rounds, args.steps, world, activate=lambda impl, on: None)
    records = []
    for impl in impls:
        steps = args.rounds * args.steps
        record = dict(cp=ring.size, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                      tile=args.tile, window=impl.window, blocks=world.allreduce(impl.stats.computed) // steps,
                      skipped=world.allreduce(impl.stats.skipped) // steps,
                      step_ms=1e3 * statistics.median(times[impl.name]), step_ms_min=1e3 * min(times[impl.name]),
                      exchange_wait_ms=1e3 * world.allreduce(impl.wait_s) / ring.size / steps)
        records.append(record)
        if ring.rank == 0:
            print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                  flush=True)
    if ring.rank == 0:
        write_records(records, args.json, args.csv, FIELDS)
    grid.close()
    return 0


if __name__ == "__main__":
    run_benchmark(main)
