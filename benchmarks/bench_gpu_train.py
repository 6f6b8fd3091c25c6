#!/usr/bin/env python
"""Training throughput on one GPU: hpctrain's Trainer vs a plain PyTorch mixed-precision loop.

    mpiexec -n 1 python benchmarks/bench_gpu_train.py --preset gpt2-small --seq-len 1024 --batch 8 \
        --json bench_gpu_train.json --csv bench_gpu_train.csv

Same model (hpctrain's ``GPTStage``, seeded by name), same batches (hpctrain's sampler over the
builtin corpus), same AdamW hyper-parameters and gradient clipping at 1.0:

    hpctrain     the Trainer with train.device=cuda, train.dtype=bfloat16: bf16 parameters, fp32 main
                 grads in flat buckets, flat fp32 AdamW masters, global grad norm (the path a multi-rank
                 run takes, with dp/tp/pp = 1)
    torch-amp    the common PyTorch recipe: fp32 parameters, ``torch.autocast(bfloat16)``,
                 ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_``

Method: ``--warmup`` steps each, then ``--rounds`` rounds of ``--steps`` timed steps of each
implementation, alternating; a step is timed with ``torch.cuda.synchronize`` on both ends; the median
over all timed steps is reported. MFU = 6N-style FLOPs per token (``flops_per_token``) x tokens/s /
the GPU's dense bf16 peak (``hpctrain/runtime/device.py``). ``ratio`` = tokens/s / torch-amp's.
Needs CUDA; exits with a message otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hpctrain.bench.report import run_benchmark, write_records

FIELDS = ("impl", "preset", "seq_len", "batch", "tokens_per_s", "step_ms", "step_ms_min", "step_ms_max",
          "mfu", "ratio", "final_loss", "device")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--csv")
    return p.parse_args()


def make_trainer(args):
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, [f"model.preset={args.preset}", "model.vocab_size=0", f"train.seq_len={args.seq_len}",
                             f"train.global_batch={args.batch}", "train.dtype=bfloat16", "train.device=cuda",
                             "train.steps=1000", "parallel.tp=1", "parallel.pp=1", "train.progress=false",
                             "data.max_bytes=20000000"])
    grid = ProcessGrid.from_config(cfg, discover())
    return Trainer(cfg, grid, device=torch.device("cuda", torch.cuda.current_device())), grid


class TorchAmp:
    """The peer: the same GPTStage in fp32 under autocast(bf16), fused AdamW, clip_grad_norm_."""

    def __init__(self, trainer):
        from hpctrain.models.gpt import GPTStage

        m, t, o = trainer.model_cfg, trainer.cfg.train, trainer.cfg.optim
        self.model = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, tp_comm=None,
                              dtype=torch.float32, seed=t.seed).cuda()
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
        self.batches, self.tokens = trainer.batches, t.global_batch * t.seq_len

    def train_step(self):
        inputs, targets = (b.pin_memory().cuda(non_blocking=True) for b in self.batches.next_batch())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.model.loss_sum(self.model(inputs), targets) / self.tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


def timed(step) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = step()
    loss = result.loss if hasattr(result, "loss") else result
    torch.cuda.synchronize()
    return time.perf_counter() - start, loss


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_train: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    from hpctrain.models.gpt import flops_per_token
    from hpctrain.runtime.device import peak_tflops

    trainer, grid = make_trainer(args)
    impls = {"hpctrain": trainer.train_step, "torch-amp": TorchAmp(trainer).train_step}
    times = {name: [] for name in impls}
    losses = {}
    for name, step in impls.items():
        for _ in range(args.warmup):
            timed(step)
    for _ in range(args.rounds):
        for name, step in impls.items():
            for _ in range(args.steps):
                seconds, losses[name] = timed(step)
                times[name].append(seconds)
    tokens = args.batch * args.seq_len
    fpt = flops_per_token(trainer.model_cfg, args.seq_len)
    peak = peak_tflops(trainer.device, torch.bfloat16)
    records = []
    for name in impls:
        med = statistics.median(times[name])
        records.append({"impl": name, "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch,
                        "tokens_per_s": tokens / med, "step_ms": med * 1e3, "step_ms_min": min(times[name]) * 1e3,
                        "step_ms_max": max(times[name]) * 1e3,
                        "mfu": fpt * tokens / med / (peak * 1e12) if peak else None,
                        "final_loss": losses[name], "device": torch.cuda.get_device_name()})
    peer = records[-1]["tokens_per_s"]
    print(f"{'impl':10} {'tokens/s':>10} {'step ms (min-max)':>22} {'MFU':>6} {'ratio':>6} {'loss':>7}")
    for r in records:
        r["ratio"] = r["tokens_per_s"] / peer
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['impl']:10} {r['tokens_per_s']:10.0f} {r['step_ms']:8.1f} ({r['step_ms_min']:.1f}-"
              f"{r['step_ms_max']:.1f}) {mfu:>6} {r['ratio']:6.2f} {r['final_loss']:7.3f}")
    write_records(records, args.json, args.csv, FIELDS)
    grid.close()
    return 0


if __name__ == "__main__":
    run_benchmark(main)
