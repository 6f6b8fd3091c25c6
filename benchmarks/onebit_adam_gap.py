"""How far 1-bit Adam ends from dense AdamW, over seeds and warm-ups (issue #37 item 10).

For each seed, one dense AdamW run and one 1-bit Adam run per warm-up, on ``--ranks`` ranks of the tiny
config (dp = ranks, tp = pp = 1, one micro-batch), ``--steps`` steps each. The gap is the mean loss of the
last 10 steps of 1-bit Adam over dense AdamW's, minus 1. Prints a table and writes CSV/JSON; the range it
measures is what ``hpctrain/compression/methods.py`` (``ONEBIT_ADAM_GAP``) warns with at start-up.

    python benchmarks/onebit_adam_gap.py --seeds 1,2,3,1234 --warmups 18,24,36 --json gap.json --csv gap.csv
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hpctrain.bench.report import write_records

ROOT = Path(__file__).resolve().parent.parent


def mean_last_loss(run_dir: Path, k: int = 10) -> float:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if '"event"' not in line]
    return sum(r["loss"] for r in rows[-k:]) / k


def train(run_dir: Path, ranks: int, steps: int, seed: int, *extra: str) -> float:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = ["timeout", "900", str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(ranks), sys.executable,
           "-m", "hpctrain.cli", "train", "--config", "configs/tiny.toml", "--resume", "none", "parallel.tp=1",
           "parallel.pp=1", "parallel.microbatches=1", f"train.steps={steps}", f"train.seed={seed}",
           "optim.name=adamw", "train.progress=false", f"train.run_dir={run_dir}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIR_CVAR_CH4_PROGRESS_THROTTLE="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return mean_last_loss(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,1234")
    parser.add_argument("--warmups", default="18,24,36", help="1-bit Adam warm-up steps (15-30%% of 120)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--json", default="")
    parser.add_argument("--csv", default="")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    warmups = [int(w) for w in args.warmups.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="onebit-gap-") as tmp:
        for seed in seeds:
            dense = train(Path(tmp) / f"dense-{seed}", args.ranks, args.steps, seed)
            for warmup in warmups:
                loss = train(Path(tmp) / f"oba-{seed}-{warmup}", args.ranks, args.steps, seed,
                             "compression.method=onebit-adam", f"compression.warmup_steps={warmup}")
                rows.append({"seed": seed, "warmup": warmup, "dense_loss": dense, "onebit_adam_loss": loss,
                             "gap": loss / dense - 1})
                print(f"seed {seed:5d} warm-up {warmup:3d}: dense {dense:.4f}  1-bit Adam {loss:.4f}  "
                      f"gap {100 * rows[-1]['gap']:+.1f}%", flush=True)
    print(f"\n{'warm-up':>8} {'gap min':>8} {'gap max':>8} {'within 3%':>10}")
    for warmup in warmups:
        gaps = [r["gap"] for r in rows if r["warmup"] == warmup]
        print(f"{warmup:>8} {100 * min(gaps):>+7.1f}% {100 * max(gaps):>+7.1f}% "
              f"{sum(abs(g) <= 0.03 for g in gaps):>6}/{len(gaps)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "ranks": args.ranks, "rows": rows}, indent=1))
    write_records(rows, None, args.csv, list(rows[0]))


if __name__ == "__main__":
    main()
