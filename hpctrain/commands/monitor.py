"""``hpctrain runs [DIR ...] [--json] [--file-sd FILE]``: the runs that publish metrics (monitor/live_runs.py)."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("runs", help="list the runs under DIRs that publish metrics ([monitor]), and where",
                       description="List every run directory under DIR (default: runs) with a monitor.json: its "
                                   "status, last step, metrics URL or textfile and labels.")
    p.add_argument("dirs", nargs="*", default=["runs"], metavar="DIR")
    p.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    p.add_argument("--file-sd", metavar="FILE",
                   help="also write a Prometheus file_sd_configs target file with the runs that serve a port")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import json

    from hpctrain.monitor.live_runs import file_sd, find_runs, write_atomically

    runs = find_runs(args.dirs)
    if args.file_sd:
        targets = file_sd(runs)
        write_atomically(args.file_sd, json.dumps(targets, indent=1) + "\n")
    if args.json:
        print(json.dumps(runs, indent=1))
        return 0
    if not runs:
        print(f"no runs with a monitor.json under {', '.join(args.dirs)} (turn on [monitor]: docs/monitoring.md)")
    for r in runs:
        where = r.get("url") or r.get("textfile") or r.get("tensorboard") or "-"
        print(f"{r['dir']}  {r['status']:<9} step {r['step'] if r['step'] is not None else '-':<7} "
              f"job {r.get('job_id') or '-':<10} {where}")
    if args.file_sd:
        print(f"{len(targets)} scrape target(s) written to {args.file_sd}")
    return 0
