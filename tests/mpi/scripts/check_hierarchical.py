"""comm.intra_node's hierarchical route (hpctrain/comm/hierarchical.py) on a world spanning nodes, dp = world.

``collectives``: allreduce / reduce_scatter / allgather (in place too, non-blocking too) of random float32 /
float64 data, odd lengths and lengths that go in several chunks: bit-identical on every rank, equal to the
inputs summed in the scheme's order (each node's ranks in local order, then the node sums in node order:
exact at 2 nodes, where MPI's a + b == b + a), repeatable call to call; each call is ONE watched collective
on 'dp', none on 'dp-inter'/'dp-intra'; int64 and "max" stay on MPI and are right.
``uneven``: nodes holding different numbers of dp ranks: "shm" refuses (IntraNodeError, every rank),
"auto" falls back to MPI with one line on rank 0.
``stop``: ``collectives``, then the last rank stops itself (SIGSTOP) before its 3rd allreduce: the watchdog
names it, inside allreduce #k on 'dp'.
"""
import os
import signal
import sys

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.intra_node import IntraNodeError
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info)  # dp = world; timeout from HPCTRAIN_COMM_TIMEOUT
world, dp = grid.world, grid.comm("dp")
mode = sys.argv[1]

if mode == "uneven":
    try:
        grid.use_intra_node("shm")
        print(f"rank {world.rank}: shm accepted ({grid.intra_node})", flush=True)
    except IntraNodeError as e:
        print(f"rank {world.rank}: refused: {e}", flush=True)
    assert grid.use_intra_node("auto") == "mpi" and dp.shm is None
    x = torch.full((1001,), float(world.rank + 1), dtype=torch.float64)
    dp.allreduce(x)
    assert torch.equal(x, torch.full_like(x, sum(range(1, world.size + 1))))
    grid.close()
    print(f"rank {world.rank}: UNEVEN OK", flush=True)
    sys.exit(0)

route = grid.use_intra_node("shm")
print(f"rank {world.rank}: dp reduction {route}", flush=True)
assert route == "shm-hierarchical" and dp.shm is not None, route
nodes = sorted({info.node_of_rank[m] for m in dp.members})
node_of = [nodes.index(info.node_of_rank[m]) for m in dp.members]  # node index of every dp rank
G, N = dp.size, len(nodes)
L = G // N
assert node_of == [g // L for g in range(G)], node_of  # node-major


def everyone(t: torch.Tensor) -> torch.Tensor:
    """[G, numel]: every dp rank's ``t`` (through MPI: the route does not carry int views)."""
    out = torch.empty(G * t.numel(), dtype=t.dtype)
    dp.mpi.Allgather(t.numpy(), out.numpy())
    return out.view(G, -1)


def scheme_sum(inputs: torch.Tensor) -> torch.Tensor:
    """[G, n] -> [n]: each node's rows in local order, then the node sums in node order."""
    node_sums = []
    for n in range(N):
        s = inputs[n * L] + inputs[n * L + 1]
        for j in range(2, L):
            s = s + inputs[n * L + j]
        node_sums.append(s)
    total = node_sums[0]
    for s in node_sums[1:]:
        total = total + s
    return total


def same_everywhere(t: torch.Tensor, what) -> None:
    rows = everyone(t)
    for g in range(G):
        assert torch.equal(rows[g], rows[0]), ("not bit-identical on every rank", what, g)


gen = torch.Generator().manual_seed(97 + dp.rank)
calls = {op: grid.stats.ops[("dp", op)].calls for op in ("allreduce", "reduce_scatter", "allgather")}
seq = dp.seq
made = 0
for dtype in (torch.float64, torch.float32):
    for m in (1, 7, 1001, 70001):  # per block; 70001: every op in several 1 MiB chunks (float64)
        x = torch.randn(G * m, generator=gen, dtype=torch.float64).to(dtype)
        inputs = everyone(x)
        reference = scheme_sum(inputs)
        results = []
        for nonblocking in (False, True):
            y = x.clone()
            handle = dp.allreduce(y, nonblocking=nonblocking)
            if handle is not None:
                handle.wait()
            results.append(y)
        assert torch.equal(results[0], results[1]), ("allreduce not repeatable", dtype, m)
        assert torch.equal(results[0], reference), ("allreduce != scheme order", dtype, m,
                                                    (results[0] - reference).abs().max())
        if N == 2 and dtype == torch.float64:  # not a tautology: another order differs somewhere
            assert torch.allclose(results[0], inputs.sum(0), rtol=1e-12, atol=1e-12)
        same_everywhere(results[0], ("allreduce", dtype, m))

        out = torch.empty(m, dtype=dtype)
        dp.reduce_scatter(out, x)
        assert torch.equal(out, reference.view(G, m)[dp.rank]), ("reduce_scatter", dtype, m)

        mine = torch.randn(m, generator=gen, dtype=torch.float64).to(dtype)
        gathered = torch.empty(G * m, dtype=dtype)
        dp.allgather(gathered, mine)
        assert torch.equal(gathered.view(G, m), everyone(mine)), ("allgather", dtype, m)
        in_place = torch.zeros(G * m, dtype=dtype)
        in_place.view(G, m)[dp.rank] = mine
        dp.allgather(in_place, nonblocking=True).wait()
        assert torch.equal(in_place, gathered), ("allgather in place", dtype, m)
        made += 1
# one watched collective on dp per call: the inner MPI calls on dp-inter are not registered
assert grid.stats.ops[("dp", "allreduce")].calls - calls["allreduce"] == 2 * made
assert grid.stats.ops[("dp", "allgather")].calls - calls["allgather"] == 2 * made
assert dp.seq - seq == 5 * made, (dp.seq, seq, made)
extra = {c.name: c.seq for c in grid.communicators() if c.name in ("dp-intra", "dp-inter")}
assert extra == {"dp-intra": 0, "dp-inter": 0}, extra
assert not grid.watchdog.inflight()

# what the route does not take stays on MPI, and is right
ints = torch.arange(1001, dtype=torch.int64) + dp.rank
dp.allreduce(ints)
assert torch.equal(ints, G * torch.arange(1001, dtype=torch.int64) + sum(range(G)))
peak = torch.full((5,), float(dp.rank))
dp.allreduce(peak, op="max")
assert torch.equal(peak, torch.full((5,), float(G - 1)))

if mode == "stop":  # after the checks above (one launch for both)
    print(f"rank {world.rank}: HIERARCHICAL OK {made} shapes", flush=True)
    for i in range(3):
        if dp.rank == G - 1 and i == 2:
            print(f"rank {world.rank} stops itself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        dp.allreduce(torch.ones(1000, dtype=torch.float64))
    print("not detected", flush=True)
    sys.exit(0)

grid.close()
print(f"rank {world.rank}: HIERARCHICAL OK {made} shapes", flush=True)
