#!/usr/bin/env python
"""Gradient compression on an emulated slow interconnect: step time, bytes on the wire, time to the dense loss.

    python benchmarks/bench_compression.py --json bench_compression.json --csv bench_compression.csv

Two emulated hosts (``scripts/two_hosts.sh``: network namespaces h1/h2 joined by a veth pair shaped with
``tc tbf``; needs root), one rank on each, MPI forced onto TCP so every gradient byte crosses the wire. For
each link rate in ``--rates`` (``1gbit``, ``100mbit``, ``none`` = unshaped veth, ``shm`` = both ranks on this
host through shared memory, no wire) it trains the same model on the same data with dense reduction and with
each method in ``--methods``:

    dense run       ``--steps`` N steps; its loss at step N (mean of the last ``--window`` steps) is the target
    each method     up to ``--max-steps`` steps, stopping once its windowed loss reaches the target

and reports, per (rate, method): median step time, the share of the dense step spent in communication,
bytes sent per step as hpctrain counts them (``bytes_sent``, its wire model) next to the bytes the veth
counters saw leave each host (``wire/model`` must be ~1.0), the compression ratio, compress+decompress time,
steps and wall time to reach the dense loss, and ``speedup`` = dense wall time to step N / the method's wall
time to the same loss (> 1: compression pays on that link). A method that never reaches the target within
``--max-steps`` gets no speedup. The optimizer is AdamW (lr 3e-3, constant after 5 warmup steps); ``onebit``
uses SGD with momentum 0.9 (lr 0.1) and is compared with a dense run that uses the same: sign compression
needs momentum. ``onebit-adam`` (1-bit Adam: AdamW's momentum compressed after ``--onebit-adam-warmup``
dense steps, default ``--steps`` / 5) is compared with dense AdamW; its wall time includes the warm-up. The dense run's own time to the target uses the same first-reach rule (loss curves are
noisy; all runs see the same batches in the same order).

Each configuration is one ``mpiexec`` job running this file with ``--worker`` (hpctrain's ``Trainer`` driven
step by step; each rank reads its host's ``/sys/class/net/eth1`` counters around every step). ``--repeats R``
repeats every configuration and reports the median and the range of each time.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WIRE = "/sys/class/net/eth1/statistics/"
METHODS = ("fp16", "bf16", "int8", "zfp", "topk", "randomk", "powersgd", "onebit", "onebit-adam")
EXTRA = {"randomk": ["compression.density=0.1"], "topk": ["compression.density=0.01"]}
# optimizer profiles: every method uses AdamW like dense, but sign compression needs momentum SGD (and is
# compared with a dense run that uses the same)
PROFILES = {"adamw": ["optim.name=adamw", "train.lr=3e-3"],
            "sgd-m0.9": ["optim.name=sgd", "optim.momentum=0.9", "train.lr=0.1"]}
PROFILE = {"onebit": "sgd-m0.9"}
FIELDS = ["rate", "method", "optimizer", "ranks", "step_ms", "step_ms_min", "step_ms_max", "comm_share",
          "bytes_per_step", "wire_per_step", "wire_over_model", "compression_ratio", "compress_ms",
          "steps_to_target", "time_to_target_s", "time_to_target_min_s", "time_to_target_max_s", "speedup",
          "speedup_min", "speedup_max", "target_loss", "final_loss", "params", "repeats"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,100mbit,none,shm", help="link rates (tc syntax), none, shm")
    p.add_argument("--methods", default=",".join(METHODS), help="compression methods besides dense")
    p.add_argument("--steps", type=int, default=30, help="dense steps N: the target is its loss at step N")
    p.add_argument("--max-steps", type=int, default=0, help="most steps of a method (default 3N)")
    p.add_argument("--window", type=int, default=10, help="steps averaged into a loss (default 10)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration (default 1)")
    p.add_argument("--onebit-adam-warmup", type=int, default=0,
                   help="onebit-adam: dense AdamW steps before the variance freezes (default: --steps / 5)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300, help="seconds per job before it is killed")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--csv", help="write the table here")
    # worker mode (one mpiexec job)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="none", help=argparse.SUPPRESS)
    p.add_argument("--profile", default="adamw", choices=PROFILES, help=argparse.SUPPRESS)
    p.add_argument("--target", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def overrides(args, method: str, profile: str, steps: int) -> list[str]:
    d = args.d_model
    return ["model.preset=custom", "model.vocab_size=256", f"model.d_model={d}", f"model.n_layers={args.layers}",
            "model.n_heads=4", "model.n_kv_heads=4", f"model.d_ff={4 * d}", f"model.max_seq_len={args.seq_len}",
            "train.dtype=float32", f"train.seq_len={args.seq_len}", f"train.global_batch={args.global_batch}",
            *PROFILES[profile], "train.lr_schedule=constant", f"train.steps={steps}", "train.progress=false", f"compression.method={method}",
            *EXTRA.get(method, []),
            *([f"compression.warmup_steps={args.onebit_adam_warmup}"] if method == "onebit-adam" else [])]


# --------------------------------------------------------------------------- worker (inside mpiexec)
def wire_bytes() -> int | None:
    try:
        return int(open(WIRE + "tx_bytes").read())
    except OSError:
        return None


def worker(args) -> int:
    from mpi4py import MPI

    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.models.gpt import count_parameters
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, overrides(args, args.method, args.profile, args.max_steps))
    grid = ProcessGrid.from_config(cfg, discover())
    trainer = Trainer(cfg, grid)
    steps, losses = [], []
    for _ in range(args.max_steps):
        before = wire_bytes()
        m = trainer.train_step()
        after = wire_bytes()
        losses.append(m.loss)
        steps.append({"loss": m.loss, "step_s": m.step_time_s, "comm_s": m.comm_time_s, "sent": m.bytes_sent,
                      "wire": None if before is None else after - before, "ratio": m.compression_ratio,
                      "compress_s": m.compress_s})
        window = losses[-args.window:]
        if args.target and len(window) == args.window and sum(window) / len(window) <= args.target:
            break  # every rank sees the same agreed loss: they stop together
    ranks = MPI.COMM_WORLD.gather({"host": MPI.Get_processor_name(), "steps": steps}, root=0)
    if grid.info.rank == 0:
        print("BENCH " + json.dumps({"ranks": ranks, "params": count_parameters(trainer.parts.model_cfg),
                                     "nodes": grid.info.num_nodes}), flush=True)
    grid.close()
    return 0


# --------------------------------------------------------------------------- driver
class Launcher:
    """Runs a worker job on the two hosts (or on this host through shared memory for rate ``shm``)."""

    def __init__(self, args):
        self.args, self.hosts = args, None

    def __enter__(self):
        if any(r != "shm" for r in self.args.rates.split(",")):
            from hpctrain.tools.two_hosts import TwoHosts
            ok, reason = TwoHosts.available()
            if not ok:
                raise SystemExit(f"bench_compression: two emulated hosts unavailable: {reason}")
            self.hosts = TwoHosts("1gbit").up()
        return self

    def __exit__(self, *exc):
        if self.hosts is not None:
            self.hosts.down()

    def run(self, rate: str, method: str, profile: str, max_steps: int, target: float) -> dict:
        if rate == "shm":
            prefix = ["mpiexec", "-n", "2"]
        else:
            self.hosts.set_rate(rate)
            prefix = self.hosts.mpiexec(2, ppn=1)
        cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", f"--method={method}",
               f"--profile={profile}", f"--max-steps={max_steps}", f"--target={target}"]
        cmd += [f"--{k}={getattr(self.args, k.replace('-', '_'))}"
                for k in ("d-model", "layers", "global-batch", "seq-len", "window", "onebit-adam-warmup")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1", MPIR_CVAR_CH4_PROGRESS_THROTTLE="1")
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]  # the venv's hydra mpiexec
        proc = subprocess.run(["timeout", "-k", "5", str(self.args.timeout), *cmd], capture_output=True, text=True,
                              env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
        lines = [line[6:] for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"bench_compression: {rate} {method} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(lines[0])


def windowed(losses: list[float], window: int) -> list[float]:
    return [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i in range(len(losses))]


def summarize(run: dict, target: float, window: int) -> dict:
    """One job's numbers: medians over steps 2.. (step 1 opens connections), totals over all steps."""
    first = run["ranks"][0]["steps"]
    losses = windowed([s["loss"] for s in first], window)
    reached = next((i + 1 for i, v in enumerate(losses) if i + 1 >= window and v <= target), None)
    timed = first[1:] or first
    sent = sum(s["sent"] for r in run["ranks"] for s in r["steps"][1:])
    wires = [s["wire"] for r in run["ranks"] for s in r["steps"][1:]]
    wire = None if None in wires else sum(wires)
    n = len(timed) * len(run["ranks"])
    return {"step_s": statistics.median(s["step_s"] for s in timed),
            "comm_share": statistics.median(s["comm_s"] / s["step_s"] for s in timed),
            "bytes_per_step": sent / n, "wire_per_step": None if wire is None else wire / n,
            "wire_over_model": None if wire is None or not sent else wire / sent,
            "compression_ratio": statistics.median(s["ratio"] for s in timed),
            "compress_s": statistics.median(s["compress_s"] for s in timed),
            "steps_to_target": reached,
            "time_to_target_s": None if reached is None else sum(s["step_s"] for s in first[:reached]),
            "final_loss": losses[-1], "params": run["params"]}


def span(values: list) -> tuple:
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def bench(args, launcher) -> list[dict]:
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"bench_compression: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    records = []
    for rate in args.rates.split(","):
        for profile in sorted({PROFILE.get(m, "adamw") for m in methods} | {"adamw"}):
            dense = [launcher.run(rate, "none", profile, args.steps, 0.0) for _ in range(args.repeats)]
            target = statistics.median(windowed([s["loss"] for s in d["ranks"][0]["steps"]], args.window)[-1]
                                       for d in dense)
            dense_times = [summarize(d, target, args.window) for d in dense]
            base = statistics.median(s["time_to_target_s"] for s in dense_times)  # the same first-reach rule
            runs = {"dense": dense_times}
            for method in (m for m in methods if PROFILE.get(m, "adamw") == profile):
                runs[method] = [summarize(launcher.run(rate, method, profile, args.max_steps, target), target,
                                          args.window) for _ in range(args.repeats)]
            for method, summaries in runs.items():
                rec = record(rate, method, profile, summaries, target, base, args.repeats)
                records.append(rec)
                print(row(rec), flush=True)
    return records


def record(rate, method, profile, summaries, target, dense_wall, repeats) -> dict:
    s0 = summaries[0]
    step, step_min, step_max = span([s["step_s"] for s in summaries])
    ttt, ttt_min, ttt_max = span([s["time_to_target_s"] for s in summaries])
    reached = [s["steps_to_target"] for s in summaries if s["steps_to_target"] is not None]
    speedups = [dense_wall / s["time_to_target_s"] for s in summaries if s["time_to_target_s"]]
    sp, sp_min, sp_max = span(speedups) if len(speedups) == len(summaries) else (None, None, None)
    mean = statistics.mean
    wire = [s["wire_per_step"] for s in summaries if s["wire_per_step"] is not None]
    ratio = [s["wire_over_model"] for s in summaries if s["wire_over_model"] is not None]
    return {"rate": rate, "method": method, "optimizer": profile, "ranks": 2, "step_ms": 1e3 * step,
            "step_ms_min": 1e3 * step_min, "step_ms_max": 1e3 * step_max,
            "comm_share": mean(s["comm_share"] for s in summaries),
            "bytes_per_step": mean(s["bytes_per_step"] for s in summaries),
            "wire_per_step": mean(wire) if wire else None, "wire_over_model": mean(ratio) if ratio else None,
            "compression_ratio": mean(s["compression_ratio"] for s in summaries),
            "compress_ms": 1e3 * mean(s["compress_s"] for s in summaries),
            "steps_to_target": max(reached) if len(reached) == len(summaries) else None,
            "time_to_target_s": ttt, "time_to_target_min_s": ttt_min, "time_to_target_max_s": ttt_max,
            "speedup": sp, "speedup_min": sp_min, "speedup_max": sp_max, "target_loss": target,
            "final_loss": s0["final_loss"], "params": s0["params"], "repeats": repeats}


HEADER = (f"{'rate':>8} {'method':>11} {'step ms':>16} {'comm':>5} {'KiB/step':>9} {'wire/model':>10} "
          f"{'ratio':>6} {'cmp ms':>6} {'steps':>5} {'to target s':>18} {'speedup':>15}")


def row(r: dict) -> str:
    def rng(v, lo, hi, fmt):
        if v is None:
            return "never"
        return format(v, fmt) + (f" ({lo:{fmt}}-{hi:{fmt}})" if r["repeats"] > 1 else "")
    wire = "-" if r["wire_over_model"] is None else f"{r['wire_over_model']:.3f}"
    name = r["method"] + ("*" if r["optimizer"] != "adamw" else "")
    return (f"{r['rate']:>8} {name:>11} {rng(r['step_ms'], r['step_ms_min'], r['step_ms_max'], '.0f'):>16} "
            f"{r['comm_share']:>5.0%} {r['bytes_per_step'] / 1024:>9.0f} {wire:>10} {r['compression_ratio']:>6.1f} "
            f"{r['compress_ms']:>6.1f} {r['steps_to_target'] or '-':>5} "
            f"{rng(r['time_to_target_s'], r['time_to_target_min_s'], r['time_to_target_max_s'], '.1f'):>18} "
            f"{rng(r['speedup'], r['speedup_min'], r['speedup_max'], '.2f'):>15}")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.max_steps = args.max_steps or 3 * args.steps
    args.onebit_adam_warmup = args.onebit_adam_warmup or max(1, args.steps // 5)
    if args.worker:
        from hpctrain.bench.report import run_benchmark
        run_benchmark(lambda: worker(args))
    from hpctrain.bench.report import write_records
    print(f"bench_compression: 2 ranks (one per host), d_model {args.d_model}, {args.layers} layers, "
          f"batch {args.global_batch}x{args.seq_len}, AdamW lr 3e-3; target = dense loss at step {args.steps} "
          f"(mean of {args.window}); * = SGD momentum 0.9 lr 0.1 (with its own dense run)", flush=True)
    print(HEADER, flush=True)
    start = time.perf_counter()
    with Launcher(args) as launcher:
        records = bench(args, launcher)
    write_records(records, args.json, args.csv, FIELDS)
    print(f"bench_compression: {len(records)} rows in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
