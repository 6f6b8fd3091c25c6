"""train.fp8 (emulated) in every layout computes what one process computes in fp8.

    mpiexec -n 2 python -m mpi4py check_fp8.py --layouts "1,2,1|sp;1,1,2;2,1,1|zero3" --rtol 1e-5 [overrides]

For each layout "dp,tp,pp[,cp,ep]" (``|sp``, ``|zero3``: sequence parallelism, ZeRO-3) train ``--steps`` steps and
compare the losses with a one-process run of the same config (world rank 0 on MPI.COMM_SELF). The micro-batch
is ``train.micro_batch_size`` in every run, so every activation is scaled over the same tokens. Prints
``OK <layout>: loss rel err E`` and ``FP8 OK``, or with ``--amax-group AXIS`` (the amaxes max-reduced over that
grid axis instead of tp: the wrong group) ``WRONG <layout>: loss rel err E`` and ``FP8 WRONG``.
"""
import argparse

from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.models.fp8 import use_fp8
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer


def train(cfg, mpi_world, tokens, steps, amax_group=""):
    grid = ProcessGrid.from_config(cfg, discover(mpi_world), mpi_world=mpi_world, timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens)
    if amax_group:  # test-only: the amaxes reduced over another group than tp
        use_fp8(trainer.parts.stages, trainer.fp8.recipe, grid.comm(amax_group), trainer.fp8.stats)
    losses = [trainer.train_step().loss for _ in range(steps)]
    stats = trainer.fp8.stats.collect(grid.world) if trainer.fp8 is not None else {}
    grid.close()
    return losses, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--amax-group", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    base = ["data.max_bytes=200000", "train.global_batch=8", "train.micro_batch_size=2", "train.seq_len=16",
            "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
            "train.dtype=float32", "train.fp8=tensorwise", "train.fp8_emulate=true", "train.warmup_steps=1",
            "train.lr=1e-2", "model.tie_embeddings=false"] + args.overrides
    cfg0 = load_config(None, base)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    reference = train(cfg0, MPI.COMM_SELF, tokens, args.steps)[0] if world.Get_rank() == 0 else None
    world.Barrier()
    worst = 0.0
    for entry in args.layouts.split(";"):
        layout, _, words = entry.partition("|")
        dp, tp, pp, cp, ep = ([int(v) for v in layout.split(",")] + [1, 1])[:5]
        sp, zero = "sp" in words.split(","), 3 if "zero3" in words.split(",") else 0
        cfg = load_config(None, base + [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                        f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.sequence_parallel={sp}",
                                        f"parallel.zero={zero}"])
        losses, stats = train(cfg, world, tokens, args.steps, args.amax_group)
        if world.Get_rank() == 0:
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            worst = max(worst, err)
            ok = err <= args.rtol
            tag = ("WRONG" if not ok else "SAME") if args.amax_group else ("OK" if ok else "FAIL")
            print(f"{tag} {entry} {cfg.train.fp8}: loss rel err {err:.2e} (losses {losses[-1]:.5f} vs "
                  f"{reference[-1]:.5f}; {stats})", flush=True)
    if world.Get_rank() == 0:
        print(f"worst loss rel err {worst:.2e}")
        if args.amax_group:
            print("FP8 WRONG" if worst > args.rtol else "FP8 SAME")
        else:
            print("FP8 OK" if worst <= args.rtol else "FP8 FAIL")


if __name__ == "__main__":
    main()
