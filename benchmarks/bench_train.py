#!/usr/bin/env python
"""Training throughput: hpctrain vs torch DistributedDataParallel (gloo), same model, data, ranks, optimizer.

    mpiexec -n 4 python benchmarks/bench_train.py --json bench_train_4.json --csv bench_train_4.csv

One MPI job runs every implementation on the same ranks:

    hpctrain  dp=N                 the hpctrain Trainer: flat buffers, bucketed non-blocking MPI all-reduce
                                   overlapped with backward, flat AdamW (comm.intra_node=mpi)
    hpctrain-shm  dp=N             the same with comm.intra_node=shm: the dp reduction in node-local
                                   shared memory (hpctrain/comm/intra_node.py; a dp group spanning
                                   nodes: hierarchical, hpctrain/comm/hierarchical.py)
    hpctrain-shm-thread  dp=N      the same with comm.shm_progress=thread (the shm reduction on a worker thread)
    hpctrain-auto  dp=N            the same with comm.intra_node=auto (shm or MPI per op and size, as measured on
                                   the node: hpctrain/comm/routes.py; impl hpctrain-dp-auto)
    ddp-gloo  dp=N                 torch.nn.parallel.DistributedDataParallel over a gloo process group
                                   (initialised on the same ranks; tcp on 127.0.0.1 or the node address),
                                   torch.optim.AdamW, torch.nn.utils.clip_grad_norm_
    hpctrain  dp=N/2 x tp=2        the cost of tensor parallelism at equal ranks
    hpctrain  dp=N/2 x pp=2        the cost of pipeline parallelism (1F1B, --pp-microbatches)

Same work in each: the hpctrain GPT (``GPTStage``; for DDP the whole model on one rank, tp=None),
float32, the same initial weights (seeded by name), the same global batch from the hpctrain sampler
(each rank reads its dp slice), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only, the hpctrain
learning-rate schedule), gradient clipping at 1.0. The final losses of all implementations are printed
as a check that they really trained the same model on the same data.

Method: each implementation first runs ``--warmup`` steps; then ``--rounds`` rounds, each running
``--steps`` timed steps of every implementation in turn, the order rotated every round so drifting
machine load spreads evenly. A step is timed from a barrier to its end on every rank; the step time is
the max over ranks; the reported time is the median over all timed steps; tokens/s = global batch x
sequence length / that time. ``ratio vs ddp-gloo`` = tokens/s / ddp-gloo's (> 1: faster than DDP).
Per-phase times (mean over timed steps and ranks) show where each implementation's step goes.

One thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpctrain.bench.comm import init_gloo_world  # noqa: E402
from hpctrain.bench.report import run_benchmark, timed_rounds, timed_steps, write_records  # noqa: E402

FIELDS = ["impl", "layout", "ranks", "dp", "tp", "pp", "microbatches", "tokens_per_s", "step_ms", "step_ms_min",
          "step_ms_max", "ratio_vs_ddp", "final_loss", "comm_ms", "timed_steps", "global_batch", "seq_len",
          "d_model", "n_layers", "params", "phases_ms"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, steps=6, warmup=3, rounds=5, d_model=128, layers=4, vocab=256, seq_len=128, global_batch=16)
    p.add_argument("--pp-microbatches", type=int, default=4, help="micro-batches of the pp=2 layout (default 4)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, both hpctrain and DDP")
    p.add_argument("--impls", default="hpctrain-dp,ddp-gloo,hpctrain-tp,hpctrain-pp",
                   help="comma list of hpctrain-dp, hpctrain-dp-shm, hpctrain-dp-shm-thread, hpctrain-dp-auto, ddp-gloo, "
                        "hpctrain-tp, "
                        "hpctrain-pp "
                        "(default: all but hpctrain-dp-shm)")
    p.add_argument("--intra-node", default="mpi", choices=("auto", "shm", "mpi"),
                   help="comm.intra_node of the hpctrain-dp/-tp/-pp rows (default mpi; hpctrain-dp-shm: always shm)")
    add_output_args(p)
    return p.parse_args(argv)


def add_run_args(p, *, steps, warmup, rounds, d_model, layers, vocab, seq_len, global_batch) -> None:
    """The timing and model flags every training benchmark shares (``model_overrides`` reads them), with
    each benchmark's defaults."""
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps per implementation per round (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps per implementation first (default {warmup})")
    p.add_argument("--rounds", type=int, default=rounds, help=f"rounds (implementations alternate; default {rounds})")
    p.add_argument("--d-model", type=int, default=d_model)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=0, help="MLP width (default 4 x d-model)")
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--global-batch", type=int, default=global_batch,
                   help=f"sequences per step over all ranks (default {global_batch})")


def add_output_args(p) -> None:
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes to load (default 2 MB)")
    p.add_argument("--json", metavar="FILE", help="write records to FILE (JSON list)")
    p.add_argument("--csv", metavar="FILE", help="write records to FILE (CSV)")


# --------------------------------------------------------------------------- phase timing
class Phases:
    """Accumulated seconds per named phase (only while ``active``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.active = False

    def add(self, name: str, seconds: float) -> None:
        if self.active:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds


# --------------------------------------------------------------------------- implementations
def model_overrides(args) -> list[str]:
    d_ff = args.d_ff or 4 * args.d_model
    return ["model.preset=custom", f"model.vocab_size={args.vocab}", f"model.d_model={args.d_model}",
            f"model.n_layers={args.layers}", f"model.n_heads={args.heads}", f"model.n_kv_heads={args.heads}",
            f"model.d_ff={d_ff}", f"model.max_seq_len={args.seq_len}", "model.tie_embeddings=false",
            "train.dtype=float32", f"train.seq_len={args.seq_len}", f"train.global_batch={args.global_batch}",
            "optim.name=adamw", "optim.beta1=0.9", "optim.beta2=0.95", "optim.eps=1e-8", "optim.weight_decay=0.1",
            "optim.grad_clip=1.0", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=5",
            "train.lr_schedule=cosine", f"parallel.bucket_mb={args.bucket_mb}"]


class HpcTrainImpl:
    def __init__(self, name, args, info, tokens, total_steps, *, tp=1, pp=1, microbatches=1, intra_node=None,
                 progress="call", extra=()):
        from hpctrain.comm.grid import ProcessGrid
        from hpctrain.config import load_config
        from hpctrain.models.gpt import count_parameters
        from hpctrain.train.trainer import Trainer

        world = info.size
        dp = world // (tp * pp)
        intra_node = intra_node or args.intra_node
        self.impl = "hpctrain" if intra_node == "mpi" else f"hpctrain-{intra_node}"
        if progress != "call":
            self.impl += f"-{progress}"
        self.dp_size, self.tp_size, self.pp_size, self.microbatches = dp, tp, pp, microbatches
        self.name = name
        self.layout = " x ".join(f"{a}={v}" for a, v in (("dp", dp), ("tp", tp), ("pp", pp)) if v > 1 or a == "dp")
        if pp > 1:
            self.layout += f" (1f1b, {microbatches} mb)"
        cfg = load_config(None, model_overrides(args) + [
            f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.microbatches={microbatches}",
            "parallel.schedule=1f1b", f"train.steps={total_steps}", "train.progress=false",
            f"comm.intra_node={intra_node}", f"comm.shm_progress={progress}", *extra])
        self.grid = ProcessGrid.from_config(cfg, info)
        self.trainer = Trainer(cfg, self.grid, tokens=tokens)
        self.params = count_parameters(self.trainer.parts.model_cfg)
        self.phases = Phases()  # from the trainer's own phase timers (metrics.jsonl ``time_s``)
        self.loss, self.comm_s, self.bytes_sent = float("nan"), [], 0

    def step(self) -> None:
        metrics = self.trainer.train_step()
        self.loss, self.bytes_sent = metrics.loss, metrics.bytes_sent
        if self.phases.active:
            self.comm_s.append(metrics.comm_time_s)
            for name, seconds in metrics.time_s.items():
                self.phases.add(name, seconds)

    def final_loss(self, world) -> float:
        return self.loss  # already the global mean, agreed on every rank

    def close(self) -> None:
        self.grid.close()


def peer_model(args, total_steps, extra=()):
    """The torch peers' config and model: the hpctrain GPT (``GPTStage``) whole on each rank, float32, the same
    initial weights (``extra``: more overrides, e.g. ``lora.rank``: its adapters, the base frozen); returns
    (cfg, model, parameter count)."""
    from hpctrain.config import load_config, resolve_model
    from hpctrain.models.gpt import GPTStage, count_parameters

    cfg = load_config(None, model_overrides(args) + [f"train.steps={total_steps}", *extra])
    m = resolve_model(cfg.model)
    model = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, tp_comm=None, dtype=torch.float32,
                     seed=cfg.train.seed, lora=cfg.lora)
    return cfg, model, count_parameters(m)


def peer_optimizer_and_batches(cfg, model, info, tokens):
    """torch.optim.AdamW over ``model`` (wrapped already: DDP, FSDP2) with weight decay on matrices only, and this
    rank's batches of the hpctrain sampler; returns (optimizer, batches, tokens per rank and step)."""
    from hpctrain.data.sampler import GlobalBatchIterator, SequenceSampler

    o = cfg.optim
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2],
                                    "weight_decay": o.weight_decay},
                                   {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=cfg.train.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    batches = GlobalBatchIterator(SequenceSampler(tokens, cfg.train.seq_len, cfg.train.seed),
                                  cfg.train.global_batch, info.size, info.rank)
    return optimizer, batches, cfg.train.global_batch // info.size * cfg.train.seq_len


class DdpImpl:
    def __init__(self, args, info, tokens, total_steps):
        from torch.nn.parallel import DistributedDataParallel

        self.impl, self.name, self.dp_size, self.tp_size, self.pp_size, self.microbatches = \
            "ddp-gloo", "ddp-gloo", info.size, 1, 1, 1
        self.layout = f"dp={info.size}"
        self.cfg, self.model, self.params = peer_model(args, total_steps)
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=args.bucket_mb)
        self.optimizer, self.batches, self.local_tokens = peer_optimizer_and_batches(self.cfg, self.model, info, tokens)
        self.step_count, self.loss = 0, float("nan")
        self.phases, self.comm_s = Phases(), []

    def step(self) -> None:
        from hpctrain.optim.flat import lr_at

        ph, clock = self.phases, time.perf_counter
        t0 = clock()
        inputs, targets = self.batches.next_batch()
        t1 = clock()
        self.optimizer.zero_grad(set_to_none=True)
        self.ddp.train()
        logits = self.ddp(inputs)
        loss = self.model.loss_sum(logits, targets) / self.local_tokens  # DDP averages grads over ranks
        t2 = clock()
        loss.backward()  # bucketed all-reduce overlapped; waited for at the end of backward
        t3 = clock()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        t4 = clock()
        lr = lr_at(self.step_count, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        t5 = clock()
        self.step_count += 1
        self.loss = loss.item()
        for name, seconds in (("data", t1 - t0), ("forward", t2 - t1), ("backward+allreduce", t3 - t2),
                              ("grad norm (clip)", t4 - t3), ("optimizer", t5 - t4)):
            ph.add(name, seconds)

    def final_loss(self, world) -> float:
        return world.allreduce(self.loss, op=MPI.SUM) / world.Get_size()  # the global mean, outside timing

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


# --------------------------------------------------------------------------- measurement
def build_impls(args, info, tokens, total_steps) -> list:
    wanted = [w.strip() for w in args.impls.split(",") if w.strip()]
    known = ("hpctrain-dp", "hpctrain-dp-shm", "hpctrain-dp-shm-thread", "hpctrain-dp-auto", "ddp-gloo", "hpctrain-tp",
             "hpctrain-pp")
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"bench_train: unknown --impls {unknown}; choose from {', '.join(known)}")
    n = info.size
    impls = []
    for name in wanted:
        if name in ("hpctrain-tp", "hpctrain-pp") and n % 2:
            if info.rank == 0:
                print(f"bench_train: skipping {name}: needs an even number of ranks", file=sys.stderr)
            continue
        if name == "hpctrain-dp":
            impls.append(HpcTrainImpl(name, args, info, tokens, total_steps))
        elif name == "hpctrain-dp-shm":
            impls.append(HpcTrainImpl(name, args, info, tokens, total_steps, intra_node="shm"))
        elif name == "hpctrain-dp-auto":
            impls.append(HpcTrainImpl(name, args, info, tokens, total_steps, intra_node="auto"))
        elif name == "hpctrain-dp-shm-thread":
            impls.append(HpcTrainImpl(name, args, info, tokens, total_steps, intra_node="shm", progress="thread"))
        elif name == "hpctrain-tp":
            impls.append(HpcTrainImpl(name, args, info, tokens, total_steps, tp=2))
        elif name == "hpctrain-pp":
            impls.append(HpcTrainImpl(name, args, info, tokens, total_steps, pp=2, microbatches=args.pp_microbatches))
        else:
            init_gloo_world(MPI.COMM_WORLD, info)
            impls.append(DdpImpl(args, info, tokens, total_steps))
    return impls


def run(args) -> list[dict]:
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.runtime.launcher import discover

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    info = discover()
    tokens = load_tokens_collective(world, "builtin", "", args.max_bytes)
    total_steps = args.warmup + args.rounds * args.steps
    impls = build_impls(args, info, tokens, total_steps)
    if info.rank == 0:
        print(f"bench_train: {info.size} ranks on {info.num_nodes} node(s), {len(impls)} implementations, "
              f"{args.warmup} warm-up + {args.rounds} x {args.steps} timed steps each", file=sys.stderr, flush=True)
    for impl in impls:
        timed_steps(impl, args.warmup, world)

    def report_round(rnd, times):
        if info.rank == 0:
            summary = ", ".join(f"{name} {1e3 * statistics.median(t):.0f} ms" for name, t in times.items())
            print(f"bench_train: round {rnd + 1}/{args.rounds}: median so far {summary}", file=sys.stderr, flush=True)

    times = timed_rounds(impls, args.rounds, args.steps, world,
                         lambda impl, on: setattr(impl.phases, "active", on), report_round)

    global_tokens = args.global_batch * args.seq_len
    timed = args.rounds * args.steps
    records = []
    for impl in impls:
        t = times[impl.name]
        by_rank = [{name: seconds / timed * 1e3 for name, seconds in rank_phases.items()}
                   for rank_phases in world.allgather(impl.phases.seconds)]  # ms per step, in step order
        phases = {}  # mean over ranks
        for rank_phases in by_rank:
            for name, ms in rank_phases.items():
                phases[name] = phases.get(name, 0.0) + ms / world.Get_size()
        comm_ms = (world.allreduce(sum(impl.comm_s), op=MPI.SUM) / world.Get_size() / timed * 1e3
                   if impl.impl.startswith("hpctrain") else None)
        median = statistics.median(t)
        records.append({"impl": impl.impl, "layout": impl.layout, "ranks": info.size, "dp": impl.dp_size, "tp": impl.tp_size,
                        "pp": impl.pp_size, "microbatches": impl.microbatches, "tokens_per_s": global_tokens / median,
                        "step_ms": median * 1e3, "step_ms_min": min(t) * 1e3, "step_ms_max": max(t) * 1e3,
                        "ratio_vs_ddp": None, "final_loss": impl.final_loss(world), "comm_ms": comm_ms,
                        "timed_steps": len(t), "global_batch": args.global_batch, "seq_len": args.seq_len,
                        "d_model": args.d_model, "n_layers": args.layers, "params": impl.params,
                        "phases_ms": phases, "phases_ms_by_rank": by_rank})
    ddp = next((r for r in records if r["impl"] == "ddp-gloo"), None)
    for r in records:
        if ddp is not None:
            r["ratio_vs_ddp"] = r["tokens_per_s"] / ddp["tokens_per_s"]
    for impl in impls:
        impl.close()
    return records


def print_tables(records: list[dict], args, ranks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)  # batch logs: wide enough for one line a row
    title = (f"training throughput: {ranks} ranks, GPT d_model={args.d_model} x {args.layers} layers "
             f"({records[0]['params'] / 1e6:.2f} M params), seq {args.seq_len}, global batch {args.global_batch}, "
             f"float32, AdamW; median of {records[0]['timed_steps']} steps")
    table = Table(title=title)
    for name in ("impl", "layout", "tokens/s", "step ms", "min-max ms", "ratio vs ddp-gloo", "final loss"):
        table.add_column(name, justify="left" if name in ("impl", "layout") else "right")
    for r in records:
        ratio = "-" if r["ratio_vs_ddp"] is None else f"{r['ratio_vs_ddp']:.2f}x"
        table.add_row(r["impl"], r["layout"], f"{r['tokens_per_s']:.0f}", f"{r['step_ms']:.1f}",
                      f"{r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}", ratio, f"{r['final_loss']:.4f}")
    console.print(table)
    phases = Table(title="where the step goes: mean ms per step (mean over ranks)")
    phases.add_column("impl")
    phases.add_column("layout")
    phases.add_column("phases", justify="left")
    for r in records:
        parts = "  ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items())
        if r["comm_ms"] is not None:
            parts += f"  | blocked in comm {r['comm_ms']:.1f}"
        phases.add_row(r["impl"], r["layout"], parts)
    console.print(phases)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench_train: --{name} must be >= 1")
    records = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print_tables(records, args, MPI.COMM_WORLD.Get_size())
        write_records(records, args.json, args.csv, FIELDS, json_columns=("phases_ms",))
    return 0


if __name__ == "__main__":
    run_benchmark(main)
