"""``hpctrain trace RUN_DIR``: merge the ranks' traces and say where each rank's time went.

Reads ``<run_dir>/trace/rankRRRRR.json`` (written with ``train.trace = true``; trace.py), writes the
merged ``<run_dir>/trace/trace.json`` (one process per rank: open it in https://ui.perfetto.dev) and
prints, per rank, the mean over the traced steps of:

  step        wall time from the step's start to the next step's start (its checkpoint save and the
              agreement to go on included)
  compute     step - exposed communication - bubble - data - ckpt (the rank's own work)
  <group>     exposed communication per group: time blocked in calls on it (blocking calls and waits
              of non-blocking ones; a reduction that ran behind backward costs nothing here)
  bubble      time blocked on the pipeline group: waiting for the neighbour stage, and the transfer, and
              after the stage's schedule, for the other stages to finish theirs (the drain: op ``drain``)
  data        loading the batch
  ckpt        the blocking part of checkpoint saves in the traced steps
(``other``: step time no phase covers, e.g. Python between phases; ``--json`` has every phase.)
``hidden``, per group: the share of its non-blocking calls' time in flight (start to observed
completion) that was not spent waiting on them: the overlap of e.g. the dp reduction with backward.

then names the slowest rank (the most compute) and why: the phase where it spends the most above the
median of the other ranks, and how long the others wait in communication meanwhile.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from collections import defaultdict

from hpctrain.errors import HpcTrainError
from hpctrain.profiling.cuda_trace import host_wait_lines

BALANCED = 1.05  # a rank whose compute is within 5% of the others' median is not called slow
COMPUTE_PHASES = ("forward", "backward", "weight", "optimizer", "grad_norm", "compress", "loss", "dp_wait", "other")


class TraceError(HpcTrainError):
    """The run directory has no usable trace."""


def load_traces(run_dir: str) -> list[dict]:
    """Every rank's trace document, by rank; clear errors for a missing or damaged trace."""
    directory = os.path.join(run_dir, "trace")
    paths = sorted(glob.glob(os.path.join(directory, "rank*.json")))
    if not os.path.isdir(run_dir):
        raise TraceError(f"{run_dir} is not a directory (expected a run directory with trace/)")
    if not paths:
        raise TraceError(f"no trace in {directory}: train with train.trace=true (and train.trace_steps=N) first")
    docs = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            doc["otherData"]["rank"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{path} is not a trace written by hpctrain: {exc}") from exc
        docs.append(doc)
    sizes = {d["otherData"].get("world_size") for d in docs}
    if len(sizes) == 1 and None not in sizes and len(docs) != next(iter(sizes)):
        missing = sorted(set(range(next(iter(sizes)))) - {d["otherData"]["rank"] for d in docs})
        raise TraceError(f"{directory}: traces of {len(docs)} of {next(iter(sizes))} ranks; missing ranks "
                         f"{missing} (did the run stop before the traced steps ended on every rank?)")
    return sorted(docs, key=lambda d: d["otherData"]["rank"])


def merge(docs: list[dict], path: str) -> str:
    """All ranks in one Chrome-trace file (atomically written)."""
    events = [e for d in docs for e in d["traceEvents"]]
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"ranks": [d["otherData"] for d in docs]}}, f)
    os.replace(tmp, path)
    return path


def breakdown(doc: dict) -> dict:
    """One rank's mean seconds per traced step: step, compute, per-group exposed comm, bubble, data, ckpt,
    and the exclusive phase times."""
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["cat"] == "step"]
    n = max(1, len(steps))
    blocked: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    flight: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # group: [in flight, waited on]
    for e in events:
        if e["cat"] == "inflight":
            flight[e["args"]["group"]][0] += e["dur"] / 1e6
        elif e["cat"] == "blocked" and e["name"].startswith("wait "):
            flight[e["args"]["group"]][1] += e["dur"] / 1e6
        if e["cat"] == "blocked":
            blocked[e["args"]["group"]] += e["dur"] / 1e6
        elif e["cat"] == "phase":
            phases[e["name"]] += e["args"]["exclusive_us"] / 1e6
    step = sum(e["dur"] for e in steps) / 1e6
    phases["other"] = max(0.0, step - sum(v for k, v in phases.items() if k != "checkpoint"))
    bubble = blocked.pop("pp", 0.0)
    comm = dict(blocked)
    data, ckpt = phases.get("data", 0.0), phases.get("checkpoint", 0.0)
    compute = step - bubble - sum(comm.values()) - data - ckpt
    return {"rank": doc["otherData"]["rank"], "host": doc["otherData"].get("hostname", "?"), "steps": len(steps),
            "step": step / n, "compute": compute / n, "comm": {g: s / n for g, s in comm.items()},
            "bubble": bubble / n, "data": data / n, "ckpt": ckpt / n,
            "hidden": {g: 1 - waited / total for g, (total, waited) in flight.items() if total > 0},
            "phases": {k: v / n for k, v in phases.items()}}


def slowest(rows: list[dict]) -> str:
    """Who holds the others up, and why (one sentence)."""
    if len(rows) < 2:
        return ""
    worst = max(rows, key=lambda r: r["compute"])
    others = [r for r in rows if r is not worst]
    median_compute = statistics.median(r["compute"] for r in others)
    if worst["compute"] <= BALANCED * median_compute:
        return (f"balanced: every rank's compute is within {100 * (BALANCED - 1):.0f}% of the others' median "
                f"(the most: rank {worst['rank']}, {1e3 * worst['compute']:.1f} ms vs {1e3 * median_compute:.1f} ms)")
    excess = {p: worst["phases"].get(p, 0.0) - statistics.median(r["phases"].get(p, 0.0) for r in others)
              for p in COMPUTE_PHASES}
    phase, extra = max(excess.items(), key=lambda kv: kv[1])
    waiting = statistics.median(sum(r["comm"].values()) + r["bubble"] for r in others)
    why = (f"{phase} takes {1e3 * worst['phases'].get(phase, 0.0):.1f} ms, {1e3 * extra:+.1f} ms over the "
           f"median of the other ranks" if extra > 0 else "no single phase stands out")
    return (f"slowest rank: {worst['rank']} ({worst['host']}): compute {1e3 * worst['compute']:.1f} ms per step vs "
            f"a median {1e3 * median_compute:.1f} ms on the others; {why}; the others wait "
            f"{1e3 * waiting:.1f} ms per step in communication and the bubble")


def table(rows: list[dict]) -> str:
    """One line per rank; with a zero-bubble schedule (a ``weight`` phase) its compute's B and W beside it."""
    groups = sorted({g for r in rows for g in r["comm"]})
    split = any(r["phases"].get("weight", 0.0) > 0 for r in rows)
    head = ["rank", "host", "steps", "step ms", "compute", *(["B", "W"] if split else []),
            *[f"{g} comm" for g in groups], "bubble", "data", "ckpt"]
    lines = [head]
    for r in rows:
        parts = [f"{1e3 * r['phases'].get(p, 0.0):.1f}" for p in ("backward", "weight")] if split else []
        lines.append([str(r["rank"]), r["host"], str(r["steps"]), f"{1e3 * r['step']:.1f}",
                      f"{1e3 * r['compute']:.1f}", *parts, *[f"{1e3 * r['comm'].get(g, 0.0):.1f}" for g in groups],
                      f"{1e3 * r['bubble']:.1f}", f"{1e3 * r['data']:.1f}", f"{1e3 * r['ckpt']:.1f}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def run_trace_report(run_dir: str, as_json: bool = False) -> int:
    docs = load_traces(run_dir)
    merged = merge(docs, os.path.join(run_dir, "trace", "trace.json"))
    rows = [breakdown(d) for d in docs]
    verdict = slowest(rows)
    if as_json:
        print(json.dumps({"ranks": rows, "slowest": verdict, "merged": merged}, indent=1))
        return 0
    print(f"trace of {len(rows)} ranks, mean per traced step (ms); exposed communication only")
    print(table(rows))
    if verdict:
        print(verdict)
    for group in sorted({g for r in rows for g in r["hidden"]}):
        shares = [r["hidden"][group] for r in rows if group in r["hidden"]]
        print(f"non-blocking calls on {group}: {100 * min(shares):.0f}-{100 * max(shares):.0f}% of their time "
              f"in flight was hidden behind other work (the rest was waited on)")
    print(f"merged trace: {merged} (open in https://ui.perfetto.dev or chrome://tracing)")
    for line in host_wait_lines(run_dir):  # CUDA runs: where the host waited for the device
        print(line)
    return 0
