"""alltoallv misused or stalled on 2 ranks: the job must end with a clear message, never hang. argv[1]:
- ``check``: comm.check on; rank 0 sends 3 rows to rank 1, which expects 2: every rank names the disagreement.
- ``local``: rank 1's input_splits add up to fewer rows than its input has: rank 1 names it before any
  communication, and the job ends while rank 0 waits in the collective.
- ``truncate``: comm.check off, the splits of ``check``: MPI's truncation error, with a hint, on rank 1.
  ``truncate-by-peer``: the same through the block-by-block path (one Isend/Irecv per peer).
- ``stop``: rank 1 stops itself (SIGSTOP) before the second alltoallv: the hang report names the call and
  the stopped rank (timeout from HPCTRAIN_COMM_TIMEOUT).
"""
import os
import signal
import sys

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.runtime.errors_exit import run_and_exit
from hpctrain.runtime.launcher import discover


def main(argv):
    mode = argv[0]
    info = discover()
    grid = ProcessGrid.build(info, check=mode == "check", timeout_s=None if mode == "stop" else 60)
    comm = grid.world
    largest = None
    if mode.endswith("-by-peer"):
        comm.alltoall_by_peer_bytes = 0
        mode, largest = mode.removesuffix("-by-peer"), 3
    comm.alltoallv(torch.zeros(2, 4), [1, 1], torch.ones(2, 4), [1, 1])  # splits that agree: pass any check
    if mode == "stop" and comm.rank == 1:
        print(f"rank 1 stops itself (pid {os.getpid()})", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "local":  # rank 1's input has 3 rows
        rows, input_splits, output_splits = 2 + comm.rank, [1, 1], [1, 1]
    else:  # (input rows, input_splits, output_splits): rank 1 expects 2 rows from rank 0, which sends 3
        rows, input_splits, output_splits = ((4, [1, 3], [1, 2]), (3, [2, 1], [2, 1]))[comm.rank]
    comm.alltoallv(torch.zeros(sum(output_splits), 4), output_splits, torch.ones(rows, 4), input_splits,
                   largest_block=largest)
    print(f"rank {comm.rank}: not detected", flush=True)


sys.exit(run_and_exit(main, sys.argv[1:]))
