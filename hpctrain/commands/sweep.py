"""``hpctrain sweep``: run a scaling study, collect every run into one CSV, and plot it.

    hpctrain sweep --config configs/tiny.toml --ranks 1,2,4 --layouts auto --mode weak --steps 10
    hpctrain sweep --config my.toml --ranks 8,16,32 --layouts "tp=4,pp=1;tp=4,pp=2" --launcher sbatch \\
        --ranks-per-node 4 --sbatch-arg=--account=PROJ --out runs/study

Each (ranks, layout) is one ``hpctrain train`` run in ``OUT/<name>`` (``r4-dp2-tp2-pp1-mb1``); runs run
one after another with mpiexec on this machine, or are all submitted as Slurm jobs
(``slurm/scaling_study.sbatch``). Then ``OUT/sweep.csv`` (one row per run: layout, measured step time,
tokens/s, compute / exposed communication / bubble, efficiency, and the performance model's
prediction where it has one) and ``OUT/throughput.png``, ``efficiency.png``, ``breakdown.png``.
``--resume`` reuses the finished runs of an earlier sweep into the same OUT (an unfinished run's
directory is renamed aside, never deleted); without it an existing run directory is an error.
With sbatch, a job that never starts (``--start-timeout`` seconds running without getting through MPI's
start-up, or failed before its first step other than with hpctrain's exit 2) is cancelled and resubmitted, up to ``--resubmits``
times, each said in the output; a run that started and is slow is never cut short before ``--timeout``.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

FIELDS = ["name", "ranks", "nodes", "dp", "tp", "pp", "microbatches", "global_batch", "status", "steps", "step_s",
          "tokens_per_s", "speedup", "efficiency", "compute_s", "comm_s", "bubble_s", "bytes_sent", "final_loss",
          "predicted_step_s", "predicted_tokens_per_s", "predicted_compute_s", "predicted_comm_s",
          "predicted_bubble_s", "prediction_error", "peak_memory_gib", "predicted_memory_gib"]


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="scaling study: run layouts x rank counts, CSV and plots",
                       description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the run's TOML config (every run starts from it)")
    p.add_argument("--ranks", default="1,2,4", help="comma list of rank counts (default 1,2,4)")
    p.add_argument("--layouts", default="auto",
                   help='auto (every valid tp x pp) or "tp=2,pp=1;tp=1,pp=2,mb=4" (dp = ranks / (tp*pp))')
    p.add_argument("--mode", default="weak", choices=("weak", "strong"),
                   help="weak: global batch grows with the ranks (the config's at the smallest count); "
                        "strong: fixed global batch")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    p.add_argument("--launcher", default="mpiexec", choices=("mpiexec", "sbatch"))
    p.add_argument("--out", default="runs/sweep", help="output directory (default runs/sweep)")
    p.add_argument("--resume", action="store_true", help="reuse the finished runs already in --out")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds per run with mpiexec (default 600), for all jobs with sbatch (default 3600)")
    p.add_argument("--start-timeout", type=float, default=600,
                   help="sbatch: a job running this many seconds whose ranks never got through MPI's start-up "
                        "(no run-directory lock, no step) is cancelled and resubmitted (default 600)")
    p.add_argument("--resubmits", type=int, default=2,
                   help="sbatch: how often a run whose job never started is resubmitted (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks per node: sbatch --nodes/--ntasks-per-node from it; mpiexec -ppn (MPICH/hydra)")
    p.add_argument("--sbatch-arg", action="append", default=[], help="sbatch: an extra sbatch option (repeat)")
    p.add_argument("--mpiexec", default="", help="mpiexec: the launcher (default: the venv's, else PATH)")
    p.add_argument("--device", default="cpu", help="the performance model's device preset (default cpu)")
    p.add_argument("--profile", default="", help="the model's link profile (hpctrain bench comm --profile)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hpctrain.config import load_config
    from hpctrain.sweep.runs import SweepError, add_efficiency, parse_layouts, parse_ranks, plan_runs, summarize

    cfg = load_config(args.config, list(args.overrides))
    runs, skipped = plan_runs(cfg, parse_ranks(args.ranks), parse_layouts(args.layouts), args.mode)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    print(f"sweep: {len(runs)} runs ({args.mode} scaling, {args.steps} steps each) into {out}", flush=True)
    for reason in skipped:
        print(f"  skipped {reason}", flush=True)
    todo, finished = [], {}
    for run in runs:
        run_dir = os.path.join(out, run.name)
        if os.path.exists(run_dir):
            if not args.resume:
                raise SweepError(f"{run_dir} exists (an earlier sweep?): pass --resume to reuse its finished "
                                 f"runs, or choose another --out")
            if os.path.exists(os.path.join(run_dir, "summary.json")):
                finished[run.name] = "ok"
                continue
            os.rename(run_dir, _aside(run_dir))
        train_args = ["--config", os.path.abspath(args.config), *args.overrides, *run.overrides(),
                      f"train.steps={args.steps}", f"train.run_dir={run_dir}", "train.progress=false"]
        todo.append((run, run_dir, train_args))
    results = dict(finished)
    results.update(_launcher(args).run_all(todo, lambda line: print(f"sweep: {line}", flush=True)))
    rows = []
    for run in runs:
        row = summarize(run, os.path.join(out, run.name), args.warmup)
        if results.get(run.name, "ok") != "ok":
            row["status"] = results[run.name]
        rows.append(row)
        print(f"sweep: {run.name}: " + (f"{1e3 * row['step_s']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s"
                                        if row["status"] == "ok" else row["status"]), flush=True)
    add_efficiency(rows, args.mode)
    _add_predictions(rows, cfg, args)
    _write(rows, out, args)
    bad = [r for r in rows if r["status"] != "ok"]
    return 1 if bad else 0


def _aside(path: str) -> str:
    n = 1
    while os.path.exists(f"{path}.incomplete-{n}"):
        n += 1
    return f"{path}.incomplete-{n}"


def _launcher(args):
    from hpctrain.sweep.launch import MpiexecLauncher, SbatchLauncher
    from hpctrain.sweep.runs import SweepError

    if args.launcher == "sbatch":
        if args.start_timeout <= 0 or args.resubmits < 0:
            raise SweepError(f"--start-timeout must be > 0 and --resubmits >= 0 (got {args.start_timeout:g} and "
                             f"{args.resubmits})")
        return SbatchLauncher(args.timeout or 3600, args.ranks_per_node, args.sbatch_arg,
                              start_timeout_s=args.start_timeout, resubmits=args.resubmits)
    return MpiexecLauncher(args.mpiexec or "mpiexec", args.timeout or 600, ranks_per_node=args.ranks_per_node)


def _add_predictions(rows: list[dict], cfg, args) -> None:
    """The performance model's step time for each run's layout (hpctrain/plan), where it can tell."""
    try:
        from hpctrain.sweep.predict import predict_run
    except ImportError:
        return
    for row in rows:
        prediction = predict_run(cfg, row, device=args.device, profile=args.profile or None)
        if prediction:
            row.update(prediction)
            if row["status"] == "ok" and row.get("predicted_step_s"):
                row["prediction_error"] = row["predicted_step_s"] / row["step_s"] - 1


def _write(rows: list[dict], out: str, args) -> None:
    from hpctrain.sweep.plots import write_plots

    path = os.path.join(out, "sweep.csv")
    with open(path + ".tmp", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump({"mode": args.mode, "config": os.path.abspath(args.config), "overrides": args.overrides,
                   "steps": args.steps, "rows": rows}, f, indent=1)
    title = f"{Path(args.config).stem}, {args.mode} scaling"
    plots = write_plots(rows, out, title)
    print(f"sweep: {path}" + "".join(f"\nsweep: {p}" for p in plots), flush=True)
