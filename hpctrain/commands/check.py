"""``hpctrain check --config X [--ranks R | --nodes N --gpus-per-node G] [--device NAME] [--resume auto|PATH]
[section.key=value ...]``: every problem that would stop the run at start-up, listed before it queues.

One process, no MPI, no launch (``hpctrain/train/preflight.py``). Exit 0 with a summary (layout, memory per
rank, tokens per step), or 2 listing every problem. ``slurm/train.sbatch`` runs it first (``HPCTRAIN_CHECK``).

    hpctrain check --config configs/tiny.toml --ranks 8 parallel.tp=4 parallel.pp=2
    hpctrain check --config configs/llama3-8b.toml --nodes 2 --gpus-per-node 4 --device h100 --resume auto
"""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="check a run's config, layout, memory, data and resume before launching it",
                       description="Everything a run's start checks, in one process and without a launch: the "
                                   "config's rules, the layout on the given ranks, memory per rank against the "
                                   "device, the corpus, the checkpoint a resume would load. Exit 0 (with a "
                                   "summary) or 2 (every problem listed).")
    p.add_argument("--config", help="TOML config (default: built-in defaults, tiny GPT)")
    p.add_argument("--ranks", type=int, default=0, help="ranks the job will launch (default: dp x pp x cp x tp "
                                                        "of the config, dp 0 counted as 1)")
    p.add_argument("--nodes", type=int, default=0, help="nodes of the job (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="ranks per node: tp groups must stay inside one")
    p.add_argument("--device", default="", help="device preset for the memory verdict, as `hpctrain plan`: a100, "
                                                "h100, h200, mi250x, mi250x-gcd, v100")
    p.add_argument("--resume", default=None, metavar="auto|PATH|none",
                   help="check the checkpoint the run would resume from against the config")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=run)


def run(args) -> int:
    from hpctrain.config.load import read_config
    from hpctrain.train.preflight import check_job

    ranks = _ranks(args)
    device = None
    if args.device:
        from hpctrain.plan.devices import device_preset

        device = device_preset(args.device)
        if device.memory_gib is None:  # the host's memory, shared: no per-rank verdict from a preset
            device = None
    cfg = read_config(args.config, args.overrides)
    if not ranks:
        p = cfg.parallel
        ranks = max(p.dp, 1) * p.tp * p.pp * p.cp
    report = check_job(cfg, ranks, args.gpus_per_node, device, args.resume)
    for line in report.summary:
        print(f"hpctrain check: {line}")
    for line in report.warnings:
        print(f"hpctrain check: WARNING: {line}")
    if report.ok:
        print(f"hpctrain check: OK: {args.config or 'the default config'} can start on {ranks} ranks")
        return 0
    print(f"hpctrain check: {len(report.problems)} problem(s) would stop this run at start-up:", file=sys.stderr)
    for line in report.problems:
        print(f"  - {line}", file=sys.stderr)
    return 2


def _ranks(args) -> int:
    """--ranks, or --nodes x --gpus-per-node; both given: they must agree."""
    from hpctrain.errors import HpcTrainError

    if args.nodes < 0 or args.gpus_per_node < 0 or args.ranks < 0:
        raise HpcTrainError("check: --ranks, --nodes and --gpus-per-node must be >= 0")
    if args.nodes and not args.gpus_per_node:
        raise HpcTrainError("check: --nodes needs --gpus-per-node (ranks per node)")
    from_nodes = args.nodes * args.gpus_per_node
    if args.ranks and from_nodes and args.ranks != from_nodes:
        raise HpcTrainError(f"check: --ranks {args.ranks} disagrees with --nodes {args.nodes} x "
                            f"--gpus-per-node {args.gpus_per_node} = {from_nodes}")
    return args.ranks or from_nodes
