#!/usr/bin/env python
"""A mixture-of-experts step at ep = 1, 2, 4 against the dense model with the same active parameters.

    mpiexec -n 4 python benchmarks/bench_moe.py --json bench_moe_4.json --csv bench_moe_4.csv

One MPI job trains, on the same ranks (dp = all of them), data and optimizer:

    dense          the GPT with a SwiGLU MLP of width top_k x d_ff_expert: the same active parameters (and
                   matmul FLOPs per token, but the router's) as the MoE model
    moe ep=1       every block an MoE layer of --experts SwiGLU experts of width d_ff_expert, top_k routed
                   per token (dropless): every rank holds every expert
    moe ep=E       the same, experts split over E ranks of the replica group, rows dispatched and combined by
                   Alltoallv on the ep group (hpctrain/parallel/expert_parallel.py)

Method (as benchmarks/bench_train.py, whose implementation class this reuses): ``--warmup`` untimed steps,
then ``--rounds`` rounds of ``--steps`` timed steps of every configuration in turn (order rotated); a step's
time is the max over ranks; the median is reported. ``vs dense`` = tokens/s over the dense model's. Also:
the expert parameters each rank holds, the bytes sent per step on the ep group, and where the step goes.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling bench_train.py, imported or run
from bench_train import HpcTrainImpl, add_output_args, add_run_args  # noqa: E402
from hpctrain.bench.report import run_benchmark, timed_rounds, timed_steps, write_records  # noqa: E402

FIELDS = ["config", "ranks", "ep", "experts", "top_k", "tokens_per_s", "step_ms", "step_ms_min", "step_ms_max",
          "vs_dense", "final_loss", "params_per_rank", "ep_bytes_per_step", "timed_steps", "phases_ms"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, steps=4, warmup=2, rounds=3, d_model=128, layers=4, vocab=256, seq_len=128, global_batch=16)
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--d-ff-expert", type=int, default=256, help="each expert's width (default 256)")
    p.add_argument("--ep", default="1,2,4", help="expert-parallel sizes to run, those dividing the ranks (default 1,2,4)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--intra-node", default="mpi", choices=("auto", "shm", "mpi"))
    add_output_args(p)
    return p.parse_args(argv)


class Config(HpcTrainImpl):
    """One configuration: an ``HpcTrainImpl`` (bench_train.py) with the MoE keys; ``ep`` 0 = the dense model."""

    def __init__(self, args, info, tokens, total_steps, ep: int):
        moe = [] if ep == 0 else [f"moe.num_experts={args.experts}", f"moe.top_k={args.top_k}",
                                  f"moe.d_ff_expert={args.d_ff_expert}", f"parallel.ep={ep}"]
        self.ep = ep
        args.d_ff = args.top_k * args.d_ff_expert  # the dense model: the same active MLP width
        super().__init__("dense" if ep == 0 else f"moe ep={ep}", args, info, tokens, total_steps, extra=moe)
        self.params_per_rank = sum(p.numel() for p in self.trainer.parts.local_model.parameters())
        self.ep_bytes: list[int] = []

    def step(self) -> None:
        metrics = self.trainer.train_step()
        self.loss = metrics.loss
        if self.phases.active:
            self.ep_bytes.append(metrics.groups.get("ep", {}).get("bytes_sent", 0))
            for name, seconds in metrics.time_s.items():
                self.phases.add(name, seconds)


def run(args) -> list[dict]:
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.runtime.launcher import discover

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    info = discover()
    tokens = load_tokens_collective(world, "builtin", "", args.max_bytes)
    total_steps = args.warmup + args.rounds * args.steps
    sizes = [0] + [e for e in map(int, args.ep.split(",")) if info.size % e == 0 and args.experts % e == 0]
    configs = [Config(args, info, tokens, total_steps, ep) for ep in sizes]
    for c in configs:
        timed_steps(c, args.warmup, world)
    times = timed_rounds(configs, args.rounds, args.steps, world, lambda c, on: setattr(c.phases, "active", on))
    timed, records = args.rounds * args.steps, []
    for c in configs:
        t = times[c.name]
        phases = {k: v / timed * 1e3 for k, v in c.phases.seconds.items()}  # rank 0's ms per step
        median = statistics.median(t)
        records.append({"config": c.name, "ranks": info.size, "ep": c.ep, "experts": args.experts if c.ep else 0,
                        "top_k": args.top_k, "tokens_per_s": args.global_batch * args.seq_len / median,
                        "step_ms": median * 1e3, "step_ms_min": min(t) * 1e3, "step_ms_max": max(t) * 1e3,
                        "vs_dense": None, "final_loss": c.loss, "params_per_rank": c.params_per_rank,
                        "ep_bytes_per_step": statistics.mean(c.ep_bytes) if c.ep_bytes else 0,
                        "timed_steps": len(t), "phases_ms": phases})
    for r in records:
        r["vs_dense"] = r["tokens_per_s"] / records[0]["tokens_per_s"]
    for c in configs:
        c.close()
    return records


def print_table(records: list[dict], args, ranks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 170)
    table = Table(title=f"MoE step vs dense: {ranks} ranks (dp={ranks}), d_model={args.d_model} x {args.layers} layers, "
                        f"{args.experts} experts of {args.d_ff_expert}, top {args.top_k} (dense MLP "
                        f"{args.top_k * args.d_ff_expert}), seq {args.seq_len}, global batch {args.global_batch}, "
                        f"float32; median of {records[0]['timed_steps']} steps")
    for name in ("config", "tokens/s", "step ms", "min-max ms", "vs dense", "params/rank", "ep bytes/step",
                 "final loss", "phases ms"):
        table.add_column(name, justify="left" if name in ("config", "phases ms") else "right")
    for r in records:
        table.add_row(r["config"], f"{r['tokens_per_s']:.0f}", f"{r['step_ms']:.1f}",
                      f"{r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}", f"{r['vs_dense']:.2f}x",
                      f"{r['params_per_rank'] / 1e6:.2f} M", f"{r['ep_bytes_per_step'] / 2**20:.2f} MiB",
                      f"{r['final_loss']:.4f}", " ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items() if v >= 1))
    console.print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    records = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print_table(records, args, MPI.COMM_WORLD.Get_size())
        write_records(records, args.json, args.csv, FIELDS, json_columns=("phases_ms",))
    return 0


if __name__ == "__main__":
    run_benchmark(main)
