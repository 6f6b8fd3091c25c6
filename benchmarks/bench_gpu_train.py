#!/usr/bin/env python
"""Training throughput on one GPU: hpctrain against the best plain-PyTorch loop for the same model.

    python benchmarks/bench_gpu_train.py --presets gpt2-small,gpt2-medium,gpt2-xl --json gpu.json --csv gpu.csv
    python benchmarks/bench_gpu_train.py --device cpu --presets tiny --seq-len 64 --micro-batch 2 \\
        --global-batch 4 --warmup 1 --steps 2 --compile false          # the CPU smoke test CI runs

Per preset, the same model (hpctrain's ``GPTStage``, seeded by name), the same batches (hpctrain's sampler
over the builtin corpus), the same AdamW hyper-parameters (constant learning rate), gradient clipping at 1.0, the
same micro-batch
(``--micro-batch`` sequences per forward) and global batch (``--global-batch``, gradient accumulation in
between):

    hpctrain   the Trainer: train.dtype=bfloat16 (bf16 parameters, fp32 main grads in flat buckets, flat fp32
               AdamW masters, global grad norm: the path a multi-rank run takes, with dp/tp/pp = 1),
               train.compile, train.micro_batch_size, the sync-free step (``train_step(defer=True)``, as
               ``hpctrain train`` runs it: the verdict is read one step late)
    torch      the best plain-PyTorch recipe we know (nanoGPT's): fp32 parameters under
               ``torch.autocast(bfloat16)``, ``torch.compile(model)``, SDPA (flash on CUDA),
               ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``

Each (preset, implementation) runs in its own process, so its peak memory and compile caches are its own:
``--warmup`` steps (compilation included), then ``--steps`` timed steps in windows of ``--window`` steps,
each window timed with a device synchronisation on both ends (inside a window the host queues ahead, as in a
real run: what the sync-free step is for); the median step time over the windows is reported with the
min-max. ``--repeats R`` runs the pair R times,
alternating. MFU = the trainer's FLOPs per token (``flops_per_token``) x tokens/s / the GPU's dense bf16 peak
(989 TFLOP/s for an H100 SXM; ``hpctrain/runtime/device.py``). ``ratio`` = hpctrain's tokens/s over torch's.
Peak memory: ``torch.cuda.max_memory_allocated`` (on CPU, the process's peak RSS).

``--set train.fp8=tensorwise|rowwise`` (float8 block linears, hpctrain/parallel/fp8.py; on the CPU with
``--set train.fp8_emulate=true``: the numbers' agreement only, no speed claim) adds a third row, ``hpctrain-bf16``:
hpctrain without the ``train.fp8*`` sets (bfloat16 on a GPU; the CPU smoke mode's float32), and prints fp8's
tokens/s and final loss against it.

``--residual-dtype float32`` sets hpctrain's ``model.residual_dtype`` (a float32 residual stream around bfloat16
sublayers, as the loop's autocast keeps it; the loop is unchanged). The JSON records each row's
``residual_dtype`` and ``losses``, the loss of every step (warm-up included), to compare the two loops' training.

``--count-eager`` (``--device cpu`` only) checks the GPU step's structure on the CPU instead of timing it: both
implementations in bfloat16 (hpctrain ``train.dtype=bfloat16``; the loop under ``torch.autocast(bfloat16)``),
compiled, one train step and one evaluation to compile, then one train step counted by
hpctrain/bench/eager_ops.py (the ATen ops, and the bytes they read and write, outside compiled graphs), then
5 train steps with a changing lr and one evaluation. One JSON line per implementation:
``{"impl", "eager_ops", "eager_bytes", "graphs", "graph_breaks", "recompiles"}`` (graphs and breaks over the
whole run, recompiles: graphs compiled after the first train step and evaluation). The eager ops moving the most
bytes go to stderr.

    python benchmarks/bench_gpu_train.py --device cpu --count-eager --presets gpt2-small --seq-len 128 \\
        --micro-batch 2 --global-batch 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("preset", "impl", "params", "seq_len", "micro_batch", "global_batch", "compile", "tokens_per_s",
          "step_ms", "step_ms_min", "step_ms_max", "mfu", "ratio", "peak_memory_gib", "final_loss", "device",
          "torch", "repeats", "residual_dtype")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="gpt2-small,gpt2-medium,gpt2-xl", help="model presets, comma-separated")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--n-layers", type=int, default=0, help="blocks of both models (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward (train.micro_batch_size)")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: --micro-batch)")
    p.add_argument("--compile", default="true", choices=("true", "false"), help="torch.compile both (default true)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--window", type=int, default=5,
                   help="steps per timed window: the device is synchronised only at a window's ends, so the host "
                        "may queue the next step while the GPU runs this one (a one-step window syncs every step)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (preset, implementation), alternating")
    p.add_argument("--residual-dtype", default="auto", choices=("auto", "float32"),
                   help="hpctrain's model.residual_dtype (the loop keeps its float32 residual under autocast)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra config override for hpctrain's run (repeatable), e.g. model.fused_head_loss=false")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N costliest device kernels of the timed steps (torch.profiler)")
    p.add_argument("--count-eager", action="store_true",
                   help="CPU only: count the ops and bytes outside compiled graphs in one bf16 step, graph breaks and "
                        "recompiles (one JSON line per implementation) instead of timing")
    p.add_argument("--count-eager-top", type=int, default=15, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per worker process")
    p.add_argument("--json")
    p.add_argument("--csv")
    p.add_argument("--worker", choices=("hpctrain", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- workers (one process each)
def config(args):
    from hpctrain.config import load_config

    return load_config(None, [f"model.preset={args.preset}", "model.vocab_size=0", f"train.seq_len={args.seq_len}",
                              f"train.global_batch={args.global_batch}", f"train.micro_batch_size={args.micro_batch}",
                              "train.dtype=bfloat16" if args.device == "cuda" or args.count_eager
                              else "train.dtype=float32",
                              f"train.device={args.device}", f"train.compile={args.compile}", "train.steps=100000",
                              "train.progress=false", "train.warmup_steps=0", "train.lr_schedule=constant",
                              "data.max_bytes=20000000"]
                       + ([f"model.n_layers={args.n_layers}"] if args.n_layers else [])
                       + (["train.warmup_steps=100", "train.eval_steps=1", "data.valid_fraction=0.05"]  # lr changes
                          if args.count_eager else [])
                       + ([f"model.residual_dtype={args.residual_dtype}", *args.set] if args.worker == "hpctrain"
                          else []))


class TorchLoop:
    """The peer: GPTStage in fp32 under autocast(bf16), torch.compile, fused AdamW, accumulation, clipping."""

    def __init__(self, cfg, device, autocast_cpu: bool = False):
        import torch
        from mpi4py import MPI

        from hpctrain.config import resolve_model
        from hpctrain.data.corpus import load_tokens_collective
        from hpctrain.data.packing import samplers_for
        from hpctrain.data.sampler import GlobalBatchIterator
        from hpctrain.models.gpt import GPTStage
        from hpctrain.runtime import env

        m, t, o = resolve_model(cfg.model), cfg.train, cfg.optim
        self.model_cfg, self.device = m, device
        model = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, tp_comm=None, dtype=torch.float32,
                         seed=t.seed).to(device)
        self.model = model

        def forward_loss(inputs, targets):  # logits and cross-entropy in one compiled graph, as nanoGPT's
            return model.loss_sum(model(inputs), targets)
        self.forward_loss = torch.compile(forward_loss) if str(cfg.train.compile).lower() == "true" else forward_loss
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=t.lr, betas=(o.beta1, o.beta2),
                                     eps=o.eps, fused=True)
        tokens = load_tokens_collective(MPI.COMM_WORLD, cfg.data.source, env.cache_dir(cfg.data.cache_dir),
                                        cfg.data.max_bytes)
        sampler, _ = samplers_for(tokens, 0.0, t.seq_len, t.seed)
        self.batches = GlobalBatchIterator(sampler, t.global_batch, 1, 0)
        self.micro, self.tokens = t.micro_batch_size or t.global_batch, t.global_batch * t.seq_len
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                                       enabled=device.type == "cuda" or autocast_cpu)
        self.losses: list = []  # every step's loss, on the device

    def train_step(self):
        import torch

        inputs, targets = self.batches.next_batch()[:2]
        if self.device.type == "cuda":
            inputs, targets = (b.pin_memory().to(self.device, non_blocking=True) for b in (inputs, targets))
        total = torch.zeros((), device=self.device)
        for i in range(0, inputs.shape[0], self.micro):
            with self.autocast:
                loss = self.forward_loss(inputs[i:i + self.micro], targets[i:i + self.micro]) / self.tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(total)
        return total  # stays on the device: read once, after the timed steps

    def set_lr(self, lr: float):
        for group in self.opt.param_groups:
            group["lr"] = lr

    def evaluate(self):
        """The loss of one held-out-like batch, forward only (the next training batch: the graphs matter here)."""
        import torch

        inputs, targets = self.batches.next_batch()[:2]
        self.model.eval()
        with torch.no_grad(), self.autocast:
            loss = self.forward_loss(inputs[:self.micro].to(self.device), targets[:self.micro].to(self.device))
        self.model.train()
        return loss


def count_eager(args) -> int:
    """``--count-eager``'s worker: one bf16 step's eager ops and bytes, graphs, breaks and recompiles."""
    import torch

    from hpctrain.bench.eager_ops import EagerOpCounter
    from hpctrain.models.compile import dynamo_counts

    cfg, device = config(args), torch.device("cpu")
    start = dynamo_counts()
    grid = None
    if args.worker == "hpctrain":
        from hpctrain.comm.grid import ProcessGrid
        from hpctrain.runtime.launcher import discover
        from hpctrain.train.trainer import Trainer

        grid = ProcessGrid.from_config(cfg, discover())
        trainer = Trainer(cfg, grid, device=device)
        step, evaluate, set_lr = (lambda: trainer.train_step(defer=True)), trainer.evaluate, None
    else:
        loop = TorchLoop(cfg, device, autocast_cpu=True)
        step, evaluate, set_lr = loop.train_step, loop.evaluate, loop.set_lr
    step()
    evaluate()
    compiled = dynamo_counts()
    with EagerOpCounter() as counter:
        step()
    for i in range(5):  # hpctrain's lr warms up (train.warmup_steps); the loop's is set
        if set_lr is not None:
            set_lr(cfg.train.lr * (i + 2) / 10)
        step()
    evaluate()
    end = dynamo_counts()
    if args.worker == "hpctrain":
        trainer.read_pending()
    top = sorted(counter.bytes_by_op.items(), key=lambda kv: -kv[1])[:args.count_eager_top]
    print(f"{args.worker}: eager ops moving the most bytes: "
          + ", ".join(f"{n} x{counter.by_op[n]} {b / 1e6:.0f} MB" for n, b in top), file=sys.stderr)
    print("BENCH " + json.dumps({
        "impl": args.worker, "eager_ops": counter.ops, "eager_bytes": counter.bytes,
        "graphs": end["graphs"] - start["graphs"],
        "graph_breaks": sum(end["breaks"].values()) - sum(start["breaks"].values()),
        "recompiles": end["graphs"] - compiled["graphs"]}), flush=True)
    if grid is not None:
        grid.close()
    return 0


def worker(args) -> int:
    import torch

    from hpctrain.models.gpt import count_parameters, flops_per_token
    from hpctrain.runtime.device import peak_tflops
    from hpctrain.runtime.peak_memory import peak_memory

    cfg = config(args)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    grid = None
    if args.worker == "hpctrain":
        from hpctrain.comm.grid import ProcessGrid
        from hpctrain.runtime.launcher import discover
        from hpctrain.train.trainer import Trainer

        grid = ProcessGrid.from_config(cfg, discover())
        trainer = Trainer(cfg, grid, device=device)
        step, model_cfg = (lambda: trainer.train_step(defer=True)), trainer.parts.model_cfg  # the loop's sync-free step
        residual = str(trainer.parts.executor.act_dtype).removeprefix("torch.")
    else:
        loop = TorchLoop(cfg, device)
        step, model_cfg = loop.train_step, loop.model_cfg
        residual = "float32"  # fp32 parameters: autocast computes matmuls in bf16, the residual adds in fp32

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        result = step()
    times = []  # seconds per step of each window: the host queues ahead inside a window, as in a run
    profiler = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        profiler = profile(activities=[ProfilerActivity.CPU]
                           + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))
        profiler.__enter__()
    for first in range(0, args.steps, args.window):
        count = min(args.window, args.steps - first)
        sync()
        start = time.perf_counter()
        for _ in range(count):
            result = step()
        sync()
        times.append((time.perf_counter() - start) / count)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort, row_limit=args.profile, max_name_column_width=70),
              file=sys.stderr, flush=True)
    if args.worker == "hpctrain":
        trainer.read_pending()  # the last step's verdict (read one step late, as in a run)
        finished = trainer.finished_steps()
        result = finished[-1]
        losses = [m.loss for m in finished]
    else:
        losses = [float(v) for v in loop.losses]
    loss = float(result.loss if hasattr(result, "loss") else result)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    median = statistics.median(times)
    peak = peak_tflops(device, torch.bfloat16)
    memory, _ = peak_memory(device)
    print("BENCH " + json.dumps({
        "impl": args.worker, "preset": args.preset, "params": count_parameters(model_cfg), "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "global_batch": args.global_batch, "compile": args.compile,
        "tokens_per_s": tokens / median, "step_ms": 1e3 * median, "step_ms_min": 1e3 * min(times),
        "step_ms_max": 1e3 * max(times),
        "mfu": flops_per_token(model_cfg, args.seq_len) * tokens / median / (peak * 1e12) if peak else None,
        "peak_memory_gib": memory / 2**30, "final_loss": loss,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "residual_dtype": residual, "losses": losses}), flush=True)
    if grid is not None:
        grid.close()
    return 0


# --------------------------------------------------------------------------- driver
def fp8_recipe(sets: list[str]) -> str:
    """The ``train.fp8`` value among the ``--set`` overrides ("none" when absent)."""
    return next((kv.split("=", 1)[1] for kv in reversed(sets) if kv.startswith("train.fp8=")), "none")


def run_worker(args, preset: str, impl: str) -> dict:
    """One worker process; ``impl`` "hpctrain-bf16": hpctrain without the ``train.fp8*`` sets (fp8's baseline)."""
    sets = [kv for kv in args.set if not kv.startswith("train.fp8")] if impl == "hpctrain-bf16" else args.set
    worker = "hpctrain" if impl == "hpctrain-bf16" else impl
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--worker={worker}", f"--preset={preset}",
           f"--device={args.device}", f"--n-layers={args.n_layers}", f"--seq-len={args.seq_len}",
           f"--micro-batch={args.micro_batch}",
           f"--global-batch={args.global_batch}", f"--compile={args.compile}", f"--warmup={args.warmup}",
           f"--steps={args.steps}", f"--window={args.window}", f"--residual-dtype={args.residual_dtype}",
           f"--profile={args.profile}", *(f"--set={kv}" for kv in sets)] + (["--count-eager"] if args.count_eager else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout,
                          stdin=subprocess.DEVNULL)
    lines = [line[6:] for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    if args.profile or args.count_eager:
        print(proc.stderr[-12000:], file=sys.stderr, flush=True)
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_gpu_train: {preset} {impl} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[0]), "impl": impl}


def combine(runs: list[dict]) -> dict:
    """One row from the repeats of one (preset, impl): medians, the range over every repeat's steps (``losses``:
    the first repeat's)."""
    row = dict(runs[0])
    for key in ("tokens_per_s", "step_ms", "peak_memory_gib", "final_loss"):
        row[key] = statistics.median(r[key] for r in runs)
    row["step_ms_min"], row["step_ms_max"] = min(r["step_ms_min"] for r in runs), max(r["step_ms_max"] for r in runs)
    row["mfu"] = statistics.median(r["mfu"] for r in runs) if runs[0]["mfu"] is not None else None
    row["repeats"] = len(runs)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    args.global_batch = args.global_batch or args.micro_batch
    if args.worker:
        from hpctrain.bench.report import run_benchmark
        run_benchmark(lambda: count_eager(args) if args.count_eager else worker(args))
    if args.count_eager:
        if args.device != "cpu":
            print("bench_gpu_train: --count-eager counts on the CPU only (--device cpu); nothing run", file=sys.stderr)
            return 2
        for preset in args.presets.split(","):
            for impl in ("hpctrain", "torch"):
                row = run_worker(args, preset, impl)
                print(json.dumps({key: row[key] for key in ("impl", "eager_ops", "eager_bytes", "graphs",
                                                            "graph_breaks", "recompiles")}), flush=True)
        return 0
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("bench_gpu_train: needs a CUDA GPU (torch sees none); --device cpu runs the smoke test",
                  file=sys.stderr)
            return 2
    from hpctrain.bench.report import write_records

    records = []
    print(f"{'preset':12} {'impl':13} {'params':>8} {'tokens/s':>10} {'step ms (min-max)':>24} {'MFU':>6} "
          f"{'ratio':>6} {'GiB':>6} {'loss':>7}", flush=True)
    for preset in args.presets.split(","):
        impls = ("hpctrain", "torch") + (("hpctrain-bf16",) if fp8_recipe(args.set) != "none" else ())
        runs: dict[str, list] = {impl: [] for impl in impls}
        for r in range(args.repeats):
            for impl in (impls if r % 2 == 0 else impls[::-1]):
                runs[impl].append(run_worker(args, preset, impl))
        rows = {impl: combine(found) for impl, found in runs.items()}
        for impl, row in rows.items():
            row["ratio"] = row["tokens_per_s"] / rows["torch"]["tokens_per_s"]
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
            print(f"{preset:12} {impl:13} {row['params'] / 1e6:7.0f}M {row['tokens_per_s']:10.0f} "
                  f"{row['step_ms']:9.1f} ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f}) {mfu:>6} "
                  f"{row['ratio']:6.2f} {row['peak_memory_gib']:6.2f} {row['final_loss']:7.3f}", flush=True)
            records.append(row)
        if "hpctrain-bf16" in rows:  # train.fp8 against hpctrain's own bf16
            fp8, bf16 = rows["hpctrain"], rows["hpctrain-bf16"]
            print(f"{preset:12} train.fp8={fp8_recipe(args.set)}: {fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x "
                  f"hpctrain-bf16's tokens/s, final loss {fp8['final_loss']:.4f} against "
                  f"{bf16['final_loss']:.4f} ({fp8['final_loss'] / bf16['final_loss'] - 1:+.2%})", flush=True)
    write_records(records, args.json, args.csv, list(FIELDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
