"""Rank 0 enters an allreduce that rank 1 never joins (rank 1 sleeps): the watchdog must abort."""
import time

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.runtime.launcher import discover

info = discover()
grid = ProcessGrid.build(info)  # timeout from HPCTRAIN_COMM_TIMEOUT
if info.rank == 0:
    grid.world.allreduce(torch.ones(4))
else:
    time.sleep(60)
