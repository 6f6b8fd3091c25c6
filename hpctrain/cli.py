"""The ``hpctrain`` command: thin argument parsing that calls into the package.

Subcommands: ``info`` (launch and grid report), ``bench comm`` (collective benchmark),
``train`` (training), ``ckpt`` (checkpoint tools), ``trace`` (where a traced run's time went), ``export`` /
``import-hf`` / ``import-peft`` (Hugging Face Llama and Mistral models, PEFT LoRA adapters), ``runs`` (runs
that publish metrics), ``check`` (a run's start-up checks before it is launched), ``plan``, ``sweep``, ``data``,
``generate``. Run them under ``mpiexec``/``srun`` for
many ranks. Each subcommand's parser and runner is a module of ``hpctrain/commands/``; this module is the
entry point (the ``hpctrain`` console script, ``python -m hpctrain.cli``) and its dispatch.
"""
from __future__ import annotations

import argparse
import functools
import sys

from hpctrain.runtime import env
from hpctrain.runtime.errors_exit import run_and_exit


def build_parser() -> argparse.ArgumentParser:
    from hpctrain.commands import (bench, check, checkpoint, data, info, interop, monitor, plan, profiling, sweep,
                                   tools, train)  # here, not at the top: `main` records signals first

    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (info, bench, check, train, checkpoint, profiling, sweep, data, tools, interop, plan, monitor):
        command.add_parser(sub)  # in this order in `hpctrain --help`
    return parser


def dispatch(argv, early_signals=None) -> int:
    """Run one ``hpctrain`` command in this process and return its exit code; errors are raised, not
    printed (``main`` prints them and ends the job). Public for tests and embedding."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `train` takes section.key=value overrides anywhere on the line, also after options
        if getattr(args, "overrides", None) is None or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    args.early_signals = early_signals  # hpctrain train: the SignalFlag made before the imports
    return args.func(args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    early = None
    if argv[:1] == ["train"]:  # before any heavy import: a scheduler's signal during start-up is recorded
        from hpctrain.runtime.signals import DEFAULT_EXIT_SIGNALS, SignalFlag

        early = SignalFlag(DEFAULT_EXIT_SIGNALS)
    if argv[:1] in (["train"], ["bench"], ["info"]) and not {"-h", "--help"} & set(argv):
        from hpctrain.comm.shm_memory import too_small_for_mpi

        problem = too_small_for_mpi()
        if problem:  # said by the node's first rank, where the launcher tells; nothing else runs
            if env.launcher_local_rank() in (None, "0"):
                print(f"hpctrain: error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)
    sys.exit(run_and_exit(functools.partial(dispatch, early_signals=early), argv))


if __name__ == "__main__":
    main()
