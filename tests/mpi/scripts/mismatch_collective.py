"""comm.check: rank 0 all-reduces 4 floats, the others 8 (a caller bug): every rank must name it."""
import sys

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.runtime.errors_exit import run_and_exit
from hpctrain.runtime.launcher import discover


def main(_argv):
    info = discover()
    grid = ProcessGrid.build(info, check=True, timeout_s=60)
    grid.world.allreduce(torch.ones(3))  # the same on every rank: passes the check
    grid.world.allreduce(torch.ones(4 if info.rank == 0 else 8))
    print("not detected", flush=True)


sys.exit(run_and_exit(main))
