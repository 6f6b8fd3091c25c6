"""The planner's activation memory against the engine's, rank by rank.

    mpiexec -n 2 python check_activations.py

For each layout of 2 ranks (every pipeline schedule at pp = 2 with 4 micro-batches,
interleaved with 2 too; tp = 2 with and without
sequence parallelism, GELU and SwiGLU with grouped KV heads): one training step metered
(``PipelineExecutor.meter_activations``: the peak of what autograd saves and the executor holds between
actions, a deferred W's included) against ``hpctrain.sweep.predict.planned_activations`` for the rank's
stage. Fails (exit 1, every rank) where a ratio leaves [``--low``, ``--high``], or where ZB-H1 holds more
than 1.1x 1F1B's first rank (issue #53's memory target).
"""
import argparse
import sys

import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.runtime.launcher import discover
from hpctrain.sweep.predict import planned_activations
from hpctrain.train.trainer import Trainer

MODEL = ["model.preset=custom", "model.vocab_size=256", "model.d_model=128", "model.n_layers=4", "model.n_heads=4",
         "model.max_seq_len=64", "model.tie_embeddings=false", "train.dtype=float32", "train.seq_len=64",
         "train.global_batch=8", "train.steps=4", "train.progress=false", "model.mlp=swiglu", "model.positions=rope",
         "model.d_ff=384", "model.n_kv_heads=4"]
PIPELINE = ["parallel.pp=2", "parallel.microbatches=4"]
LAYOUTS = {
    "1f1b": PIPELINE + ["parallel.schedule=1f1b"],
    "interleaved V=2": PIPELINE + ["parallel.schedule=interleaved", "parallel.virtual_stages=2"],
    "interleaved V=2 M=2": PIPELINE + ["parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                       "parallel.microbatches=2"],  # M = pp: every forward first
    "zb-h1": PIPELINE + ["parallel.schedule=zb-h1"],
    "zb-v": PIPELINE + ["parallel.schedule=zb-v", "parallel.virtual_stages=2"],
    "tp=2 sp gelu": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.mlp=gelu", "model.positions=learned",
                     "model.d_ff=512"],
    "tp=2 gqa": ["parallel.tp=2", "model.n_kv_heads=2", "parallel.microbatches=2"],
}


def measure(overrides: list[str], tokens) -> tuple[float, float]:
    """(measured peak, planned) activation bytes of this rank, after one unmetered step."""
    cfg = load_config(None, MODEL + overrides)
    grid = ProcessGrid.from_config(cfg, discover(), timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens)
    trainer.train_step()
    executor = trainer.parts.executor
    meter = executor.meter_activations()
    trainer.train_step()
    planned = planned_activations(cfg, MPI.COMM_WORLD.Get_size())[executor.rank]
    grid.close()
    return float(meter.peak), planned


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--low", type=float, default=0.85)
    p.add_argument("--high", type=float, default=1.10)
    args = p.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    tokens = load_tokens_collective(world, "builtin", "", 300_000)
    problems, peaks = [], {}
    for name, overrides in LAYOUTS.items():
        measured, planned = measure(overrides, tokens)
        rows = world.allgather((measured, planned))
        peaks[name] = [m for m, _ in rows]
        cells = " ".join(f"r{r}: {m / 2**20:.2f}/{q / 2**20:.2f} MiB {m / q:.3f}x" for r, (m, q) in enumerate(rows))
        if world.Get_rank() == 0:
            print(f"rank 0 {name}: measured/planned {cells}", flush=True)
        problems += [f"{name} rank {r}: measured {m / q:.3f}x the plan" for r, (m, q) in enumerate(rows)
                     if not args.low <= m / q <= args.high]
    if max(peaks["zb-h1"]) > 1.1 * peaks["1f1b"][0]:  # issue #53: ZB-H1's peak within 1.1x 1F1B's
        problems.append(f"zb-h1 holds {max(peaks['zb-h1']) / 2**20:.2f} MiB, 1f1b's first rank "
                        f"{peaks['1f1b'][0] / 2**20:.2f}")
    for problem in problems:
        print(f"FAIL {problem}", file=sys.stderr, flush=True)
    if not problems and world.Get_rank() == 0:
        print("OK activations within the plan", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
