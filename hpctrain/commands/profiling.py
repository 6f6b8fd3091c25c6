"""``hpctrain trace RUN_DIR``: merge a run's per-rank traces and print where each rank's time went."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="merge a run's per-rank traces (train.trace=true) and say where the time went")
    p.add_argument("run_dir", help="the run directory (holds trace/rankRRRRR.json)")
    p.add_argument("--json", action="store_true", help="print the per-rank breakdown as JSON")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hpctrain.profiling.report import run_trace_report

    return run_trace_report(args.run_dir, as_json=args.json)
