"""Run ``hpctrain train`` in this process on every rank once per bad case (argv: a base run directory, then a
JSON list of override lists), each in its own run directory; rank 0 prints one JSON line ``RESULTS [...]``:
per case, every rank's (error type, raised alike everywhere, message or None, its run directory exists).
``PORT_IN_USE`` in an override is a port rank 0 holds open, ``{base}`` the base run directory. A case whose
first item is "info" or "train" is the whole argv of that command instead (its own run directory, if any)."""
import json
import os
import socket
import sys

from mpi4py import MPI

from hpctrain.cli import dispatch
from hpctrain.errors import HpcTrainError

base, cases = sys.argv[1], json.loads(sys.argv[2])
world = MPI.COMM_WORLD
holder = None
if world.rank == 0:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
port = world.bcast(holder.getsockname()[1] if holder else None)
rows = []
for i, overrides in enumerate(cases):
    run_dir = os.path.join(base, str(i))
    overrides = [o.replace("PORT_IN_USE", str(port)).replace("{base}", base) for o in overrides]
    argv = ["train", "--config", "configs/tiny.toml", "parallel.pp=1", "data.max_bytes=100000", "train.steps=1",
            f"train.run_dir={run_dir}", *overrides] if overrides[:1] not in (["info"], ["train"]) else overrides
    try:
        dispatch(argv)
        row = ("none", False, None)
    except HpcTrainError as exc:
        row = (type(exc).__name__, bool(exc.everywhere), str(exc))
    except Exception as exc:  # noqa: BLE001 - reported: a bad input must be a user error
        row = (type(exc).__name__, False, f"NOT A USER ERROR: {exc!r}")
    world.Barrier()  # rank 0 may create a directory late: look after every rank is done
    rows.append((*row, os.path.exists(run_dir)))
gathered = world.gather(rows, root=0)
if world.rank == 0:
    print("RESULTS " + json.dumps([[ranks[i] for ranks in gathered] for i in range(len(cases))]), flush=True)
