"""Every collective, every dtype, on the world and on each axis group of a dp x pp x tp grid.

Run: mpiexec -n K python -m mpi4py check_collectives.py [--tp T] [--pp P] [--device cuda --backend B]
``--device cuda`` puts every tensor on the rank's GPU and checks that the group's device backend
(``--backend``: nccl, cuda-mpi or mpi = host staging) carried it. Each rank's data is a function of
its world rank, so the expected result is computed locally on the host.
Prints "OK <n> checks ... backend <name>" on rank 0; any mismatch raises (and mpi4py aborts the job).
"""
import argparse

import torch

from hpctrain.comm.grid import AXES, ProcessGrid
from hpctrain.runtime.launcher import bind_device, discover

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]


def data(world_rank: int, n: int, dtype, device="cpu") -> torch.Tensor:
    # small integers: exact in every dtype, sums stay exact in bf16 for <= 8 ranks
    return ((torch.arange(n) % 7) + world_rank + 1).to(dtype).to(device)


def check_group(comm, dtype, device, checks: list) -> None:
    me, members, size = comm.members[comm.rank], comm.members, comm.size
    n = 4 * size + 3  # not a power of two

    def expect(name, got, want):
        assert got.device.type == torch.device(device).type, name
        got, want = got.cpu(), want.cpu()  # device-to-host copies on the current stream: after the collective
        assert torch.equal(got, want.to(got.dtype)), f"{comm.name} {dtype} {name}: got {got} want {want}"
        checks.append(name)

    # allreduce sum / max / avg (blocking and non-blocking)
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

    # reduce_scatter: block b of rank r's input = data(r) + b
    m = 5
    inp = torch.cat([data(me, m, dtype, device) + b for b in range(size)])
    out = torch.empty(m, dtype=dtype, device=device)
    comm.reduce_scatter(out, inp)
    expect("reduce_scatter", out, sum(data(r, m, torch.float64) + comm.rank for r in members))
    out2 = torch.empty(m, dtype=dtype, device=device)
    comm.reduce_scatter(out2, inp, nonblocking=True).wait()
    expect("reduce_scatter-nb", out2, out.to(torch.float64))

    # allgather: out of place, in place, non-blocking
    gathered = torch.empty(m * size, dtype=dtype, device=device)
    comm.allgather(gathered, data(me, m, dtype, device))
    want = torch.cat([data(r, m, torch.float64) for r in members])
    expect("allgather", gathered, want)
    inplace = torch.zeros(m * size, dtype=dtype, device=device)
    inplace[comm.rank * m:(comm.rank + 1) * m] = data(me, m, dtype, device)
    comm.allgather(inplace, None, nonblocking=True).wait()
    expect("allgather-inplace-nb", inplace, want)

    # broadcast from the last group rank
    t = data(me, n, dtype, device)
    comm.broadcast(t, root=size - 1)
    expect("broadcast", t, data(members[-1], n, torch.float64))

    # ring send/recv, non-blocking both ways (no deadlock whatever the size)
    right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
    send_buf, recv_buf = data(me, n, dtype, device), torch.empty(n, dtype=dtype, device=device)
    if torch.device(device).type == "cpu":
        for h in [comm.irecv(recv_buf, left, tag=7), comm.isend(send_buf, right, tag=7)]:
            h.wait()
        expect("sendrecv-ring", recv_buf, data(members[left], n, torch.float64))
    elif size % 2 == 0:
        # blocking send/recv ordered by parity: NCCL point-to-point calls made separately are not
        # grouped, so two neighbours that both receive first would deadlock on the GPU
        first, second = ((lambda: comm.send(send_buf, right), lambda: comm.recv(recv_buf, left))
                         if comm.rank % 2 == 0 else
                         (lambda: comm.recv(recv_buf, left), lambda: comm.send(send_buf, right)))
        first()
        second()
        expect("sendrecv-ring", recv_buf, data(members[left], n, torch.float64))
    # the pipeline's grouped exchange: send right and receive from the left in one post
    exchanged = torch.empty(n, dtype=dtype, device=device)
    comm.exchange([(data(me, n, dtype, device), right, 8)], [(exchanged, left, 8)]).wait()
    expect("exchange-ring", exchanged, data(members[left], n, torch.float64))
    comm.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "cuda-mpi", "mpi"],
                        help="device backend for --device cuda (auto: NCCL with one GPU per rank)")
    args = parser.parse_args()
    info = discover()
    device = torch.device("cpu") if args.device == "cpu" else bind_device(info)
    assert device.type == args.device, f"--device {args.device}, but the rank got {device} (no CUDA device?)"
    grid = ProcessGrid.build(info, tp=args.tp, pp=args.pp, backend=args.backend, timeout_s=120)
    backends = grid.use_device(device)
    checks = []
    for axis in ("world",) + AXES:
        for dtype in DTYPES:
            check_group(grid.comm(axis), dtype, device, checks)
    expected = {"cpu": "mpi", "nccl": "nccl", "cuda-mpi": "mpi", "mpi": "mpi-staged"}
    want = expected["cpu" if args.device == "cpu" else args.backend]
    assert set(backends.values()) == {want}, f"backends used: {backends}, expected {want}"
    # the byte counters saw every call
    assert sum(c.bytes for c in grid.stats.ops.values()) > 0 and grid.stats.ops[("world", "allreduce")].calls == sum(3 if d.is_floating_point else 2 for d in DTYPES)
    # non-contiguous input is refused clearly (zero-copy contract)
    try:
        grid.world.allreduce(torch.ones(4, 4).t())
    except ValueError as exc:
        assert "contiguous" in str(exc)
    else:
        raise AssertionError("non-contiguous tensor accepted")
    total = grid.world.mpi.allreduce(len(checks))
    grid.close()
    if info.rank == 0:
        print(f"OK {total} checks on {info.size} ranks, backend {want}, layout {grid.sizes}")


if __name__ == "__main__":
    main()
