"""Run several independent ``hpctrain`` commands one after the other in this one launch (argv: a JSON list of
argv lists, e.g. ``[["train", "train.run_dir=/x", ...], ...]``): the ranks start (Python, torch, MPI) once
instead of once per run. Each command goes through the CLI's own dispatch and error handling, so an error
ends the launch as it would end the command's own. Rank 0 prints one JSON line ``EXITS [...]``: each command's
exit code (the largest over the ranks). Only for runs that share nothing but the launch: no faults, no signals,
no kills, nothing a later run could read from an earlier one in the process."""
import json
import sys

from mpi4py import MPI

from hpctrain.cli import dispatch
from hpctrain.runtime.errors_exit import run_and_exit

world = MPI.COMM_WORLD
codes = []
for argv in json.loads(sys.argv[1]):
    codes.append(run_and_exit(dispatch, argv))
    world.Barrier()
worst = [world.allreduce(c, op=MPI.MAX) for c in codes]
if world.rank == 0:
    print("EXITS " + json.dumps(worst), flush=True)
