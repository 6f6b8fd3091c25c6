"""Ring attention (hpctrain/parallel/context_parallel.py) on real ranks: the world is the cp group.

``check``: for full causal, GQA and sliding windows, every rank draws the same global q, k, v and output
gradient (same seed), takes its zig-zag chunks, runs ring attention forward and backward, and the
gathered out, dq, dk, dv must equal single-process attention over the whole sequence (float64, relative
1e-10; bfloat16 inputs within bfloat16 rounding), in blocks of whole chunks or of tiles. A window must
compute fewer blocks than full causal; each call makes 3cp-2 ring exchanges and leaves nothing in flight.
``stop``: rank 1 stops itself (SIGSTOP) before its second ring attention call, while the others are
inside the ring: the watchdog must report the stalled exchange and name rank 1.
"""
import os
import signal
import sys
from pathlib import Path

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.parallel.context_parallel import RingStats, ring_attention, zigzag_merge, zigzag_split
from hpctrain.runtime.launcher import discover

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared reference
from ring_helpers import reference_attention  # noqa: E402

grid = ProcessGrid.build(discover())  # timeout from HPCTRAIN_COMM_TIMEOUT
ring = grid.world
cp, rank = ring.size, ring.rank
CHUNK, BATCH, DIM = 4, 2, 8
SEQ = 2 * cp * CHUNK


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def inputs(heads, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, heads, SEQ, DIM), (BATCH, kv_heads, SEQ, DIM), (BATCH, kv_heads, SEQ, DIM),
              (BATCH, heads, SEQ, DIM)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


def ring_pass(q, k, v, grad, window, dtype=torch.float64, tile=0):
    """This rank's (out, dq, dk, dv) of ring attention on its zig-zag chunks, and the block counts."""
    local = [zigzag_split(t, rank, cp, dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*local, ring, window=window, stats=stats, tile=tile)
    grads = torch.autograd.grad((out * zigzag_split(grad, rank, cp, dim=2).to(dtype)).sum(), local)
    return [out.detach()] + list(grads), stats


def check(heads, kv_heads, window, dtype=torch.float64, rtol=1e-10, tile=0):
    q, k, v, grad = inputs(heads, kv_heads, seed=100 * heads + 10 * kv_heads + window)
    calls = ring.stats.ops[("world", "exchange")].calls
    results, stats = ring_pass(q, k, v, grad, window, dtype, tile)
    assert ring.stats.ops[("world", "exchange")].calls - calls == 3 * cp - 2  # forward cp-1, backward 2cp-1
    assert not grid.watchdog.inflight()
    full = [t.requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, window)
    want = [expected.detach()] + list(torch.autograd.grad((expected * grad).sum(), full))
    gathered = ring.allgather_object([t.double() for t in results])  # every rank's local parts, cp rank order
    for name, mine, parts, ref in zip(("out", "dq", "dk", "dv"), results, zip(*gathered), want):
        err = rel_err(zigzag_merge(list(parts), dim=2), ref)
        assert err < rtol, f"cp={cp} {heads}/{kv_heads} heads, window {window}, tile {tile}, {dtype}: {name} {err:.2e}"
        assert rel_err(mine.double(), zigzag_split(ref, rank, cp, dim=2)) < rtol  # this rank's own part
    return sum(ring.allgather_object(stats.computed)), sum(ring.allgather_object(stats.skipped))


if sys.argv[1] == "stop":
    q, k, v, grad = inputs(2, 2, seed=7)
    for i in range(2):
        if rank == 1 and i == 1:
            print(f"rank 1 stops itself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        ring_pass(q, k, v, grad, window=0)
    print("not detected", flush=True)
    sys.exit(0)

window = 6  # 1.5 chunks: some blocks partly inside, far ones skipped
full_causal = check(2, 2, 0)
assert full_causal == (2 * 2 * cp * (2 * cp + 1) // 2, 2 * (4 * cp * cp - 2 * cp * (2 * cp + 1) // 2)), full_causal
check(4, 2, 0)  # GQA
windowed = check(2, 2, window)
check(4, 2, 3)  # GQA with a window shorter than a chunk
check(4, 2, window, tile=3)  # chunks of 4 in tiles of 3 + 1
assert windowed[0] < full_causal[0] and windowed[1] > full_causal[1], (windowed, full_causal)
check(4, 2, window, dtype=torch.bfloat16, rtol=2e-2)  # fp32 statistics, bfloat16 in and out
grid.close()
if rank == 0:
    print(f"ring attention ok on {cp} ranks: blocks computed (forward + backward) full causal {full_causal[0]}, "
          f"window {window} of {SEQ} tokens {windowed[0]} ({windowed[1]} skipped)", flush=True)
