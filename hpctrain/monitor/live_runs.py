"""``hpctrain runs``: the runs under some directories that publish metrics (their ``monitor.json``, written at
start by rank 0), with where to scrape them and how far they are; ``--file-sd`` turns them into a Prometheus
``file_sd_configs`` target file, so a centre's Prometheus finds every run without editing its config.

A run is ``ended`` when its ``summary.json`` is newer than its start; else, started on this host, ``live``
while its rank 0's pid is; started on another host, ``live`` or ``ended`` as ``squeue`` says of its Slurm
job (RUNNING or not), else ``elsewhere`` (no way to tell: listed, and a scrape target). Its step is the
last line of ``metrics.jsonl``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

from hpctrain.errors import HpcTrainError
from hpctrain.monitor.run_monitor import ENDPOINT_FILE

MAX_DEPTH = 4  # directories below each root searched for monitor.json


def find_runs(roots: list[str]) -> list[dict]:
    """Every run under ``roots`` with a ``monitor.json``: its record plus ``dir``, ``status``, ``step``."""
    runs, seen = [], set()
    for root in roots:
        if not os.path.isdir(root):
            raise HpcTrainError(f"hpctrain runs: {root}: no such directory")
        base_depth = os.path.abspath(root).rstrip(os.sep).count(os.sep)
        for directory, subdirs, files in os.walk(root):
            if directory.rstrip(os.sep).count(os.sep) - base_depth >= MAX_DEPTH:
                subdirs[:] = []
            subdirs[:] = [d for d in subdirs if d not in ("checkpoints", "tensorboard", "superseded")]
            if ENDPOINT_FILE in files and os.path.realpath(directory) not in seen:
                seen.add(os.path.realpath(directory))
                runs.append(describe(directory))
    return sorted(runs, key=lambda r: r["dir"])


def describe(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, ENDPOINT_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        return {"dir": run_dir, "status": f"unreadable {ENDPOINT_FILE} ({exc})", "step": None}
    record.update(dir=os.path.abspath(run_dir), step=last_step(run_dir), status=status(run_dir, record))
    return record


def status(run_dir: str, record: dict) -> str:
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary) and os.path.getmtime(summary) >= record.get("started", 0):
        return "ended"
    if record.get("host") != socket.gethostname():
        return slurm_state(record.get("job_id")) or "elsewhere"
    try:
        os.kill(int(record.get("pid", 0)), 0)
    except (OSError, ValueError):
        return "ended"
    return "live"


def slurm_state(job_id) -> str | None:
    """``live`` / ``ended`` for a Slurm job as ``squeue`` sees it; None without a job id or squeue."""
    if not job_id or shutil.which("squeue") is None:
        return None
    try:
        state = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                               timeout=30, stdin=subprocess.DEVNULL).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "live" if state == "RUNNING" else "ended"


def last_step(run_dir: str) -> int | None:
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def file_sd(runs: list[dict]) -> list[dict]:
    """Prometheus file_sd targets: one per run that serves a port and has not ended."""
    targets = []
    for r in runs:
        if r.get("port") and r.get("status") != "ended":
            host = r["host"] if r.get("addr") in ("0.0.0.0", "::") else r.get("addr", r["host"])
            targets.append({"targets": [f"{host}:{r['port']}"], "labels": {k: str(v) for k, v in r["labels"].items()}})
    return targets


def write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{time.time_ns()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
