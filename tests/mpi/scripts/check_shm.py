"""Shared-memory collectives (hpctrain/comm/shm.py) against MPI's on the world group of one node.

``check``: integer-valued float64/float32 data, sizes that the group does not divide, chunking
(capacity smaller than the tensors), repeated calls (buffer reuse) -> equal to MPI's results; random
data -> bit-identical on every rank, equal to a float64 reference within rounding.
``stop``: rank 1 stops itself (SIGSTOP) before its 3rd shm allreduce; ``stop-inside``: after the first
barrier of it (between the reduction and the gather); the watchdog must report it either way.
``stop-route PROGRESS``: the same through a ``Communicator`` given comm.intra_node's ``ShmRoute`` (non-blocking
calls; PROGRESS = comm.shm_progress: run in the call or on the route's worker thread).
``refuse``: ranks on different nodes are refused with one line.
"""
import os
import signal
import sys

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.shm import ShmCollectives
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info)  # timeout from HPCTRAIN_COMM_TIMEOUT
world = grid.world
n, r = world.size, world.rank
mode = sys.argv[1]

if mode == "refuse":  # the group spans (emulated) nodes: one line, every rank, nothing left allocated
    from hpctrain.comm.shm import ShmUnavailable
    try:
        ShmCollectives(world)
    except ShmUnavailable as e:
        print(f"rank {r}: refused: {e}", flush=True)
    grid.close()
    sys.exit(0)

if mode == "stop-route":  # a Communicator with comm.intra_node's route: its non-blocking calls are watched too
    from hpctrain.comm.intra_node import route_intra_node
    progress = sys.argv[2]  # comm.shm_progress: "call" or "thread" (the calls run on a worker thread)
    assert route_intra_node(world, world, "shm", progress=progress).kind == "shm" and world.shm.when == progress
    for i in range(3):
        if r == 1 and i == 2:
            print(f"rank 1 stops itself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        world.allreduce(torch.ones(1000), nonblocking=True).wait()
    print("not detected", flush=True)
    sys.exit(0)

if mode.startswith("stop"):
    shm = ShmCollectives(world, capacity_bytes=4096)
    syncs = []

    def stop_here():
        print(f"rank 1 stops itself (pid {os.getpid()})", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    if mode == "stop-inside" and r == 1:
        sync = shm._sync

        def sync_then_stop():  # the 5th barrier: the first of the 3rd allreduce (two per call)
            sync()
            syncs.append(1)
            if len(syncs) == 5:
                stop_here()
        shm._sync = sync_then_stop
    for i in range(3):
        if mode == "stop" and r == 1 and i == 2:
            stop_here()
        shm.allreduce(torch.ones(1000))
    print("not detected", flush=True)
    sys.exit(0)

barrier = sys.argv[2] if len(sys.argv) > 2 else "flags"
shm = ShmCollectives(world, capacity_bytes=1000, barrier=barrier)  # small: 8000-byte tensors go in portions
gen = torch.Generator().manual_seed(1234 + r)
for dtype in (torch.float64, torch.float32):
    for m in (1, 7, 125, 1001, 3000):  # elements per block / per tensor; odd, not divisible by n
        for repeat in range(3):
            ints = torch.randint(-1000, 1000, (m * n,), generator=gen).to(dtype)
            ref = ints.clone()
            world.allreduce(ref)
            got = ints.clone()
            shm.allreduce(got)
            assert torch.equal(got, ref), ("allreduce", dtype, m)

            out, ref_out = torch.empty(m, dtype=dtype), torch.empty(m, dtype=dtype)
            world.reduce_scatter(ref_out, ints.clone())
            shm.reduce_scatter(out, ints)
            assert torch.equal(out, ref_out), ("reduce_scatter", dtype, m)

            part = ints[:m].clone()
            gathered, ref_gathered = torch.empty(m * n, dtype=dtype), torch.empty(m * n, dtype=dtype)
            world.allgather(ref_gathered, part)
            shm.allgather(gathered, part)
            assert torch.equal(gathered, ref_gathered), ("allgather", dtype, m)
            inplace = torch.zeros(m * n, dtype=dtype)
            inplace.view(n, m)[r] = part
            shm.allgather(inplace)
            assert torch.equal(inplace, ref_gathered), ("allgather in place", dtype, m)

# random data: bit-identical on every rank, and from call to call; close to a float64 reference
for dtype in (torch.float32, torch.float64):
    x = torch.randn(10007, generator=gen).to(dtype)
    results = []
    for _ in range(2):
        y = x.clone()
        shm.allreduce(y)
        results.append(y)
    assert torch.equal(results[0], results[1])
    everyone = torch.empty(n * x.numel(), dtype=dtype)
    world.allgather(everyone, results[0])
    for j in range(n):
        assert torch.equal(everyone.view(n, -1)[j], results[0]), ("not bit-identical", dtype, j)
    inputs = torch.empty(n * x.numel(), dtype=dtype)
    world.allgather(inputs, x)
    reference = inputs.view(n, -1).double().sum(0)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(results[0].double(), reference, rtol=tol, atol=tol), dtype
    # rank order 0..n-1, exactly: the same as summing the gathered inputs in that order
    ordered = inputs.view(n, -1)[0] + inputs.view(n, -1)[1]
    for j in range(2, n):
        ordered = ordered + inputs.view(n, -1)[j]
    assert torch.equal(results[0], ordered), dtype

counters = grid.stats.ops
assert counters[("world", "shm allreduce")].calls > 0
shm.close()
shm.close()
grid.close()
if r == 0:
    print(f"shm collectives ok on {n} ranks ({barrier} barrier)", flush=True)
