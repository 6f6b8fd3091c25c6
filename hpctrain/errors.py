"""User-facing errors: one message that says what is wrong and what to do, and a non-zero exit."""
from hpctrain.exit_codes import NODE_FAILURE


class HpcTrainError(RuntimeError):
    """An error caused by the user's input or environment (config, launch, checkpoint).

    The CLI prints ``str(error)`` prefixed with the rank and exits with status 2. ``everywhere``: the
    error is raised identically on every rank (the same input validated everywhere, or an outcome the
    ranks agreed on by a collective), so rank 0 alone prints it, once per job, when the ranks agree they
    all raised it with the same message (else each rank that raised it prints it). Programming errors stay
    ordinary exceptions with a traceback.
    """

    everywhere = False


def everywhere(error: HpcTrainError) -> HpcTrainError:
    """Mark ``error`` as raised identically on every rank (printed once per job, by rank 0, when they agree)."""
    error.everywhere = True
    return error


class LaunchError(HpcTrainError):
    """The MPI world does not match what the launcher promised (singletons, wrong MPI, ...)."""


class GridError(HpcTrainError):
    """The requested dp x pp x tp layout cannot be built on this world."""

    everywhere = True  # every rank validates the same layout


class NodeFailure(HpcTrainError):
    """A node cannot serve the run (its node-local disk missing, read-only or full; a /dev/shm too small for
    MPI): exit ``exit_codes.NODE_FAILURE`` (5), which ``slurm/train.sbatch --restarts`` relaunches without the
    nodes named in ``hosts`` (written to ``$HPCTRAIN_NODE_FAILURE_FILE`` where it is set)."""

    exit_code = NODE_FAILURE

    def __init__(self, message: str, hosts=()):
        super().__init__(message)
        self.hosts = sorted(set(hosts))
