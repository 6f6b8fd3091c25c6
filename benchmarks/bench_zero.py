#!/usr/bin/env python
"""ZeRO stages against torch FSDP2: hpctrain parallel.zero = 0, 1, 2, 3 and ``fully_shard`` over gloo, same
model, data, ranks and optimizer.

    mpiexec -n 4 python benchmarks/bench_zero.py --json bench_zero_4.json --csv bench_zero_4.csv

Rows (every rank a data-parallel replica):

    hpctrain-zero0..3   the hpctrain Trainer with parallel.zero = 0..3 (comm.intra_node from --intra-node);
                        zero 3 with --prefetch and --reshard (parallel.zero_prefetch /
                        parallel.zero_reshard_after_forward)
    fsdp2-gloo          torch.distributed.fsdp.fully_shard on every transformer block and on the whole model
                        (reshard_after_forward=True, the default), over a gloo process group on the same
                        ranks; torch.optim.AdamW, torch.nn.utils.clip_grad_norm_ on the DTensor gradients

Same work in each (benchmarks/bench_train.py's model and data): the hpctrain GPT (``GPTStage``), float32, the
same initial weights, the same global batch, AdamW with weight decay on matrices, gradient clipping at 1.0.
The final losses are printed as a check that every row trained the same model on the same data.

Two measurements in one job:

- memory, one implementation at a time (after a throwaway build that takes the process's once-only
  allocations; each built, 3 steps, closed, before the next is built): ``peak MiB`` =
  this process's resident peak over steps 2-3 (``VmHWM``, reset after step 1, so the construction's
  temporaries are left out) minus its resident memory before the build, the max over ranks: what training
  holds at its peak, model state, activations and buffers;
  ``with build MiB`` (``run_peak_mb``) = the same with the build and the first step counted (``VmHWM`` reset
  before the build instead);
  ``state MiB`` = the model state a rank keeps between steps (parameters, gradients, optimizer state:
  hpctrain's ``model_state_bytes``, FSDP2's local shards), max over ranks;
- time: every implementation built, ``--warmup`` steps each, then ``--rounds`` rounds of ``--steps`` steps
  of each in turn, the order rotated every round; a step's time is the max over ranks from a barrier; the
  reported time is the median. ``ratio vs fsdp2`` = fsdp2's step time / this row's (> 1: faster).
  ``MB sent/rank/step``: hpctrain's counted bytes (metrics ``bytes_sent``); FSDP2's from its collectives'
  sizes (gloo counts nothing): 2 all-gathers of the parameters (forward, backward) and one reduce-scatter
  of the gradients, each (n-1)/n of the model per rank.

``--process-peak --impls X``: X alone in this process, no throwaway build, ``VmHWM`` never reset: the whole
process's peak (what a user's job needs), max over ranks, one line and ``--json``/``--csv``; run it once per
implementation and once with a tiny model (the base every implementation shares).

``--lora-rank R``: every row trains LoRA adapters (rank R, on q and v) of the same model with the rest
frozen; hpctrain's zero 3 shards the frozen base too, FSDP2 shards it with the rest.

One thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling bench_train.py, imported or run
from bench_train import (HpcTrainImpl, Phases, add_output_args, add_run_args, peer_model,  # noqa: E402
                         peer_optimizer_and_batches)
from hpctrain.bench.comm import init_gloo_world  # noqa: E402
from hpctrain.bench.report import (resident_mb, run_benchmark, timed_rounds, timed_steps,  # noqa: E402
                                   write_records)

FIELDS = ["impl", "ranks", "zero", "step_ms", "step_ms_min", "step_ms_max", "ratio_vs_fsdp2", "peak_mb", "run_peak_mb",
          "state_mb",
          "mb_sent_per_step", "final_loss", "timed_steps", "params", "d_model", "n_layers", "vocab", "global_batch",
          "seq_len", "intra_node", "prefetch", "reshard", "lora_rank"]
IMPLS = ("hpctrain-zero0", "hpctrain-zero1", "hpctrain-zero2", "hpctrain-zero3", "fsdp2-gloo")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)} (default: all)")
    add_run_args(p, steps=4, warmup=2, rounds=3, d_model=256, layers=8, vocab=8192, seq_len=64, global_batch=8)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="hpctrain's gradient bucket size (zero 0-2)")
    p.add_argument("--prefetch", type=int, default=1, help="parallel.zero_prefetch of the zero-3 row (default 1)")
    p.add_argument("--reshard", default="true", choices=("true", "false"),
                   help="parallel.zero_reshard_after_forward of the zero-3 row (default true, as FSDP2's)")
    p.add_argument("--intra-node", default="auto", choices=("auto", "shm", "mpi"),
                   help="comm.intra_node of the hpctrain rows (default auto, hpctrain's default)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA adapters of this rank on q and v in every row, the rest frozen (default 0: off)")
    p.add_argument("--process-peak", action="store_true",
                   help="measure only the whole process's resident peak of the one --impls (no throwaway build, "
                        "VmHWM never reset); no timing, no table")
    add_output_args(p)
    return p.parse_args(argv)


class ZeroImpl(HpcTrainImpl):
    def __init__(self, zero: int, args, info, tokens, total_steps):
        extra = [f"parallel.zero={zero}", f"parallel.zero_prefetch={args.prefetch}",
                 f"parallel.zero_reshard_after_forward={args.reshard}", f"lora.rank={args.lora_rank}"]
        super().__init__(f"hpctrain-zero{zero}", args, info, tokens, total_steps, extra=extra)
        self.impl, self.zero = f"hpctrain-zero{zero}", zero

    def state_bytes(self) -> int:
        from hpctrain.train.metrics import model_state_bytes

        return sum(model_state_bytes(self.trainer.parts).values())


class Fsdp2Impl:
    """torch FSDP2 (``fully_shard``) on the same GPT; see the module docstring."""

    def __init__(self, args, info, tokens, total_steps):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.impl = self.name = "fsdp2-gloo"
        self.zero = "fsdp2"
        self.cfg, self.model, self.params = peer_model(args, total_steps, [f"lora.rank={args.lora_rank}"])
        mesh = init_device_mesh("cpu", (info.size,))
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer, self.batches, self.local_tokens = peer_optimizer_and_batches(self.cfg, self.model, info, tokens)
        self.step_count, self.loss = 0, float("nan")
        n, params = info.size, list(self.model.parameters())
        nbytes = 4 * sum(p.numel() for p in params)  # global sizes (DTensor)
        trainable = 4 * sum(p.numel() for p in params if p.requires_grad)  # a LoRA run reduces the adapters' alone
        self.bytes_sent = int((2 * nbytes + trainable) * (n - 1) / n)
        self.phases = Phases()

    def step(self) -> None:
        from hpctrain.optim.flat import lr_at

        self.optimizer.zero_grad(set_to_none=True)
        inputs, targets = self.batches.next_batch()
        loss = self.model.loss_sum(self.model(inputs), targets) / self.local_tokens  # FSDP averages over ranks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step_count, self.cfg.train)
        self.optimizer.step()
        self.step_count += 1
        self.loss = loss.item()

    def state_bytes(self) -> int:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        params = list(self.model.parameters())
        total = sum(local(p).nbytes for p in params) + sum(local(p.grad).nbytes for p in params if p.grad is not None)
        for state in self.optimizer.state.values():
            total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total

    def final_loss(self, world) -> float:
        return world.allreduce(self.loss, op=MPI.SUM) / world.Get_size()

    def close(self) -> None:
        pass


def build(name: str, args, info, tokens, total_steps):
    if name == "fsdp2-gloo":
        return Fsdp2Impl(args, info, tokens, total_steps)
    return ZeroImpl(int(name[-1]), args, info, tokens, total_steps)


def mmap_threshold(nbytes: int) -> None:
    """glibc: allocations of ``nbytes`` or more get their own mapping, returned to the system when freed, and
    the heap is trimmed above 2 x ``nbytes`` free. The memory phase sets 128 KiB (glibc's default start; its
    default then rises after the first large free and keeps later tensors on the heap, so the resident peak
    would follow the heap's history, not the tensors); the timing phase 32 MiB (the ceiling glibc's rising
    threshold reaches in a long run, with its trim threshold at twice that: freed buffers, ZeRO's transient
    gradient buckets and gathered units among them, are reused without new page faults)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * nbytes)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def release_memory() -> None:
    """Hand freed memory back to the system, so the next implementation's resident growth is its own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_memory(names, args, info, tokens, world) -> dict[str, dict]:
    """One implementation at a time: {name: {"peak_mb", "state_mb"}} (max over ranks). A throwaway build of
    the first one comes before: the process's first build allocates what stays for good (MPI's and the
    shared-memory route's buffers, torch's lazy state; about 35 MiB per rank here), which would otherwise
    count against whichever implementation is measured first."""
    found = {}
    warmup = build(names[0], args, info, tokens, 2)
    warmup.step()
    warmup.close()
    del warmup
    for name in names:
        release_memory()
        world.Barrier()
        before = resident_mb("VmRSS")
        resident_mb("VmHWM", reset=True)  # this implementation's peak from here: its build counts
        impl = build(name, args, info, tokens, 3)
        impl.step()  # the first step allocates what later steps reuse
        build_peak = resident_mb("VmHWM") - before  # the build and the first step
        resident_mb("VmHWM", reset=True)  # steady state: steps 2-3 alone
        for _ in range(2):
            impl.step()
        peak = resident_mb("VmHWM") - before
        state = impl.state_bytes() / 2**20
        impl.close()
        del impl
        found[name] = {"peak_mb": world.allreduce(peak, op=MPI.MAX), "state_mb": world.allreduce(state, op=MPI.MAX),
                       "run_peak_mb": world.allreduce(max(build_peak, peak), op=MPI.MAX)}
        if info.rank == 0:
            print(f"bench_zero: memory of {name}: peak +{found[name]['peak_mb']:.1f} MiB in steps 2-3, "
                  f"+{found[name]['run_peak_mb']:.1f} MiB with its build, model state "
                  f"{found[name]['state_mb']:.1f} MiB", file=sys.stderr, flush=True)
    release_memory()
    return found


def process_peak(names, args, info, tokens, world) -> dict:
    """``--process-peak``: the one implementation of ``names`` built, 3 steps, closed, in a process that runs
    nothing else, with no throwaway build and ``VmHWM`` never reset: the whole process's resident peak
    (interpreter, torch, MPI, the build, the steps), max over ranks. Subtract the same command's figure for a
    tiny model (``--d-model 64 --layers 2``) to compare implementations."""
    if len(names) != 1:
        raise SystemExit("bench_zero: --process-peak measures one implementation: give one --impls")
    impl = build(names[0], args, info, tokens, 3)
    for _ in range(3):
        impl.step()
    state = impl.state_bytes() / 2**20
    loss = impl.final_loss(world)
    impl.close()
    peak = world.allreduce(resident_mb("VmHWM"), op=MPI.MAX)
    record = {"impl": names[0], "ranks": info.size, "process_peak_mb": peak, "state_mb": world.allreduce(state, op=MPI.MAX),
              "final_loss": loss, "d_model": args.d_model, "n_layers": args.layers, "vocab": args.vocab,
              "seq_len": args.seq_len, "global_batch": args.global_batch}
    if info.rank == 0:
        print(f"bench_zero: {names[0]}: whole-process peak {peak:.1f} MiB per rank (max over {info.size} ranks; "
              f"build and 3 steps, VmHWM never reset), model state {record['state_mb']:.1f} MiB", flush=True)
    return record


def run(args) -> list[dict]:
    import torch.distributed as dist

    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.runtime.launcher import discover

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    info = discover()
    names = [w.strip() for w in args.impls.split(",") if w.strip()]
    unknown = [w for w in names if w not in IMPLS]
    if unknown:
        raise SystemExit(f"bench_zero: unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
    if args.global_batch % info.size:
        raise SystemExit(f"bench_zero: --global-batch {args.global_batch} must be divisible by the {info.size} ranks")
    tokens = load_tokens_collective(world, "builtin", "", args.max_bytes)
    if "fsdp2-gloo" in names:
        init_gloo_world(world, info)
    if args.process_peak:
        return [process_peak(names, args, info, tokens, world)]
    mmap_threshold(128 * 1024)
    memory = measure_memory(names, args, info, tokens, world)
    mmap_threshold(32 * 2**20)
    total_steps = args.warmup + args.rounds * args.steps
    impls = [build(name, args, info, tokens, total_steps) for name in names]
    if info.rank == 0:
        print(f"bench_zero: {info.size} ranks, {len(impls)} implementations, {args.warmup} warm-up + "
              f"{args.rounds} x {args.steps} timed steps each", file=sys.stderr, flush=True)
    for impl in impls:
        timed_steps(impl, args.warmup, world)
    times = timed_rounds(impls, args.rounds, args.steps, world, lambda impl, on: None)
    records = []
    for impl in impls:
        t, median = times[impl.name], statistics.median(times[impl.name])
        records.append({"impl": impl.impl, "ranks": info.size, "zero": impl.zero, "step_ms": median * 1e3,
                        "step_ms_min": min(t) * 1e3, "step_ms_max": max(t) * 1e3, "ratio_vs_fsdp2": None,
                        **memory[impl.name], "mb_sent_per_step": world.allreduce(impl.bytes_sent, op=MPI.MAX) / 1e6,
                        "final_loss": impl.final_loss(world), "timed_steps": len(t), "params": impl.params,
                        "d_model": args.d_model, "n_layers": args.layers, "vocab": args.vocab,
                        "global_batch": args.global_batch, "seq_len": args.seq_len, "intra_node": args.intra_node,
                        "prefetch": args.prefetch, "reshard": args.reshard, "lora_rank": args.lora_rank})
    fsdp = next((r for r in records if r["impl"] == "fsdp2-gloo"), None)
    for r in records:
        if fsdp is not None:
            r["ratio_vs_fsdp2"] = fsdp["step_ms"] / r["step_ms"]
    for impl in impls:
        impl.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return records


def print_table(records: list[dict], ranks: int) -> None:
    from rich.console import Console
    from rich.table import Table

    r0 = records[0]
    console = Console(width=None if sys.stdout.isatty() else 150)
    table = Table(title=f"ZeRO vs FSDP2: {ranks} ranks, GPT d_model={r0['d_model']} x {r0['n_layers']} layers, "
                        f"vocab {r0['vocab']} ({r0['params'] / 1e6:.2f} M params), seq {r0['seq_len']}, global batch "
                        f"{r0['global_batch']}, float32, AdamW; median of {r0['timed_steps']} steps")
    for name in ("impl", "step ms", "min-max ms", "ratio vs fsdp2", "peak MiB", "with build MiB", "state MiB",
                 "MB sent/rank/step", "final loss"):
        table.add_column(name, justify="left" if name == "impl" else "right")
    for r in records:
        ratio = "-" if r["ratio_vs_fsdp2"] is None else f"{r['ratio_vs_fsdp2']:.2f}x"
        table.add_row(r["impl"], f"{r['step_ms']:.1f}", f"{r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}", ratio,
                      f"{r['peak_mb']:.1f}", f"{r['run_peak_mb']:.1f}", f"{r['state_mb']:.1f}", f"{r['mb_sent_per_step']:.1f}",
                      f"{r['final_loss']:.4f}")
    console.print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench_zero: --{name} must be >= 1")
    records = run(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        if args.process_peak:
            write_records(records, args.json, args.csv, list(records[0]))
            return 0
        print_table(records, MPI.COMM_WORLD.Get_size())
        write_records(records, args.json, args.csv, FIELDS)
    return 0


if __name__ == "__main__":
    run_benchmark(main)
