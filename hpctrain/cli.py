"""The ``hpctrain`` command: thin argument parsing that calls into the package.

Subcommands: ``info`` (launch and grid report), ``bench comm`` (collective benchmark),
``train`` (training), ``ckpt`` (checkpoint tools), ``trace`` (where a traced run's time went), ``export`` /
``import-hf`` / ``import-peft`` (Hugging Face Llama and Mistral models, PEFT LoRA adapters), ``runs`` (runs
that publish metrics). Run them under
``mpiexec``/``srun`` for many ranks.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import sys

from hpctrain.runtime.dtypes import DTYPE_NAMES
from hpctrain.runtime.errors_exit import run_and_exit


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="describe the launch, MPI library, nodes and the dp x pp x cp x tp grid")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default world/(tp*pp*cp))")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"],
                   help="pipeline schedule, for the bubble report (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pp rank (interleaved: >= 2)")
    p.add_argument("--microbatches", type=int, default=0, help="micro-batches per step (default: pp)")
    p.add_argument("--strict-placement", action="store_true", help="error if a tp group spans nodes")
    p.add_argument("--intra-node", default="auto", choices=["auto", "shm", "mpi"],
                   help="comm.intra_node: report how the dp group would reduce CPU float sums (default auto, as training)")
    p.add_argument("--json", action="store_true", help="print one JSON document on rank 0")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    from hpctrain.tools.info import run_info

    return run_info(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, strict=args.strict_placement,
                    as_json=args.json,
                    schedule=args.schedule, virtual_stages=args.virtual_stages, microbatches=args.microbatches,
                    intra_node=args.intra_node)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_what", required=True)
    c = bsub.add_parser("comm", help="collective benchmark: hpctrain vs raw mpi4py vs torch.distributed gloo")
    c.add_argument("--ops", default="allreduce,reduce_scatter,allgather,broadcast",
                   help="comma list of allreduce, reduce_scatter, allgather, broadcast, sendrecv")
    c.add_argument("--sizes", default=None,
                   help="comma list of total buffer sizes, binary K/M/G suffixes (default 1K,64K,1M,16M; "
                        "with --profile 4K,64K,256K,1M,4M,16M)")
    c.add_argument("--axis", default="world", choices=["world", "dp", "pp", "tp"],
                   help="group to run on (default world)")
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--pp", type=int, default=1)
    c.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    c.add_argument("--impls", default="hpctrain,mpi4py,gloo", help="comma list of hpctrain, hpctrain-persistent, hpctrain-shm, mpi4py, gloo")
    c.add_argument("--iters", type=int, default=0,
                   help="timed iterations per size (0 = by size: 200 at <= 1M down to 5 at >= 64M)")
    c.add_argument("--rounds", type=int, default=3, help="rounds per size; the best round is reported (default 3)")
    c.add_argument("--json", metavar="FILE", help="write records to FILE (JSON list)")
    c.add_argument("--csv", metavar="FILE", help="write records to FILE (CSV)")
    c.add_argument("--comm-timeout", type=float, default=120.0,
                   help="seconds one collective may wait before the job ends with a hang report naming the "
                        "rank it waits for (default 120)")
    c.add_argument("--profile", metavar="OUT.json",
                   help="instead: fit latency and bandwidth per link level (intra-node, inter-node) and per "
                        "collective, write them to OUT.json (input of `hpctrain plan --profile`)")
    c.set_defaults(func=_run_bench_comm)


def _run_bench_comm(args) -> int:
    if args.profile:
        from hpctrain.bench.profile import run_link_profile

        return run_link_profile(args)
    from hpctrain.bench.comm import run_comm_bench

    args.sizes = args.sizes or "1K,64K,1M,16M"
    return run_comm_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_info(sub)
    _add_bench(sub)
    for extra in ("hpctrain.train.cli", "hpctrain.checkpoint.cli", "hpctrain.profiling.cli",
                  "hpctrain.sweep.cli", "hpctrain.data.cli", "hpctrain.tools.cli", "hpctrain.interop.cli",
                  "hpctrain.plan.cli", "hpctrain.monitor.cli"):
        if importlib.util.find_spec(extra) is not None:  # subcommands of later layers
            importlib.import_module(extra).add_parser(sub)
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
    sys.exit(run_and_exit(functools.partial(dispatch, early_signals=early), argv))


if __name__ == "__main__":
    main()
