#!/usr/bin/env python
"""Long context: activation memory, peak memory and step time of training against sequence length, for
context parallelism cp = 1 (the single-process reference, SDPA) and cp = 2, 4 (ring attention).

    python benchmarks/bench_long_context.py --cps 1,2,4 --seq-lens 1024,2048,4096,8192,16384 --json lc.json

The driver launches one ``mpiexec -n cp`` job per cp (this script again, ``--worker``); each job trains the
``--preset`` model (tp = pp = dp = 1, one sequence per step, ``--window`` as model.attention_window) at every
sequence length in ascending order: ``--warmup`` untimed steps, then ``--steps`` timed ones. Per length:
- ``act_mb``: the bytes autograd saves for backward in one training step (every tensor packed by
  ``torch.autograd.graph.saved_tensors_hooks``: ``ActivationMeter.total_saved``, storages counted once, the
  parameters' flat buffer not counted): the activation memory of one rank; ``act_vs_cp1`` = act_mb / act_mb at cp = 1;
- ``peak_mb``: the rank's peak resident memory during the timed steps (VmHWM of /proc/self/status, reset
  through /proc/self/clear_refs before them), max over ranks; ``above_base_mb``: that peak less the
  resident memory of the process before its first model (torch, MPI, the corpus), max over ranks: the
  model, optimizer, activations and temporaries; ``above_base_vs_cp1`` = that / the same at cp = 1
  (the lengths run in ascending order, so a peak is never a shorter length's left-over);
- ``step_s``: median step time (max over ranks); ``ring_wait_ms``: time per step blocked waiting on the
  ring's exchanges (mean over ranks: what computation did not hide).
The ranks of one job share this machine's cores: with cp ranks on fewer cores the step time measures the
work per rank, not a speed-up. One torch thread per rank.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

FIELDS = ["cp", "seq", "window", "act_mb", "act_vs_cp1", "peak_mb", "above_base_mb", "above_base_vs_cp1", "step_s",
          "ring_wait_ms"]


def worker(args) -> list[dict]:
    """One mpiexec job: every sequence length at cp = the world size. Returns rank 0's records."""
    from mpi4py import MPI

    from hpctrain.bench.report import resident_mb
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.profiling.activations import ActivationMeter
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    world = MPI.COMM_WORLD
    cp, records = world.Get_size(), []
    base = None
    for seq in sorted(int(s) for s in args.seq_lens.split(",")):
        cfg = load_config(None, [f"model.preset={args.preset}", f"model.max_seq_len={seq}", f"train.seq_len={seq}",
                                 f"model.attention_window={args.window}", "parallel.tp=1", "parallel.pp=1",
                                 f"parallel.cp={cp}", "train.global_batch=1", "parallel.microbatches=1",
                                 "train.progress=false", "comm.timeout_s=0"])
        tokens = load_tokens_collective(world, cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
        base = resident_mb("VmRSS") if base is None else base
        grid = ProcessGrid.from_config(cfg, discover(), timeout_s=0)
        trainer = Trainer(cfg, grid, tokens=tokens)
        for _ in range(args.warmup):
            trainer.train_step()
        saved = ActivationMeter(lambda: [trainer.parts.params.flat.param_buffer])
        with saved.saving():
            trainer.train_step()
        ring = grid.stats.ops[("cp", "exchange")] if cp > 1 else None
        waited, times = (ring.seconds if ring else 0.0), []
        resident_mb("VmRSS", reset=True)
        for _ in range(args.steps):
            world.Barrier()
            start = time.perf_counter()
            trainer.train_step()
            times.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        peak = resident_mb()
        added, peak = world.allreduce(peak - base, op=MPI.MAX), world.allreduce(peak, op=MPI.MAX)
        wait = world.allreduce((ring.seconds if ring else 0.0) - waited) / cp / args.steps
        act = world.allreduce(saved.total_saved, op=MPI.MAX) / 2**20
        records.append(dict(cp=cp, seq=seq, window=args.window, act_mb=round(act, 1), above_base_mb=round(added, 1),
                            peak_mb=round(peak, 1),
                            step_s=round(statistics.median(times), 3), ring_wait_ms=round(1e3 * wait, 1)))
        if world.Get_rank() == 0:
            print(json.dumps(records[-1]), flush=True)
        grid.close()
        del trainer
    return records


def run_driver(args) -> int:
    """Launch one job per cp, merge the records, add the ratios to cp = 1, print and write them."""
    from hpctrain.bench.report import write_records

    mpiexec = shlex.split(args.mpiexec) if args.mpiexec else \
        [shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")]
    records = []
    for cp in (int(c) for c in args.cps.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = mpiexec + ["-n", str(cp), sys.executable, os.path.abspath(__file__), "--worker", "--out", out.name,
                   "--seq-lens", args.seq_lens, "--preset", args.preset, "--window", str(args.window),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
            print(f"cp={cp}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
            records += json.load(open(out.name))
    base = {r["seq"]: r for r in records if r["cp"] == 1}
    for r in records:
        ref = base.get(r["seq"])
        r["act_vs_cp1"] = round(r["act_mb"] / ref["act_mb"], 3) if ref else None
        r["above_base_vs_cp1"] = round(r["above_base_mb"] / ref["above_base_mb"], 3) if ref else None
    print(" ".join(f"{f:>12}" for f in FIELDS))
    for r in sorted(records, key=lambda r: (r["seq"], r["cp"])):
        print(" ".join(f"{'-' if r[f] is None else r[f]:>12}" for f in FIELDS))
    write_records(records, args.json, args.csv, FIELDS)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cps", default="1,2,4", help="context-parallel sizes, one mpiexec job each")
    ap.add_argument("--seq-lens", default="1024,2048,4096")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--window", type=int, default=0, help="model.attention_window (0 = full causal)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mpiexec", help="the launcher command (default: mpiexec on PATH or beside python)")
    ap.add_argument("--json")
    ap.add_argument("--csv")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.worker:
        return run_driver(args)
    from mpi4py import MPI

    records = worker(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(records, f)
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        from hpctrain.bench.report import run_benchmark

        run_benchmark(main)
    else:
        sys.exit(main())
