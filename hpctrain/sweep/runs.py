"""What a scaling sweep runs and what it reads back (no MPI, no launching: launch.py does that).

``plan_runs`` expands ranks x layouts into ``SweepRun``s, validating each with ``Layout`` (the one place
for layout rules) and giving the reason for every combination it skips. ``summarize`` turns a finished
run's metrics.jsonl into one CSV row: median step time and tokens/s over the steps after the warm-up,
and the mean phase breakdown (``time_s``) folded into compute, exposed communication and bubble.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
from dataclasses import dataclass, field

from hpctrain.errors import HpcTrainError
from hpctrain.config.layout import Layout, divisors
from hpctrain.profiling.timers import BETWEEN_STEPS

# how metrics.jsonl phases fold into the sweep's breakdown (hpctrain/profiling/timers.py names them)
COMM_PHASES = ("dp_wait", "loss", "grad_norm")
BUBBLE_PHASES = ("pp_wait", "pp_drain")


class SweepError(HpcTrainError):
    """A sweep request that cannot run (bad --ranks / --layouts, nothing feasible)."""


@dataclass(frozen=True)
class SweepRun:
    ranks: int
    tp: int
    pp: int
    dp: int
    microbatches: int
    global_batch: int
    name: str = field(default="")

    def overrides(self) -> list[str]:
        """``hpctrain train`` overrides that make this run (the sweep sets the micro-batch COUNT, so a
        config's ``train.micro_batch_size`` is reset to 0 = derived from it)."""
        return [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                f"parallel.microbatches={self.microbatches}", "train.micro_batch_size=0",
                f"train.global_batch={self.global_batch}"]


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise SweepError(f"--ranks {text!r}: expected a comma list of rank counts, e.g. 1,2,4,8") from None
    if not ranks or min(ranks) < 1:
        raise SweepError(f"--ranks {text!r}: rank counts must be >= 1")
    return sorted(set(ranks))


def parse_layouts(text: str) -> list[dict] | None:
    """``auto`` -> None (every valid layout); else ``tp=2,pp=1;tp=1,pp=2,mb=4`` -> [{tp, pp, mb}, ...]."""
    if text.strip() == "auto":
        return None
    layouts = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        spec = {"tp": 1, "pp": 1, "mb": 0}
        for pair in item.split(","):
            key, _, value = pair.partition("=")
            if key.strip() not in spec or not value.strip().isdigit() or int(value) < (0 if key == "mb" else 1):
                raise SweepError(f"--layouts item {item!r}: expected tp=N,pp=M[,mb=K] (N, M >= 1), got {pair!r}")
            spec[key.strip()] = int(value)
        layouts.append(spec)
    if not layouts:
        raise SweepError(f"--layouts {text!r}: give auto or items like tp=2,pp=1;tp=1,pp=2")
    return layouts


def plan_runs(cfg, ranks: list[int], layouts: list[dict] | None, mode: str) -> tuple[list[SweepRun], list[str]]:
    """Every (ranks, layout) to run, and why the others are skipped. ``mode``: ``weak`` scales the global
    batch with the ranks (cfg's batch at the smallest rank count), ``strong`` keeps it. ``mb=0`` (and auto)
    means pp micro-batches per stage (1 without pp)."""
    if mode not in ("weak", "strong"):
        raise SweepError(f"--mode {mode!r}: choose weak or strong")
    runs, skipped = [], []
    for world in ranks:
        batch = cfg.train.global_batch * world // ranks[0] if mode == "weak" else cfg.train.global_batch
        candidates = layouts or [{"tp": tp, "pp": pp, "mb": 0} for tp in divisors(world)
                                 for pp in divisors(world // tp)]
        for spec in candidates:
            tp, pp = spec["tp"], spec["pp"]
            mb = spec["mb"] or (2 * pp if pp > 1 else 1)
            trial = copy.deepcopy(cfg)
            trial.parallel.dp, trial.parallel.tp, trial.parallel.pp = 0, tp, pp
            trial.parallel.microbatches, trial.train.global_batch = mb, batch
            trial.train.micro_batch_size = 0  # the sweep's mb is the micro-batch count (overrides() says so)
            label = f"{world} ranks tp={tp} pp={pp} mb={mb}"
            try:
                layout = Layout.from_config(trial, world)
            except HpcTrainError as exc:
                skipped.append(f"{label}: {exc}")
                continue
            runs.append(SweepRun(world, tp, pp, layout.dp_size, mb, batch,
                                 name=f"r{world}-dp{layout.dp_size}-tp{tp}-pp{pp}-mb{mb}"))
    if not runs:
        raise SweepError("no feasible run: " + "; ".join(skipped[:5]))
    return runs, skipped


def summarize(run: SweepRun, run_dir: str, warmup: int) -> dict:
    """One row: the run's layout, its measured step and breakdown (medians / means after ``warmup`` steps)."""
    row = {"name": run.name, "ranks": run.ranks, "dp": run.dp, "tp": run.tp, "pp": run.pp,
           "microbatches": run.microbatches, "global_batch": run.global_batch, "status": "ok"}
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip() and '"event"' not in line]
    except OSError as exc:
        return {**row, "status": f"no metrics ({exc.strerror})"}
    steady = records[warmup:] or records
    if not steady:
        return {**row, "status": "no steps"}
    phases: dict[str, float] = {}
    for r in steady:
        for k, v in (r.get("time_s") or {}).items():
            phases[k] = phases.get(k, 0.0) + v / len(steady)
    step = statistics.median(r["step_time_s"] for r in steady)
    comm = sum(phases.get(p, 0.0) for p in COMM_PHASES)
    bubble = sum(phases.get(p, 0.0) for p in BUBBLE_PHASES)
    inside = sum(v for k, v in phases.items() if k not in BETWEEN_STEPS)
    try:  # the nodes the job really ran on (the grid's count; hpctrain train writes it at the end)
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            row["nodes"] = int(json.load(f).get("nodes", 1))
    except (OSError, ValueError):
        pass
    return {**row, "steps": len(records), "step_s": step,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "compute_s": max(0.0, inside - comm - bubble), "comm_s": comm, "bubble_s": bubble,
            "bytes_sent": statistics.median(r.get("bytes_sent", 0) for r in steady),
            "final_loss": records[-1]["loss"], "phases_s": phases,
            "peak_memory_gib": next((r["peak_memory_gib"] for r in records if "peak_memory_gib" in r), None)}


def add_efficiency(rows: list[dict], mode: str) -> None:
    """``speedup`` (tokens/s over the base's) and ``efficiency`` (speedup / (ranks / base ranks): tokens/s per
    rank against the base's, in weak and strong scaling alike) against the fastest run at the smallest
    rank count (in place)."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    smallest = min(r["ranks"] for r in ok)
    base = max((r for r in ok if r["ranks"] == smallest), key=lambda r: r["tokens_per_s"])
    for r in ok:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        scale = r["ranks"] / base["ranks"]
        r["efficiency"] = r["speedup"] / scale
