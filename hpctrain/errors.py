"""User-facing errors: one message that says what is wrong and what to do, and a non-zero exit."""


class HpcTrainError(RuntimeError):
    """An error caused by the user's input or environment (config, launch, checkpoint).

    The CLI prints ``str(error)`` once per rank, prefixed with the rank, and exits with status 2.
    Programming errors stay ordinary exceptions with a traceback.
    """


class LaunchError(HpcTrainError):
    """The MPI world does not match what the launcher promised (singletons, wrong MPI, ...)."""


class GridError(HpcTrainError):
    """The requested dp x pp x tp layout cannot be built on this world."""


class CommTimeout(HpcTrainError):
    """A collective or point-to-point operation did not complete within its timeout."""
