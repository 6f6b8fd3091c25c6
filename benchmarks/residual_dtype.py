"""Which residual stream a bfloat16 model should keep by default (issue #52 item 5): float32 against bfloat16
with ``model.residual_dtype=auto`` (the stream in bf16) and with ``float32`` (Megatron's fp32 residual).

A 48-layer GPT (``--d-model`` wide, GELU, learned positions, tied embeddings: GPT-2's layout) on one CPU process,
``--steps`` steps of 8 x 64 tokens of the builtin corpus, at two learning rates: the loop's (3e-3, constant, no
warm-up) and a warmed-up one (3e-3 after ``--warmup`` steps, cosine). For each, the mean and max |loss - float32's|
over every step; the default of ``model.residual_dtype`` should be the variant with the smaller mean. Prints a
table and writes CSV/JSON. Runs ``--jobs`` trainings at a time, one process each (no mpiexec).

    python benchmarks/residual_dtype.py --steps 200 --json residual.json --csv residual.csv
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpctrain.bench.report import write_records

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"float32": ["train.dtype=float32"],
            "bf16 auto": ["train.dtype=bfloat16", "model.residual_dtype=auto"],
            "bf16 fp32-residual": ["train.dtype=bfloat16", "model.residual_dtype=float32"]}


def schedules(warmup: int) -> dict[str, list[str]]:
    return {"3e-3 constant": ["train.lr=3e-3", "train.warmup_steps=0", "train.lr_schedule=constant"],
            f"3e-3 warm-up {warmup}": ["train.lr=3e-3", f"train.warmup_steps={warmup}", "train.lr_schedule=cosine",
                                       "train.min_lr=3e-4"]}


def losses(run_dir: Path, args, keys: list[str]) -> list[float]:
    cmd = [sys.executable, "-m", "hpctrain.cli", "train", "--config", "configs/tiny.toml", "--resume", "none",
           "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", "model.n_layers=48",
           f"model.d_model={args.d_model}", "model.n_heads=4", "model.n_kv_heads=4", f"model.d_ff={4 * args.d_model}",
           "model.mlp=gelu", "model.positions=learned", "model.tie_embeddings=true", "train.global_batch=8",
           "train.seq_len=64", f"train.steps={args.steps}", f"train.seed={args.seed}", "data.max_bytes=2000000",
           "train.progress=false", "checkpoint.interval=0", f"train.run_dir={run_dir}", *keys]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"loss"' in line]
    return [r["loss"] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50, help="warm-up steps of the warmed-up schedule")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--jobs", type=int, default=2, help="trainings at a time (one process each)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per training")
    parser.add_argument("--json", default="")
    parser.add_argument("--csv", default="")
    args = parser.parse_args()
    runs = [(s, v, skeys + vkeys) for s, skeys in schedules(args.warmup).items() for v, vkeys in VARIANTS.items()]
    with tempfile.TemporaryDirectory(prefix="residual-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        curves = dict(zip([(s, v) for s, v, _ in runs], pool.map(
            lambda run: losses(Path(tmp) / f"{run[0]}-{run[1]}".replace(" ", "_"), args, run[2]), runs)))
    rows = []
    for schedule in schedules(args.warmup):
        reference = curves[(schedule, "float32")]
        for variant in VARIANTS:
            if variant == "float32":
                continue
            diffs = [abs(a - b) for a, b in zip(curves[(schedule, variant)], reference)]
            rows.append({"schedule": schedule, "variant": variant, "steps": len(diffs),
                         "mean_abs_diff": sum(diffs) / len(diffs), "max_abs_diff": max(diffs),
                         "final_loss": curves[(schedule, variant)][-1], "float32_final_loss": reference[-1]})
    print(f"48 layers, d_model {args.d_model}, {args.steps} steps, seed {args.seed}: |loss - float32's| per step")
    print(f"{'schedule':>18} {'variant':>20} {'mean':>8} {'max':>8} {'final':>8} {'fp32 final':>10}")
    for r in rows:
        print(f"{r['schedule']:>18} {r['variant']:>20} {r['mean_abs_diff']:>8.4f} {r['max_abs_diff']:>8.4f} "
              f"{r['final_loss']:>8.4f} {r['float32_final_loss']:>10.4f}")
    for schedule in schedules(args.warmup):
        best = min((r for r in rows if r["schedule"] == schedule), key=lambda r: r["mean_abs_diff"])
        print(f"closest to float32 at {schedule}: {best['variant']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows,
                                               "curves": {f"{s} | {v}": c for (s, v), c in curves.items()}}, indent=1))
    write_records(rows, None, args.csv, list(rows[0]))


if __name__ == "__main__":
    main()
