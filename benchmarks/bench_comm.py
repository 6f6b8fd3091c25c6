#!/usr/bin/env python
"""Collective benchmark: hpctrain vs raw mpi4py vs torch.distributed gloo (same as `hpctrain bench comm`).

    mpiexec -n 4 python benchmarks/bench_comm.py --sizes 1K,64K,1M,16M --json bench_comm.json

Every option of `hpctrain bench comm --help` applies; see hpctrain/bench/comm.py for the method.
"""
import sys

from hpctrain.cli import main

if __name__ == "__main__":
    main(["bench", "comm", *sys.argv[1:]])
