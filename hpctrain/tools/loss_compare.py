"""Train twice, compare the loss curves step by step (like torchtitan's ``scripts/loss_compare.py``).

    python -m hpctrain.tools.loss_compare --a "2:parallel.dp=2" --b "2:parallel.tp=2" \\
        --overrides "train.dtype=float64 data.max_bytes=300000" --steps 10 --rtol 1e-9

Each side is ``NP:OVERRIDES``: the number of ranks and space-separated ``section.key=value`` overrides
of ``hpctrain train``. The tool runs ``<launcher> -n NP python -m hpctrain.cli train [--config FILE]
<--overrides> <side's overrides> train.run_dir=<dir>/a|b [train.steps=N]`` for A, then for B, each in
a fresh run directory (under a temporary directory removed on success, or under ``--out DIR``,
replacing an earlier comparison there) with a timeout, reads both ``metrics.jsonl`` and prints one
row per step: loss A, loss B, absolute and relative difference.

Steps agree when ``|a - b| <= atol + rtol * max(|a|, |b|)``. Exit status: 0 if every step agrees,
1 if one does not (the message names the first such step) or a step is missing from one run, 2 if a
run failed, timed out, or the arguments are wrong.

``--metrics A.jsonl B.jsonl`` compares two existing metrics files without training.

Tolerance mode, ``--final K``: compare only the mean of the last K steps of each run (a convergence
check, e.g. a compressed run against the dense one: ``--final 5 --rtol 0.02``), not every step.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpctrain.tools.runs import CompareError, parse_run_spec, resolve_launcher, run_side, side_command

EXIT_MATCH, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


def read_metrics(path: str | Path, key: str = "loss") -> dict[int, float]:
    """step -> value of ``key`` from a metrics.jsonl (a step logged twice, e.g. after a resume: the last)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CompareError(f"cannot read metrics file {path}: {exc.strerror or exc}") from None
    values: dict[int, float] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "event" in record:  # {"event": "stop", ...} lines are not steps
                continue
            value = record[key]  # null: a non-finite value (metrics.jsonl is strict JSON)
            values[int(record["step"])] = math.nan if value is None else float(value)
        except (ValueError, KeyError, TypeError) as exc:
            raise CompareError(f"{path}:{number}: not a metrics record with 'step' and {key!r} ({exc})") from None
    if not values:
        raise CompareError(f"{path} has no steps")
    return values


@dataclass
class Row:
    step: int
    a: float | None
    b: float | None
    abs_diff: float | None
    rel_diff: float | None
    ok: bool


def compare(a: dict[int, float], b: dict[int, float], rtol: float, atol: float) -> list[Row]:
    rows = []
    for step in sorted(set(a) | set(b)):
        va, vb = a.get(step), b.get(step)
        if va is None or vb is None:
            rows.append(Row(step, va, vb, None, None, False))
            continue
        if not (math.isfinite(va) and math.isfinite(vb)):
            same = va == vb or (math.isnan(va) and math.isnan(vb))
            rows.append(Row(step, va, vb, None, None, same))
            continue
        diff = abs(va - vb)
        scale = max(abs(va), abs(vb))
        rel = diff / scale if scale > 0 else 0.0
        rows.append(Row(step, va, vb, diff, rel, diff <= atol + rtol * scale))
    return rows


def first_bad(rows: list[Row]) -> Row | None:
    return next((r for r in rows if not r.ok), None)


def describe_failure(row: Row, names: tuple[str, str], rtol: float, atol: float) -> str:
    if row.a is None or row.b is None:
        missing = names[0] if row.a is None else names[1]
        return f"step {row.step} is missing from {missing}"
    if row.abs_diff is None:
        return f"step {row.step}: {row.a!r} vs {row.b!r} (non-finite)"
    return (f"step {row.step}: {row.a:.12g} vs {row.b:.12g}, abs diff {row.abs_diff:.3e}, rel diff "
            f"{row.rel_diff:.3e} > rtol {rtol:g} (atol {atol:g})")


def _visible_rows(rows: list[Row], max_rows: int) -> list[Row | None]:
    """At most about ``max_rows`` rows: head, tail and every failing row; None marks a gap."""
    if max_rows <= 0 or len(rows) <= max_rows:
        return list(rows)
    keep = set(range(max_rows // 2)) | set(range(len(rows) - max_rows // 2, len(rows)))
    keep |= {i for i, r in enumerate(rows) if not r.ok}
    out: list[Row | None] = []
    previous = -1
    for i in sorted(keep):
        if i != previous + 1:
            out.append(None)
        out.append(rows[i])
        previous = i
    return out


def print_table(rows: list[Row], names: tuple[str, str], metric: str, title: str, max_rows: int, console) -> None:
    from rich.table import Table

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    table = Table(title=title)
    table.add_column("step", justify="right")
    table.add_column(f"{metric} {names[0]}", justify="right")
    table.add_column(f"{metric} {names[1]}", justify="right")
    table.add_column("abs diff", justify="right")
    table.add_column("rel diff", justify="right")
    table.add_column("", justify="left")
    for row in _visible_rows(rows, max_rows):
        if row is None:
            table.add_row("...", "", "", "", "", "")
            continue
        table.add_row(str(row.step), fmt(row.a, ".10g"), fmt(row.b, ".10g"), fmt(row.abs_diff, ".3e"),
                      fmt(row.rel_diff, ".3e"), "ok" if row.ok else "[bold red]DIFF[/bold red]")
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpctrain.tools.loss_compare",
        description="Run `hpctrain train` twice (A and B) and compare their losses step by step, or compare "
                    "two existing metrics.jsonl files. Exit 0: all steps agree; 1: a step differs; 2: error.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m hpctrain.tools.loss_compare --a '2:parallel.dp=2' --b '2:parallel.tp=2' \\\n"
               "      --overrides 'train.dtype=float64 data.max_bytes=300000' --steps 10 --rtol 1e-9")
    p.add_argument("--a", metavar="NP:OVERRIDES", help="run A: ranks and space-separated section.key=value")
    p.add_argument("--b", metavar="NP:OVERRIDES", help="run B (the same form)")
    p.add_argument("--metrics", nargs=2, metavar=("A.jsonl", "B.jsonl"),
                   help="compare two existing metrics files instead of training")
    p.add_argument("--config", help="TOML config for both runs (default: built-in defaults)")
    p.add_argument("--overrides", default="", metavar="'K=V ...'",
                   help="overrides applied to both runs, before each run's own")
    p.add_argument("--steps", type=int, help="train.steps for both runs (default: the config's)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--metric", default="loss", help="metrics field to compare (default loss)")
    p.add_argument("--final", type=int, default=0, metavar="K",
                   help="tolerance mode: compare the mean of the last K steps only (convergence; default 0 = "
                        "every step)")
    p.add_argument("--launcher", default="mpiexec",
                   help="launcher command, called as '<launcher> -n NP python ...' (default mpiexec: the one "
                        "beside this Python first, then PATH)")
    p.add_argument("--out", metavar="DIR", help="keep the runs in DIR/a and DIR/b, replacing an earlier "
                                                "comparison's (default: a temporary directory, removed "
                                                "afterwards)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed (default 600)")
    p.add_argument("--max-rows", type=int, default=200,
                   help="longest table printed; longer comparisons show head, tail and differing steps "
                        "(0 = all; default 200)")
    return p


def main(argv=None) -> int:
    from rich.console import Console

    console = Console()
    err = Console(stderr=True)
    args = build_parser().parse_args(argv)
    try:
        return _main(args, console)
    except CompareError as exc:
        err.print(f"loss_compare: error: {exc}", highlight=False, markup=False, soft_wrap=True)
        return EXIT_ERROR


def _main(args, console) -> int:
    if args.rtol < 0 or args.atol < 0:
        raise CompareError("--rtol and --atol must be >= 0")
    if args.metrics:
        if args.a or args.b:
            raise CompareError("give either --metrics A.jsonl B.jsonl or --a and --b, not both")
        paths = args.metrics
        names = ("A", "B")
        title = f"{args.metric}: A = {paths[0]}, B = {paths[1]}"
    else:
        if not (args.a and args.b):
            raise CompareError("give --a NP:OVERRIDES and --b NP:OVERRIDES (or --metrics A.jsonl B.jsonl)")
        if args.steps is not None and args.steps < 1:
            raise CompareError(f"--steps must be >= 1, got {args.steps}")
        if args.timeout <= 0:
            raise CompareError(f"--timeout must be > 0, got {args.timeout}")
        specs = [parse_run_spec("A", args.a), parse_run_spec("B", args.b)]
        common = shlex.split(args.overrides)
        launcher = resolve_launcher(args.launcher)
        temporary = not args.out
        out = Path(tempfile.mkdtemp(prefix="hpctrain-loss-compare-")) if temporary else Path(args.out).resolve()
        paths = []
        for spec in specs:  # one after the other: both may want every core
            run_dir = out / spec.label.lower()
            cmd = side_command(launcher, spec, run_dir, args.config, common, args.steps)
            run_side(cmd, run_dir, args.timeout, spec.label, console)  # a failure keeps the logs
            paths.append(run_dir / "metrics.jsonl")
        values = [read_metrics(p, args.metric) for p in paths]
        if temporary:
            shutil.rmtree(out, ignore_errors=True)
        names = ("A", "B")
        title = (f"{args.metric}: A = {specs[0].nprocs} ranks {' '.join(specs[0].overrides) or '(no overrides)'}; "
                 f"B = {specs[1].nprocs} ranks {' '.join(specs[1].overrides) or '(no overrides)'}")
        return _report(values[0], values[1], names, title, args, console)
    return _report(read_metrics(paths[0], args.metric), read_metrics(paths[1], args.metric), names, title, args,
                   console)


def _report(a, b, names, title, args, console) -> int:
    if args.final:
        return _report_final(a, b, args, console)
    rows = compare(a, b, args.rtol, args.atol)
    print_table(rows, names, args.metric, title, args.max_rows, console)
    bad = first_bad(rows)
    n_bad = sum(1 for r in rows if not r.ok)
    if bad is None:
        worst = max((r.rel_diff for r in rows if r.rel_diff is not None), default=0.0)
        console.print(f"MATCH: all {len(rows)} steps agree (max rel diff {worst:.3e}, rtol {args.rtol:g}, "
                      f"atol {args.atol:g})", highlight=False)
        return EXIT_MATCH
    console.print(f"MISMATCH: {n_bad} of {len(rows)} steps differ; first at "
                  f"{describe_failure(bad, names, args.rtol, args.atol)}", highlight=False, soft_wrap=True)
    return EXIT_MISMATCH


def final_mean(values: dict[int, float], k: int) -> float:
    last = [values[s] for s in sorted(values)[-k:]]
    return sum(last) / len(last)


def _report_final(a, b, args, console) -> int:
    if args.final < 1:
        raise CompareError(f"--final must be >= 1, got {args.final}")
    if max(a) != max(b):
        raise CompareError(f"the runs end at different steps ({max(a)} and {max(b)})")
    ma, mb = final_mean(a, args.final), final_mean(b, args.final)
    diff, scale = abs(ma - mb), max(abs(ma), abs(mb))
    ok = diff <= args.atol + args.rtol * scale
    console.print(f"{'MATCH' if ok else 'MISMATCH'}: mean {args.metric} of the last {args.final} steps: "
                  f"A {ma:.6g}, B {mb:.6g}, rel diff {diff / scale if scale else 0.0:.3e} "
                  f"({'<=' if ok else '>'} rtol {args.rtol:g}, atol {args.atol:g})", highlight=False)
    return EXIT_MATCH if ok else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
