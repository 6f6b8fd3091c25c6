"""Recurring small collectives (hpctrain/comm/persistent.py) on real ranks.

``check``: sum / max allreduce and broadcast through persistent requests, values rewritten in place
between calls, equal to the ordinary Communicator calls; the calls are numbered on their group like
any collective (``seq``), counted (``stats``), and freed by ``grid.close()``; with comm.check on, a
Recurring falls back to the ordinary (fingerprinted) call.
``stop``: rank 1 stops itself (SIGSTOP) before the 3rd call of a recurring allreduce: the watchdog
must name that call and the stopped rank.
"""
import os
import signal
import sys

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.persistent import persistent_supported
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info)  # timeout from HPCTRAIN_COMM_TIMEOUT
world = grid.world
n, r = world.size, world.rank
mode = sys.argv[1]

if mode == "stop":
    value = torch.zeros(1, dtype=torch.float64)
    op = world.recurring_allreduce(value)
    for i in range(3):
        if r == 1 and i == 2:
            print(f"rank 1 stops itself (pid {os.getpid()})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        value[0] = r
        op()
    print("not detected", flush=True)
    sys.exit(0)

assert persistent_supported(), "this MPI has no persistent collectives: the lean path is not tested"
loss = torch.zeros(1, dtype=torch.float64)
code = torch.zeros(1, dtype=torch.int32)
vector = torch.zeros(256, dtype=torch.float32)  # 1 KiB
root_value = torch.zeros(3, dtype=torch.int64)
ops = [world.recurring_allreduce(loss), world.recurring_allreduce(code, op="max"),
       world.recurring_allreduce(vector), world.recurring_broadcast(root_value, root=n - 1)]
assert all(op.lean for op in ops), [op.lean for op in ops]
assert len(world.recurring) == 4
seq0 = world.seq
calls0 = world.stats.ops[("world", "allreduce")].calls
for step in range(5):
    loss[0] = 0.1 * step + r
    ops[0]()
    ref = torch.tensor([0.1 * step + r], dtype=torch.float64)
    world.allreduce(ref)  # the ordinary path: the same MPI sum
    assert torch.equal(loss, ref), (loss, ref)
    code[0] = (r * 7 + step) % 5
    ops[1]()
    assert code.item() == max((j * 7 + step) % 5 for j in range(n)), (step, code)
    vector.copy_(torch.arange(256, dtype=torch.float32) * (r + 1) + step)
    ops[2]()
    assert torch.equal(vector, torch.arange(256, dtype=torch.float32) * (n * (n + 1) / 2) + n * step), step
    root_value.fill_(r * 100 + step)
    ops[3]()
    assert root_value.tolist() == [(n - 1) * 100 + step] * 3, root_value
# 4 recurring calls + 1 ordinary allreduce per step, numbered on the group like any collective
assert world.seq - seq0 == 5 * 5, (world.seq, seq0)
assert world.done_seq == world.seq
assert world.stats.ops[("world", "allreduce")].calls - calls0 == 5 * 4  # 3 recurring + 1 ordinary per step
assert world.stats.ops[("world", "broadcast")].calls == 5
assert not grid.watchdog.inflight()

# comm.check on: the ordinary fingerprinted call instead (same result)
world.check = True
checked = world.recurring_allreduce(loss)
assert not checked.lean
loss[0] = r
checked()
assert loss.item() == sum(range(n))
world.check = False

grid.close()
assert world.recurring == [] and all(op._request is None for op in ops)
print(f"persistent collectives ok on {n} ranks", flush=True)
