"""``Communicator.alltoallv`` on real ranks, checked against numpy: uneven and empty pieces, ranks that send
or receive nothing, 1-D and multi-dimensional rows, float64 / int64 / float32 / bfloat16 / uint8, blocking
and non-blocking, the splits derived by ``alltoall_splits``, and the byte counters.

Run: mpiexec -n K python -m mpi4py check_alltoallv.py [--device cuda --backend B] [--by-peer]
``--by-peer``: every call also passes ``largest_block`` (the split matrix's largest entry, known to every
rank) with the backend's threshold at 0, so host tensors of every size take the block-by-block path (one
Isend/Irecv per peer), which otherwise starts at 128 KiB blocks.
``--device cuda`` puts the tensors on the rank's GPU, through the group's device backend (``--backend``: nccl,
cuda-mpi or mpi = host staging; tests/gpu/test_nccl_backend.py).
Every rank draws the same split matrix S (S[i, j] = rows rank i sends to rank j) from a shared seed and
can build every rank's input, so the expected output is computed locally. Prints "OK <n> checks on <K>
ranks" on rank 0; any mismatch raises (and mpi4py aborts the job).
"""
import argparse

import numpy as np
import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.runtime.launcher import bind_device, discover

CASES = [  # (dtype, trailing dims of a row)
    (torch.float64, ()), (torch.int64, ()), (torch.float64, (3,)), (torch.int64, (2, 3)),
    (torch.float32, (5,)), (torch.bfloat16, (4,)), (torch.uint8, (7,))]


def rows_of(sender: int, splits: np.ndarray, row: tuple, dtype) -> np.ndarray:
    """Rank ``sender``'s input as a float64 array: row k of the piece for rank j holds 100 sender + 10 j +
    k (+ the position inside the row), small integers exact in every dtype of CASES (uint8: mod 256)."""
    pieces = []
    width = int(np.prod(row)) if row else 1
    for j, count in enumerate(splits[sender]):
        base = 100 * sender + 10 * j + np.arange(count, dtype=np.float64)[:, None] + np.arange(width)[None, :]
        pieces.append(base.reshape((count,) + row))
    data = np.concatenate(pieces) if pieces else np.zeros((0,) + row)
    return np.mod(data, 256) if dtype == torch.uint8 else data


def matrices(n: int, rng) -> list[np.ndarray]:
    uneven = rng.integers(0, 5, (n, n))
    uneven[0, n - 1] = 0  # an empty piece
    quiet = rng.integers(1, 4, (n, n))
    quiet[n - 1, :] = 0  # the last rank sends nothing (0 input rows)
    quiet[:, 0] = 0  # rank 0 receives nothing (0 output rows)
    return [uneven, quiet, np.zeros((n, n), dtype=np.int64), np.full((n, n), 3)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "cuda-mpi", "mpi"])
    parser.add_argument("--by-peer", action="store_true")
    args = parser.parse_args()
    info = discover()
    device = torch.device("cpu") if args.device == "cpu" else bind_device(info)
    assert device.type == args.device, f"--device {args.device}, but the rank got {device} (no CUDA device?)"
    grid = ProcessGrid.build(info, backend=args.backend, timeout_s=120)
    backends = grid.use_device(device)
    comm, me, n = grid.world, grid.world.rank, grid.world.size
    if args.by_peer:
        comm.alltoall_by_peer_bytes = 0

        def refused(*_args, **_kwargs):
            raise AssertionError("--by-peer: a call went through one Alltoallv")
        comm.backend_for(torch.zeros(1)).alltoallv = refused
    rng = np.random.default_rng(41)  # the same on every rank
    checks, calls, sent_bytes, total_bytes = 0, 0, 0, 0
    for splits in matrices(n, rng):
        input_splits = [int(x) for x in splits[me]]
        output_splits = comm.alltoall_splits(input_splits)
        assert output_splits == [int(x) for x in splits[:, me]], (output_splits, splits)
        for dtype, row in CASES:
            mine = torch.from_numpy(rows_of(me, splits, row, dtype)).to(dtype).to(device).contiguous()
            want = np.concatenate([rows_of(i, splits, row, dtype)[sum(splits[i, :me]):sum(splits[i, :me + 1])]
                                   for i in range(n)])
            for nonblocking in (False, True):
                out = torch.full((sum(output_splits),) + row, 255 if dtype == torch.uint8 else -1, dtype=dtype,
                                 device=device)
                handle = comm.alltoallv(out, output_splits, mine, input_splits, nonblocking=nonblocking,
                                        largest_block=int(splits.max()) if args.by_peer else None)
                if nonblocking:
                    while not handle.test():
                        pass
                    handle.wait()
                else:
                    assert handle is None
                got = out.cpu().to(torch.float64).numpy()  # on the current stream: after the call
                assert got.shape == want.shape and np.array_equal(got, want), \
                    f"rank {me} {dtype} row {row} nb={nonblocking} splits\n{splits}\ngot {got}\nwant {want}"
                calls += 1
                total_bytes += mine.nbytes
                sent_bytes += (mine.shape[0] - input_splits[me]) * mine[0:1].nbytes if mine.shape[0] else 0
                checks += 1
    counter = grid.stats.ops[("world", "alltoallv")]
    assert counter.calls == calls and counter.bytes == total_bytes, (counter, calls, total_bytes)
    assert abs(counter.sent - sent_bytes) <= calls, (counter.sent, sent_bytes)  # int() per call
    assert grid.stats.ops[("world", "alltoall")].calls == len(matrices(n, np.random.default_rng(0)))
    total = comm.mpi.allreduce(checks)
    grid.close()
    if info.rank == 0:
        print(f"OK {total} checks on {info.size} ranks, backend {backends['world']}")


if __name__ == "__main__":
    main()
