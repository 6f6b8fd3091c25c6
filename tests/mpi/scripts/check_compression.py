"""Every compression strategy against a reference computed from all ranks' inputs, on the world group.

Run: mpiexec -n K python -m mpi4py check_compression.py
- alltoall (quantizers): chunk j of the result == C(sum_r C(x_r chunk j)) where C = decompress(compress(.)),
  summed in rank order (so fp16/bf16 equal cast -> reduce in float32 -> cast); with ``slice_only`` the
  rank's chunk is the inner sum;
- allgather (top-k): the result == sum_r C(x_r) exactly;
- shared (random-k): the result == sum_r x_r at the shared indices (to rounding: MPI's order), zero elsewhere;
- every rank ends with the same bits, and ``local`` == C(x) of its own input (what error feedback keeps).
Prints "OK <n> checks" on rank 0; any mismatch raises (mpi4py aborts the job).
"""
import types

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.compression.exchange import STRATEGIES, Stopwatch
from hpctrain.compression.methods import COMPRESSORS
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info, dp=info.size)
comm = grid.comm("world")
p, cfg = comm.size, types.SimpleNamespace(density=0.05, zfp_rate=12.0)
checks = 0
for dtype in (torch.float32, torch.float64):
    n = 64 * p * 5
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(100 + r), dtype=dtype) for r in range(p)]
    mine = inputs[comm.rank]
    for name, cls in sorted(COMPRESSORS.items()):
        compressor = cls(cfg)

        def roundtrip(x):
            return compressor.decompress(compressor.compress(x), x.numel(), x.dtype)

        for slice_only in (False, True):
            reduction = STRATEGIES[cls.strategy](comm, compressor, mine.clone(), slice_only=slice_only,
                                                 server_memory=None, server_key="s", key=(7, 3, 1), clock=Stopwatch())
            got = reduction.finish()
            if cls.strategy == "alltoall":
                c = n // p
                inner = [sum(roundtrip(x[j * c:(j + 1) * c]) for x in inputs) for j in range(p)]
                want = inner[comm.rank] if slice_only else torch.cat([roundtrip(s) for s in inner])
                assert torch.equal(reduction.local, torch.cat([roundtrip(mine[j * c:(j + 1) * c]) for j in range(p)]))
            elif cls.strategy == "allgather":
                want = sum(roundtrip(x) for x in inputs)
                assert torch.equal(reduction.local, roundtrip(mine))
            else:
                index = compressor.indices(n, (7, 3, 1), "cpu")
                want = torch.zeros(n, dtype=dtype)
                want[index] = sum(x[index] for x in inputs)
            if slice_only and cls.strategy != "alltoall":
                want = want[comm.rank * (n // p):(comm.rank + 1) * (n // p)]
            same = torch.equal(got, want) if cls.strategy != "shared" else \
                torch.allclose(got, want, rtol=1e-6, atol=1e-6)  # MPI's all-reduce adds in its own order
            assert got.dtype == dtype and same, (name, dtype, slice_only, (got - want).abs().max())
            every = comm.mpi.allgather(got.numpy().tobytes())
            assert slice_only or all(b == every[0] for b in every), f"{name}: ranks differ"
            checks += 1
    cast = torch.cat([x.to(torch.bfloat16).to(dtype) for x in inputs]).view(p, n).sum(0)  # the DDP bf16 hook
    reduction = STRATEGIES["alltoall"](comm, COMPRESSORS["bf16"](cfg), mine.clone(), slice_only=False,
                                       server_memory=None, server_key="s", clock=Stopwatch())
    assert torch.equal(reduction.finish(), cast.to(torch.bfloat16).to(dtype)), "bf16 != cast-reduce-cast"
    checks += 1
grid.close()
if comm.rank == 0:
    print(f"OK {checks} checks")
