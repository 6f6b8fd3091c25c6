#!/usr/bin/env python
"""LoRA against full fine-tuning of the same imported model: step time, peak memory, checkpoint size, with
transformers (+ peft) training the same model on the same batch shape as the peer.

    python benchmarks/bench_lora.py --json lora.json --csv lora.csv

The driver makes a Llama with transformers (random weights, float32, ``--d-model``/``--layers``/...), imports
it (``hpctrain import-hf``), then runs each mode in a fresh process (one rank, one torch thread), so each
peak is its own:
- ``hpctrain-full``: every weight trains (``model.init_from`` = the HF directory);
- ``hpctrain-lora``: ``lora.rank`` on q, v (PEFT's Llama default); ``hpctrain-lora-all``: on all seven;
- ``peft-lora``, ``torch-full``: ``LlamaForCausalLM`` (+ ``peft.get_peft_model`` with the same r, alpha,
  targets), AdamW over the trainable parameters, the same [batch, seq] of token ids (SDPA attention both).
Per mode: ``trainable_m`` (millions of trainable parameters), ``step_s`` (median of ``--steps`` after
``--warmup``), ``peak_mb`` (VmHWM during the timed steps, reset before them), ``above_base_mb`` (that peak
less the resident memory just before the model was built, after the imports and the data: model, optimizer,
gradients, activations),
``ckpt_mb``/``ckpt_s`` (hpctrain modes: one synchronous checkpoint; the LoRA modes refer to their base) and
``ckpt_copy_mb`` (the LoRA checkpoint with ``lora.checkpoint_base=copy``), and the ratios to full
fine-tuning of the same implementation (``step_vs_full``, ``mem_vs_full``: of above_base_mb).
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
import tempfile  # noqa: E402
import time  # noqa: E402

FIELDS = ["mode", "trainable_m", "step_s", "tokens_per_s", "step_vs_full", "peak_mb", "above_base_mb", "mem_vs_full",
          "ckpt_mb", "ckpt_s", "ckpt_copy_mb"]
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
MODES = ("hpctrain-full", "hpctrain-lora", "hpctrain-lora-all", "torch-full", "peft-lora")


def make_model(args, directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.d_ff,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)


def dir_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names) / 2**20


def targets_of(mode: str) -> list[str]:
    return list(TARGETS) if mode.endswith("-all") else ["q", "v"]


def timed(step, warmup: int, steps: int) -> tuple[list[float], float]:
    """(step seconds, peak MiB) of ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    from hpctrain.bench.report import resident_mb

    for _ in range(warmup):
        step()
    resident_mb("VmRSS", reset=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times, resident_mb()


def hpctrain_worker(args) -> dict:
    from mpi4py import MPI

    from hpctrain.checkpoint.manager import CheckpointManager
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.config import load_config
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.interop.base_ref import make_reference
    from hpctrain.bench.report import resident_mb
    from hpctrain.interop.sources import init_weights, open_source
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer

    lora = args.worker != "hpctrain-full"
    record = {}
    for checkpoint_base in (("reference", "copy") if lora else ("reference",)):
        run_dir = tempfile.mkdtemp(dir=args.tmp)
        overrides = [f"model.init_from={args.hf}", f"train.seq_len={args.seq}", f"train.global_batch={args.batch}",
                     "parallel.microbatches=1", "train.progress=false", "comm.timeout_s=0", "checkpoint.async=false",
                     f"train.run_dir={run_dir}", "train.lr=1e-4", f"lora.checkpoint_base={checkpoint_base}"]
        if lora:
            overrides += [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}",
                          f"lora.targets=[{','.join(targets_of(args.worker))}]"]
        cfg = load_config(args.toml, overrides)
        tokens = load_tokens_collective(MPI.COMM_WORLD, cfg.data.source, cfg.data.cache_dir, cfg.data.max_bytes)
        base_mb = resident_mb("VmRSS")  # imports and data loaded: what follows is the model's
        grid = ProcessGrid.from_config(cfg, discover(), timeout_s=0)
        trainer = Trainer(cfg, grid, tokens=tokens)
        init_weights(trainer.state, args.hf, grid.world)
        if lora and checkpoint_base == "reference":
            trainer.state.base_reference = make_reference(args.hf, trainer.parts.model_cfg, grid.world, open_source)
        if not record:
            times, peak = timed(trainer.train_step, args.warmup, args.steps)
            trainable = sum(p.spec.valid_numel for p in trainer.parts.local_model.parameters() if p.requires_grad)  # no padding rows
            record = dict(trainable_m=round(trainable / 1e6, 3), step_s=round(statistics.median(times), 3),
                          peak_mb=round(peak, 1), above_base_mb=round(peak - base_mb, 1))
        else:
            trainer.train_step()
        manager = CheckpointManager(cfg.checkpoint, grid, run_dir)
        start = time.perf_counter()
        manager.save(trainer.state, sync=True)
        manager.close()
        elapsed, size = time.perf_counter() - start, dir_mb(os.path.join(run_dir, "checkpoints"))
        if checkpoint_base == "reference":
            record.update(ckpt_mb=round(size, 2), ckpt_s=round(elapsed, 3))
        else:
            record["ckpt_copy_mb"] = round(size, 2)
        grid.close()
        del trainer
    return record


def torch_worker(args) -> dict:
    import peft
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from hpctrain.bench.report import resident_mb

    torch.set_num_threads(1)
    base_mb = resident_mb("VmRSS")  # imports done: what follows is the model's
    model = LlamaForCausalLM.from_pretrained(args.hf, dtype=torch.float32, attn_implementation="sdpa")
    if args.worker == "peft-lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                           target_modules=[TARGETS[t] for t in targets_of(args.worker)],
                                                           task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        logits = model(input_ids=ids[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, peak = timed(step, args.warmup, args.steps)
    return dict(trainable_m=round(sum(p.numel() for p in trainable) / 1e6, 3), step_s=round(statistics.median(times), 3),
                peak_mb=round(peak, 1), above_base_mb=round(peak - base_mb, 1))


def run_worker(args) -> int:
    record = (hpctrain_worker if args.worker.startswith("hpctrain") else torch_worker)(args)
    with open(args.out, "w") as f:
        json.dump({"mode": args.worker, **record}, f)
    return 0


def run_driver(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:  # the model, its checkpoint, the workers' runs
        return drive(args, tmp)


def drive(args, tmp: str) -> int:
    from hpctrain.bench.report import write_records
    from hpctrain.cli import dispatch

    hf = os.path.join(tmp, "hf")
    make_model(args, hf)
    assert dispatch(["import-hf", hf, "--out", os.path.join(tmp, "ckpt")]) == 0
    records = []
    for mode in args.modes.split(","):
        out = os.path.join(tmp, f"{mode}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", out, "--hf", hf, "--tmp", tmp,
               "--toml", os.path.join(tmp, "ckpt", "model.toml"), *(f"--{k.replace('_', '-')}={v}" for k, v in
               vars(args).items() if k in ("seq", "batch", "rank", "steps", "warmup"))]
        print(f"{mode}: running", flush=True)
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL)
        records.append(json.load(open(out)))
    full = {r["mode"].split("-")[0]: r for r in records if r["mode"].endswith("-full")}
    for r in records:
        r["tokens_per_s"] = round(args.batch * args.seq / r["step_s"])
        ref = full.get("hpctrain" if r["mode"].startswith("hpctrain") else "torch")
        r["step_vs_full"] = round(r["step_s"] / ref["step_s"], 3) if ref else None
        r["mem_vs_full"] = round(r["above_base_mb"] / ref["above_base_mb"], 3) if ref else None
    print(" ".join(f"{f:>17}" for f in FIELDS))
    for r in records:
        print(" ".join(f"{'-' if r.get(f) is None else r[f]:>17}" for f in FIELDS))
    write_records(records, args.json, args.csv, FIELDS)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8, help="lora.rank (alpha = 2 rank)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--csv")
    for hidden in ("--worker", "--out", "--hf", "--tmp", "--toml"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    return run_worker(args) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
