"""Run several independent ``hpctrain`` commands one after the other in this one launch (argv: a JSON list of
argv lists, e.g. ``[["train", "train.run_dir=/x", ...], ...]``): the ranks start (Python, torch, MPI) once
instead of once per run. Each command goes through the CLI's own dispatch and error handling, so an error
ends the launch as it would end the command's own. Rank 0 prints one JSON line ``RESULTS [...]``: per command
its exit code (the largest over the ranks) and what the ranks printed to stdout and stderr from Python (in
rank order; also printed as usual). Only for runs that share nothing but the launch: no faults, no signals,
no kills, nothing a later run could read from an earlier one in the process."""
import contextlib
import io
import json
import sys

from mpi4py import MPI

from hpctrain.cli import dispatch
from hpctrain.runtime.errors_exit import run_and_exit


class Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


world = MPI.COMM_WORLD
results = []
for argv in json.loads(sys.argv[1]):
    out, err = Tee(sys.stdout), Tee(sys.stderr)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_and_exit(dispatch, argv)
    world.Barrier()
    printed = world.gather((out.copy.getvalue(), err.copy.getvalue()), root=0)
    worst = world.allreduce(code, op=MPI.MAX)
    if world.rank == 0:
        results.append({"exit": worst, "stdout": "".join(o for o, _ in printed),
                        "stderr": "".join(e for _, e in printed)})
if world.rank == 0:
    print("RESULTS " + json.dumps(results), flush=True)
