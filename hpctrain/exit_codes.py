"""Every exit code an hpctrain job ends with, in one place (docs/fault-tolerance.md, "Exit codes").

Wrapper scripts read them: ``slurm/train.sbatch --restarts`` relaunches a step that ended with anything but
``DONE``, ``USER_ERROR``, ``DIVERGED`` and ``STOPPED`` (the same again on any node), and with ``NODE_FAILURE``
it leaves out the nodes named in ``$HPCTRAIN_NODE_FAILURE_FILE`` when the allocation has others.
"""
from __future__ import annotations

DONE = 0  # finished, --max-steps reached, or stopped and requeued by `scontrol requeue`
INTERNAL_ERROR = 1  # a bug: the traceback of the rank that hit it
USER_ERROR = 2  # config, layout, launch, data, checkpoint, run directory: fix the input named
HANG = 3  # a communication call outlived comm.timeout_s: the hang report names the rank
DIVERGED = 4  # a non-finite loss or gradient norm, or too many skipped steps: nothing saved after it
NODE_FAILURE = 5  # a node cannot serve the run (its node-local disk missing, read-only or full; /dev/shm too
#                   small for MPI): the same job can go on without it
STOPPED = 75  # EX_TEMPFAIL: stopped early (signal, time limit) and checkpointed, not requeued
