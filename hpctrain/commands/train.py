"""``hpctrain train --config FILE.toml [section.key=value ...]``: run training on the launched ranks."""
from __future__ import annotations

from hpctrain.runtime import env


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a GPT with data, tensor and pipeline parallelism",
                       description="Train on the ranks started by mpiexec/srun. Any config key can be "
                                   "overridden as section.key=value (e.g. parallel.tp=2 train.steps=10).")
    p.add_argument("--config", help="TOML config (default: built-in defaults, tiny GPT)")
    p.add_argument("--resume", default=None, metavar="auto|PATH|none",
                   help="auto: newest complete checkpoint of the run (default inside a batch job); PATH: a "
                        "checkpoint directory; none: start fresh, setting an earlier run's files aside in "
                        "RUN_DIR/superseded/. Not given outside a batch job: start fresh, but refuse a run "
                        "directory that holds checkpoints")
    p.add_argument("--max-steps", type=int, default=0, metavar="N",
                   help="run at most N steps in this invocation, checkpoint and exit (job chains); 0 = no limit")
    p.add_argument("--verbose", action="store_true",
                   help="rank 0 prints the first step's time by phase and torch.compile's graphs, graph breaks "
                        "and their reasons (train.compile)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=run)


def run(args) -> int:
    """Parse the config (identical on every rank, so errors are raised everywhere) and train."""
    import sys

    from hpctrain.runtime.stale_shm import remove_stale_mpich_segments

    for path in remove_stale_mpich_segments():  # before MPI starts (runtime/stale_shm.py)
        print(f"hpctrain: removed {path}: MPICH's shared memory of a killed earlier attempt of this Slurm job "
              f"step, which this attempt would attach to", file=sys.stderr, flush=True)
    import torch

    from hpctrain.runtime.launcher import import_mpi

    import_mpi()  # initialised first: a config error then names its rank and ends the job

    from hpctrain.config import load_config
    from hpctrain.train.loop import run_training
    from hpctrain.train.run_dir import default_resume

    torch.set_num_threads(env.omp_num_threads())
    cfg = load_config(args.config, args.overrides)
    return run_training(cfg, args.resume or default_resume(), args.max_steps,
                        early_signals=getattr(args, "early_signals", None), verbose=args.verbose)
