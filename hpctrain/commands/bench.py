"""``hpctrain bench comm``: the collective benchmark (bench/comm.py) and its link profile (bench/profile.py)."""
from __future__ import annotations

from hpctrain.runtime.dtypes import DTYPE_NAMES


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_what", required=True)
    c = bsub.add_parser("comm", help="collective benchmark: hpctrain vs raw mpi4py vs torch.distributed gloo")
    c.add_argument("--ops", default="allreduce,reduce_scatter,allgather,broadcast",
                   help="comma list of allreduce, reduce_scatter, allgather, broadcast, sendrecv, alltoall "
                        "(alltoall: Communicator.alltoallv with equal splits against mpi4py Alltoallv)")
    c.add_argument("--sizes", default=None,
                   help="comma list of total buffer sizes, binary K/M/G suffixes (default 1K,64K,1M,16M; "
                        "with --profile 4K,64K,256K,1M,4M,16M)")
    c.add_argument("--axis", default="world", choices=["world", "dp", "pp", "tp"],
                   help="group to run on (default world)")
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--pp", type=int, default=1)
    c.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    c.add_argument("--impls", default="hpctrain,mpi4py,gloo", help="comma list of hpctrain, hpctrain-persistent, hpctrain-shm, "
                   "hpctrain-auto, mpi4py, gloo")
    c.add_argument("--iters", type=int, default=0,
                   help="timed iterations per size (0 = by size: 200 at <= 1M down to 5 at >= 64M)")
    c.add_argument("--rounds", type=int, default=3, help="rounds per size; the best round is reported (default 3)")
    c.add_argument("--json", metavar="FILE", help="write records to FILE (JSON list)")
    c.add_argument("--csv", metavar="FILE", help="write records to FILE (CSV)")
    c.add_argument("--comm-timeout", type=float, default=120.0,
                   help="seconds one collective may wait before the job ends with a hang report naming the "
                        "rank it waits for (default 120)")
    c.add_argument("--profile", metavar="OUT.json",
                   help="instead: fit latency and bandwidth per link level (intra-node, inter-node) and per "
                        "collective, write them to OUT.json (input of `hpctrain plan --profile`)")
    c.set_defaults(func=_run_bench_comm)


def _run_bench_comm(args) -> int:
    if args.profile:
        from hpctrain.bench.profile import run_link_profile

        return run_link_profile(args)
    from hpctrain.bench.comm import run_comm_bench

    args.sizes = args.sizes or "1K,64K,1M,16M"
    return run_comm_bench(args)
