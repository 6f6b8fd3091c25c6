"""Shared by every benchmark: write records as JSON and CSV, and run an MPI benchmark's main safely."""
from __future__ import annotations

import csv
import json
import sys


def write_records(records: list[dict], json_path: str | None, csv_path: str | None, fields,
                  json_columns: tuple[str, ...] = ()) -> None:
    """``records`` to ``json_path`` (a JSON list) and ``csv_path`` (columns ``fields``; the nested values of
    ``json_columns`` JSON-encoded in their cell). Either path may be None."""
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
            f.write("\n")
    if csv_path:
        columns = list(fields) + [c for c in json_columns if c not in fields]
        with open(csv_path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            for r in records:
                writer.writerow({**r, **{c: json.dumps(r[c]) for c in json_columns if c in r}})


def resident_mb(field: str = "VmHWM", reset: bool = False) -> float:
    """This process's peak ("VmHWM") or current ("VmRSS") resident memory in MiB; ``reset``: start a new
    peak first (Linux: /proc/self/clear_refs). NaN where /proc/self/status has no such line."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_benchmark(main) -> None:
    """``sys.exit(main())``, but an exception on one rank aborts the whole MPI job (never a hang)."""
    from hpctrain.runtime.errors_exit import run_and_exit

    sys.exit(run_and_exit(lambda _argv: main()))


def timed_steps(impl, n: int, world) -> list[float]:
    """Run ``impl.step()`` n times on every rank of ``world`` (an mpi4py communicator); each step's time is
    the max over ranks, from a barrier to its end."""
    import time

    from mpi4py import MPI

    times = []
    for _ in range(n):
        world.Barrier()
        start = time.perf_counter()
        impl.step()
        times.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return times


def timed_rounds(impls, rounds: int, steps: int, world, activate, after_round=None) -> dict[str, list[float]]:
    """``rounds`` rounds of ``steps`` timed steps of every impl in turn, the order rotated each round (so no
    implementation always runs first); ``activate(impl, on)`` brackets an impl's timed steps (its phase
    timers), ``after_round(rnd, times)`` runs after each. Returns {impl.name: step seconds}."""
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for rnd in range(rounds):
        k = rnd % len(impls)
        for impl in impls[k:] + impls[:k]:
            activate(impl, True)
            times[impl.name] += timed_steps(impl, steps, world)
            activate(impl, False)
        if after_round is not None:
            after_round(rnd, times)
    return times
