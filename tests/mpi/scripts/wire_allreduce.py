"""Allreduce one float32 buffer over COMM_WORLD and report what crossed this host's eth1 (two_hosts.sh).

Usage: python -m mpi4py wire_allreduce.py [MiB]. Every rank prints one JSON line: its host, the
tx/rx bytes of its host's /sys/class/net/eth1 around the allreduce, the result
check, and the environment variables the launch was meant to pass through.
"""
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

STATS = "/sys/class/net/eth1/statistics/"


def wire():
    try:
        return {k: int(open(STATS + k).read()) for k in ("tx_bytes", "rx_bytes")}
    except OSError:
        return None


comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
n = int(float(sys.argv[1] if len(sys.argv) > 1 else 8) * 2**20) // 4
x = np.empty(n, dtype=np.float32)
y = np.empty_like(x)
x[:] = rank + 1  # page in both buffers; connect with a tiny allreduce so the wire carries one big one only
y[:] = 0
comm.Allreduce(x[:1], y[:1])
comm.Barrier()
before = wire()
t0 = time.perf_counter()
comm.Allreduce(x, y)
seconds = time.perf_counter() - t0
comm.Barrier()
after = wire()
record = {
    "rank": rank, "size": size, "host": socket.gethostname(), "bytes": x.nbytes, "seconds": seconds,
    "ok": bool(np.all(y == size * (size + 1) / 2)),
    "wire": None if before is None else {k: after[k] - before[k] for k in before},
    "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MPIR_CVAR_CH4_PROGRESS_THROTTLE", "FI_PROVIDER",
                                           "VIRTUAL_ENV", "PYTHONPATH")},
    "executable": sys.executable,
}
records = comm.gather(record, root=0)
if rank == 0:
    for r in records:
        print(json.dumps(r), flush=True)
