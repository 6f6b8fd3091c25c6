"""Every collective on CUDA tensors through one device backend (NCCL via CuPy, or CUDA-aware MPI).

Run: mpiexec -n K python -m mpi4py check_collectives_cuda.py --backend nccl|cuda-mpi [--tp T]
Each rank binds a GPU by node-local rank; data is a function of the world rank, so the expected
result is computed locally on the host. Prints "OK <n> checks ... backend <name>" on rank 0.
"""
import argparse

import torch

from hpctrain.comm.grid import AXES, ProcessGrid
from hpctrain.runtime.launcher import bind_device, discover

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]


def data(world_rank, n, dtype, device="cpu"):
    return ((torch.arange(n) % 7) + world_rank + 1).to(dtype).to(device)


def check_group(comm, dtype, device, checks):
    me, members, size = comm.members[comm.rank], comm.members, comm.size
    n, m = 4 * size + 3, 5

    def expect(name, got, want):
        torch.cuda.synchronize()
        assert got.device.type == "cuda", name
        assert torch.equal(got.cpu(), want.to(got.dtype)), f"{comm.name} {dtype} {name}: got {got} want {want}"
        checks.append(name)

    t = data(me, n, dtype, device)
    comm.allreduce(t)
    expect("allreduce-sum", t, sum(data(r, n, torch.float64) for r in members))
    t = data(me, n, dtype, device)
    comm.allreduce(t, op="max")
    expect("allreduce-max", t, data(max(members), n, torch.float64))
    if dtype.is_floating_point:
        t = data(me, n, dtype, device) * size
        handle = comm.allreduce(t, op="avg", nonblocking=True)
        while not handle.test():
            pass
        handle.wait()
        expect("allreduce-avg-nb", t, sum(data(r, n, torch.float64) for r in members))

    inp = torch.cat([data(me, m, dtype) + b for b in range(size)]).to(device)
    out = torch.empty(m, dtype=dtype, device=device)
    comm.reduce_scatter(out, inp)
    expect("reduce_scatter", out, sum(data(r, m, torch.float64) + comm.rank for r in members))

    want = torch.cat([data(r, m, torch.float64) for r in members])
    gathered = torch.empty(m * size, dtype=dtype, device=device)
    comm.allgather(gathered, data(me, m, dtype, device))
    expect("allgather", gathered, want)
    inplace = torch.zeros(m * size, dtype=dtype, device=device)
    inplace[comm.rank * m:(comm.rank + 1) * m] = data(me, m, dtype, device)
    comm.allgather(inplace, None, nonblocking=True).wait()
    expect("allgather-inplace-nb", inplace, want)

    t = data(me, n, dtype, device)
    comm.broadcast(t, root=size - 1)
    expect("broadcast", t, data(members[-1], n, torch.float64))

    # ring exchange ordered by parity: NCCL point-to-point calls on one stream are not grouped here,
    # so both ranks receiving first would deadlock on the GPU
    right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
    send_buf, recv_buf = data(me, n, dtype, device), torch.empty(n, dtype=dtype, device=device)
    if size % 2 == 0:
        first, second = ((lambda: comm.send(send_buf, right), lambda: comm.recv(recv_buf, left))
                         if comm.rank % 2 == 0 else
                         (lambda: comm.recv(recv_buf, left), lambda: comm.send(send_buf, right)))
        first()
        second()
        expect("sendrecv-ring", recv_buf, data(members[left], n, torch.float64))
    comm.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=["nccl", "cuda-mpi"])
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    info = discover()
    device = bind_device(info)
    assert device.type == "cuda", "no CUDA device"
    grid = ProcessGrid.build(info, tp=args.tp, backend=args.backend, timeout_s=120)
    checks = []
    for axis in ("world",) + AXES:
        comm = grid.comm(axis)
        if comm.size < 2:
            continue
        for dtype in DTYPES:
            check_group(comm, dtype, device, checks)
    names = {grid.comm(a).backend_for(torch.empty(1, device=device)).name
             for a in ("world",) + AXES if grid.comm(a).size > 1}
    expected = "nccl" if args.backend == "nccl" else "mpi"
    assert names == {expected}, f"backends used: {names}, expected {expected}"
    total = grid.world.mpi.allreduce(len(checks))
    grid.close()
    if info.rank == 0:
        print(f"OK {total} checks on {info.size} ranks, backend {args.backend}, layout {grid.sizes}")


if __name__ == "__main__":
    main()
