"""comm.intra_node=auto's routing table (hpctrain/comm/routes.py) on the world group of one node. argv[1]: a cache dir.

1. A cache file written beforehand (allreduce: MPI <= 8 KiB, shm above; reduce_scatter shm; allgather MPI) is
   read, not measured, and routes each call by it: the route's call counts and the route of each call in
   flight (what a hang report names: "shared memory" inside the shm route, nothing on MPI) follow the table;
   float64 results equal a local reference exactly.
2. A corrupt cache file is measured again without an error and rewritten valid.
3. ``use_cache=False`` measures again although a valid file is there.
Every rank must hold the same table each time.
"""
import sys

import torch

from hpctrain.comm.collectives import Communicator
from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.intra_node import route_intra_node
from hpctrain.comm.routes import CLASSES, cache_path, read_cache, route_key, write_cache
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info)
world = grid.world
n, r = world.size, world.rank
cache_dir = sys.argv[1]
key = route_key(world, world, "call")  # hpctrain's key for this group (collective)
assert key["ranks_per_node"] == n and key["mpi"] == info.mpi_library, key
path = cache_path(cache_dir, key)
told = []  # the routes of the calls in flight, seen from inside the shm route (a hang report's "(shared memory)")


def spy_on(route):
    """Record, inside each of ``route``'s collectives, the route of every call the watchdog has in flight."""
    for op in ("allreduce", "reduce_scatter", "allgather"):
        method = getattr(route, op)

        def spied(*args, _method=method):
            told.extend(call.route for call in grid.watchdog.inflight())
            return _method(*args)
        setattr(route, op, spied)


def routed(use_cache=True):
    comm = Communicator(world.mpi, "world", world.members, grid.watchdog, grid.stats)
    choice = route_intra_node(comm, world, "auto", cache_dir=cache_dir, use_cache=use_cache)
    tables = world.allgather_object(choice.table)
    assert all(t == tables[0] for t in tables), f"ranks disagree on the table: {tables}"
    return comm, choice


def same(got, want, what):
    assert torch.equal(got, want), f"rank {r}: {what}: {got[:4]} != {want[:4]}"


# 1. a cache file written beforehand routes every call by it
if r == 0:
    table = {"allreduce": [(limit, "mpi" if i == 0 else "shm", 2.0) for i, (limit, _) in enumerate(CLASSES)],
             "reduce_scatter": [(limit, "shm", 2.0) for limit, _ in CLASSES],
             "allgather": [(limit, "mpi", 0.5) for limit, _ in CLASSES]}
    assert write_cache(path, key, table)
comm, choice = routed()
assert choice.kind == "shm" and choice.source == f"cached in {path}", choice
assert choice.note() == " (auto, cached: allreduce shm > 8K, reduce_scatter shm, allgather mpi)", choice.note()
route = comm.shm
spy_on(route)
for numel in (1000, 4096, 300_000):  # 8000 B: MPI; 32 KiB and 2.4 MB: shm
    x = torch.arange(numel, dtype=torch.float64) * (r + 1)
    comm.allreduce(x)
    same(x, torch.arange(numel, dtype=torch.float64) * (n * (n + 1) // 2), f"allreduce of {numel}")
assert route.calls["allreduce"] == 2, route.calls
m = 5000
blocks = torch.arange(n * m, dtype=torch.float64) + r
out = torch.empty(m, dtype=torch.float64)
comm.reduce_scatter(out, blocks)
same(out, (torch.arange(n * m, dtype=torch.float64) * n + n * (n - 1) // 2)[r * m:(r + 1) * m], "reduce_scatter")
gathered = torch.empty(n * m, dtype=torch.float64)
comm.allgather(gathered, torch.full((m,), float(r), dtype=torch.float64))
same(gathered, torch.arange(n, dtype=torch.float64).repeat_interleave(m), "allgather")
assert route.calls == {"allreduce": 2, "reduce_scatter": 1, "allgather": 0}, route.calls
assert told == ["shared memory"] * 3, told
mpi_call = [slot.call for slot in grid.watchdog._slots if slot.call.comm is comm and slot.call.op == "allgather"]
assert mpi_call and mpi_call[0].route == "", mpi_call  # an MPI call carries no route: a hang report says MPI
assert grid.stats.ops[("world", "allgather")].calls == 1  # counted like any call
comm.close()

# 2. a corrupt cache file: measured again, no error, rewritten
if r == 0:
    with open(path, "w") as f:
        f.write('{"key": {"schema": 1}, "table": [')
world.barrier()
comm, choice = routed()
assert choice.source.startswith("measured in ") and choice.source.endswith(f"cached in {path}"), choice.source
if r == 0:
    assert read_cache(path, key) == choice.table, "the measured table was not written"
comm.close()

# 3. use_cache=False: measured although the file is valid
comm, choice = routed(use_cache=False)
assert choice.source.startswith("measured in "), choice.source
comm.close()
print(f"rank {r}: routes ok ({choice.kind}{choice.note()})", flush=True)
grid.close()
