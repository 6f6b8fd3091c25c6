#!/usr/bin/env python
"""train.compile against eager: the step time of the hpctrain Trainer with and without torch.compile.

    mpiexec -n 2 python benchmarks/bench_compile.py [--json out.json] model.preset=small [section.key=value ...]

One MPI job builds two Trainers from the same config (``train.compile=false`` and ``true``) on the same
ranks and data, runs ``--warmup`` steps of each (the compiled one compiles there), then ``--rounds`` rounds
of ``--steps`` timed steps of each, alternating step by step (eager, compiled, eager, ...: a shared
machine's load drifts onto both alike). A step's time is the max over ranks from a barrier to its end; a
round's figure per mode is the median of its steps, its ratio the median of the paired eager / compiled
step times (> 1: compiled is faster); the line gives the range over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.comm.grid import ProcessGrid  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.data.corpus import load_tokens_collective  # noqa: E402
from hpctrain.runtime.launcher import discover  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402


def timed_step(trainer, world) -> float:
    world.Barrier()
    start = time.perf_counter()
    trainer.train_step()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the per-round medians and ratios there (rank 0)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    base = ["data.max_bytes=1000000", "train.progress=false", *args.overrides]
    cfg0 = load_config(None, base)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    trainers = {}
    for mode in ("false", "true"):
        cfg = load_config(None, base + [f"train.compile={mode}"])
        trainers[mode] = Trainer(cfg, ProcessGrid.from_config(cfg, discover(world), mpi_world=world), tokens=tokens)
        start = time.perf_counter()
        for _ in range(args.warmup):
            trainers[mode].train_step()
        if world.rank == 0:
            print(f"warm-up compile={mode}: {time.perf_counter() - start:.1f} s", flush=True)
    medians, ratios = {mode: [] for mode in trainers}, []
    for _ in range(args.rounds):  # steps alternate eager, compiled, ...: machine load drifts onto both alike
        times = {mode: [] for mode in trainers}
        for k in range(2 * args.steps):
            mode = ("false", "true")[k % 2]
            times[mode].append(timed_step(trainers[mode], world))
        for mode in trainers:
            medians[mode].append(statistics.median(times[mode]))
        ratios.append(statistics.median(e / c for e, c in zip(times["false"], times["true"])))
    for trainer in trainers.values():
        trainer.grid.close()
    if world.rank == 0:
        m = cfg0.model.preset
        eager, compiled = medians["false"], medians["true"]
        print(f"{m} {world.size} rank(s): eager {min(eager) * 1e3:.1f}-{max(eager) * 1e3:.1f} ms, compiled "
              f"{min(compiled) * 1e3:.1f}-{max(compiled) * 1e3:.1f} ms, eager/compiled {min(ratios):.2f}-"
              f"{max(ratios):.2f} (range over {args.rounds} rounds of {args.steps} paired steps)", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"preset": m, "ranks": world.size, "overrides": args.overrides, "eager_s": eager,
                           "compiled_s": compiled, "eager_over_compiled": ratios, "torch": torch.__version__}, f,
                          indent=1)


if __name__ == "__main__":
    main()
