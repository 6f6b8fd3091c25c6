"""Several check_fidelity.py runs in one launch (argv: a JSON list of ``[name, [check_fidelity argv...]]``):
the ranks start once instead of once per run. Rank 0 prints ``=== JOB name ===`` before each run's own
output; the first failure ends the launch as it would end check_fidelity.py's own."""
import json
import sys

from mpi4py import MPI

import check_fidelity

for name, argv in json.loads(sys.argv[1]):
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"=== JOB {name} ===", flush=True)
    sys.argv = ["check_fidelity.py", *argv]
    check_fidelity.main()
