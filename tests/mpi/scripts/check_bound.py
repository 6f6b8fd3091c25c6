"""Blocking host collectives bound to their tensors (hpctrain/comm/bound.py) on real ranks.

``check``: allreduce (sum, max), reduce-scatter, allgather (in place and not) and broadcast, called again
and again on the same tensors, give the values numpy computes; the second call reuses the first's binding;
every call is numbered and counted like an ordinary one. A tensor whose storage moved, whose dtype changed
at the same address, or that became non-contiguous is not served by a stale binding (new storage read,
int32 sum, the ordinary contiguity error); avg, bfloat16, a float32 input into a bfloat16 output and comm.check
take the ordinary path; temporaries
never grow a table past its limit.
``stop``: rank 1 stops itself (SIGSTOP) before the 3rd bound allgather: the watchdog must name that call.
"""
import os
import signal
import sys

import numpy as np
import torch

from hpctrain.comm.bound import LIMIT
from hpctrain.comm.grid import ProcessGrid
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info)  # timeout from HPCTRAIN_COMM_TIMEOUT
world = grid.world
n, r = world.size, world.rank
mode = sys.argv[1]
tables = world._bound._tables


def bound(kind, tensor):
    """The binding made for ``tensor`` (an entry under the id of a dead tensor is not)."""
    entry = tables[kind].get(id(tensor))
    return entry if entry is not None and entry.first() is tensor else None


if mode == "stop":
    out, mine = torch.zeros(4 * n), torch.zeros(4)
    for i in range(3):
        if r == 1 and i == 2:
            print(f"rank 1 stops itself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        world.allgather(out, mine)
    print("not detected", flush=True)
    sys.exit(0)

rng = np.random.default_rng(0)
ranks = [rng.standard_normal(1000) for _ in range(n)]  # every rank's data, known to all

# allreduce sum and max, float64 and int64, twice on the same tensor: the second call is a hit
for dtype, op, combine in ((torch.float64, "sum", np.sum), (torch.int64, "max", np.max)):
    t = torch.zeros(1000, dtype=dtype)
    first = None
    for step in range(2):
        values = [(x * 100).astype(np.int64) + step if dtype == torch.int64 else x + step for x in ranks]
        t.copy_(torch.from_numpy(values[r]))
        seq, calls = world.seq, world.stats.ops[("world", "allreduce")].calls
        world.allreduce(t, op)
        assert np.allclose(t.numpy(), combine(np.stack(values), axis=0), rtol=1e-12, atol=0), (dtype, op, step)
        assert world.seq == seq + 1 and world.done_seq == world.seq and world.done_op == "allreduce"
        assert world.stats.ops[("world", "allreduce")].calls == calls + 1
        first = first or bound("allreduce", t)
        assert first is not None and bound("allreduce", t) is first, "the second call must reuse the binding"

# reduce-scatter and allgather (separate input, and in place)
big, small = torch.zeros(4 * n, dtype=torch.float32), torch.zeros(4, dtype=torch.float32)
for step in range(2):
    big.copy_(torch.arange(4 * n, dtype=torch.float32) * (r + 1) + step)
    world.reduce_scatter(small, big)
    expect = sum(np.arange(4 * n, dtype=np.float32) * (j + 1) + step for j in range(n))[4 * r:4 * r + 4]
    assert np.array_equal(small.numpy(), expect), (small, expect)
    small.fill_(r + step)
    world.allgather(big, small)
    assert np.array_equal(big.numpy(), np.repeat(np.arange(n, dtype=np.float32) + step, 4)), big
    big.zero_()
    big[4 * r:4 * r + 4] = 10 * r + step
    world.allgather(big)  # in place
    assert np.array_equal(big.numpy(), np.repeat(10 * np.arange(n, dtype=np.float32) + step, 4)), big
assert bound("reduce_scatter", small) is not None and bound("allgather", big) is not None

# broadcast from the last rank
root_value = torch.full((5,), float(r))
for _ in range(2):
    world.broadcast(root_value, root=n - 1)
    assert torch.equal(root_value, torch.full((5,), float(n - 1))), root_value
    root_value.fill_(r)

# the storage moved (a freed and re-allocated buffer): the new storage is what gets reduced
t = torch.ones(64)
world.allreduce(t)
old = bound("allreduce", t)
t.data = torch.full((64,), float(r + 1))
world.allreduce(t)
assert torch.equal(t, torch.full((64,), n * (n + 1) / 2)), t
assert bound("allreduce", t) is not old

# the same address, another dtype: summed as int32, not as the float32 the old binding described
t = torch.zeros(16, dtype=torch.float32)
world.allreduce(t)
t.data = t.view(torch.int32)
assert t.dtype == torch.int32
t.fill_((r + 1) << 23)  # as float32 bits: normal numbers, whose float sum has other bits than the int sum
world.allreduce(t)
assert torch.equal(t, torch.full((16,), (n * (n + 1) // 2) << 23, dtype=torch.int32)), t

# non-contiguous after an in-place transpose: the ordinary path's error, not a read of the raw memory
out, flat_input = torch.zeros(4), torch.zeros(2 * n, 2)
world.reduce_scatter(out, flat_input)
assert bound("reduce_scatter", out) is not None
flat_input.t_()
try:
    world.reduce_scatter(out, flat_input)
except ValueError as exc:
    assert "contiguous" in str(exc), exc
else:
    raise AssertionError("a non-contiguous input was reduced")

# avg, bfloat16: never bound, still right
t = torch.full((8,), float(r))
world.allreduce(t, "avg")
assert torch.allclose(t, torch.full((8,), (n - 1) / 2)) and bound("allreduce", t) is None
h = torch.full((8,), float(r + 1), dtype=torch.bfloat16)
world.allreduce(h)
assert torch.equal(h, torch.full((8,), n * (n + 1) / 2, dtype=torch.bfloat16)) and bound("allreduce", h) is None

# a float32 input reduced into a bfloat16 output: staged through float32 by the ordinary path, as always
half_out = torch.zeros(4, dtype=torch.bfloat16)
world.reduce_scatter(half_out, torch.full((4 * n,), float(r + 1)))
assert torch.equal(half_out, torch.full((4,), n * (n + 1) / 2, dtype=torch.bfloat16)), half_out

# comm.check on: the fingerprinted ordinary path
world.check = True
t = torch.full((8,), 1.0)
world.allreduce(t)
assert torch.equal(t, torch.full((8,), float(n))) and bound("allreduce", t) is None
world.check = False

# temporaries: the table is emptied when full, never larger
for i in range(3 * LIMIT):
    world.allreduce(torch.full((4,), float(i)))
assert len(tables["allreduce"]) <= LIMIT, len(tables["allreduce"])

grid.close()
assert all(not table for table in tables.values())  # close() drops every binding
print(f"bound collectives ok on {n} ranks", flush=True)
