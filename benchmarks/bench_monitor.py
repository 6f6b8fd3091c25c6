#!/usr/bin/env python
"""What monitoring costs a training step: the same Trainer timed with and without ``[monitor]`` (Prometheus
server scraped ``--scrape-hz`` times a second by another process, a node_exporter textfile and TensorBoard
event files, per-rank gathers every ``--interval`` steps), in interleaved rounds.

    mpiexec -n 4 python benchmarks/bench_monitor.py --rounds 10 --steps 20 --scrape-hz 1 --json monitor.json

Per round and mode: ``--steps`` timed steps after one untimed one; a step's time is the max over ranks from a
barrier to the end of ``train_step`` plus (mode ``on``) ``RunMonitor.on_step``. The scraper (``curl``-like
urllib loop in a child process of rank 0) runs only during ``on`` rounds. Reported: median step seconds of
each mode; ``overhead_pct``: the median over rounds of (the round's median ``on`` step / the same round's
median ``off`` step - 1), in %, with the min and max over rounds (the noise of this shared machine is of
the same order); rank 0's mean ``on_step`` milliseconds (queueing the samples, the gathers); scrapes served.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

FIELDS = ["mode", "ranks", "steps", "step_s_median", "step_s_min", "step_s_max", "overhead_pct", "overhead_min_pct",
          "overhead_max_pct", "on_step_ms", "scrapes", "scrape_hz", "interval"]
SCRAPER = ("import sys, time, urllib.request\nn = 0\nwhile True:\n    try:\n        urllib.request.urlopen(sys.argv[1], "
           "timeout=2).read(); n += 1\n    except OSError:\n        pass\n    open(sys.argv[2], 'w').write(str(n))\n"
           "    time.sleep(float(sys.argv[3]))\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--interval", type=int, default=10, help="monitor.interval (default 10, train.log_interval's)")
    ap.add_argument("--scrape-hz", type=float, default=1.0, help="scrapes per second during 'on' rounds")
    ap.add_argument("--no-tensorboard", action="store_true", help="Prometheus server and textfile only")
    ap.add_argument("overrides", nargs="*", help="config overrides (section.key=value) of the trained run")
    ap.add_argument("--json")
    ap.add_argument("--csv")
    args = ap.parse_args()

    from mpi4py import MPI

    from hpctrain.bench.report import write_records
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.monitor.run_monitor import RunMonitor
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    tmp = world.bcast(tempfile.mkdtemp(prefix="bench-monitor-") if rank == 0 else None)
    port = world.bcast(free_port() if rank == 0 else None)
    cfg = load_config(args.config, [f"train.run_dir={tmp}", "train.progress=false", "comm.timeout_s=0",
                                    f"monitor.prometheus_port={port}", f"monitor.prometheus_textfile={tmp}/run.prom",
                                    f"monitor.tensorboard={not args.no_tensorboard}", f"monitor.interval={args.interval}",
                                    *args.overrides])
    tokens = load_tokens_collective(world, cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
    grid = ProcessGrid.from_config(cfg, discover(), timeout_s=0)
    trainer = Trainer(cfg, grid, tokens=tokens)
    monitor = RunMonitor(cfg, grid.world, grid.sizes, tmp)
    monitor.start(0)
    trainer.train_step()
    times, hook_s, hooks, scrapes, ratios = {"off": [], "on": []}, 0.0, 0, 0, []
    for rnd in range(args.rounds):
        round_times = {}
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            scraper = None
            if mode == "on" and rank == 0:
                scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{port}/metrics",
                                            f"{tmp}/scrapes", str(1 / args.scrape_hz)], stdin=subprocess.DEVNULL)
                time.sleep(0.3)
            round_times[mode] = []
            for _ in range(args.steps):
                world.Barrier()
                start = time.perf_counter()
                record = trainer.train_step().as_dict()
                if mode == "on":
                    before = time.perf_counter()
                    monitor.on_step(record)
                    hook_s, hooks = hook_s + time.perf_counter() - before, hooks + 1
                round_times[mode].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
            times[mode] += round_times[mode]
            if scraper is not None:
                scraper.terminate()
                scraper.wait()
                scrapes += int(open(f"{tmp}/scrapes").read() or 0)
        ratios.append(statistics.median(round_times["on"]) / statistics.median(round_times["off"]) - 1)
    monitor.close()
    grid.close()
    if rank != 0:
        return 0
    records = []
    for mode in ("off", "on"):
        median = statistics.median(times[mode])
        records.append(dict(mode=mode, ranks=world.Get_size(), steps=len(times[mode]), step_s_median=round(median, 5),
                            step_s_min=round(min(times[mode]), 5), step_s_max=round(max(times[mode]), 5),
                            overhead_pct=round(100 * statistics.median(ratios), 2) if mode == "on" else 0.0,
                            overhead_min_pct=round(100 * min(ratios), 2) if mode == "on" else None,
                            overhead_max_pct=round(100 * max(ratios), 2) if mode == "on" else None,
                            on_step_ms=round(1e3 * hook_s / hooks, 3) if mode == "on" else None,
                            scrapes=scrapes if mode == "on" else None, scrape_hz=args.scrape_hz,
                            interval=args.interval))
    print(" ".join(f"{f:>12.12}" for f in FIELDS))
    for r in records:
        print(" ".join(f"{'-' if r[f] is None else r[f]:>12}" for f in FIELDS))
    write_records(records, args.json, args.csv, FIELDS)
    print(json.dumps(records[-1]))
    return 0


if __name__ == "__main__":
    from hpctrain.bench.report import run_benchmark

    run_benchmark(main)
