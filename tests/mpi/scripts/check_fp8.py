"""train.fp8 (emulated) in every layout computes what one process computes in fp8.

    mpiexec -n 2 python -m mpi4py check_fp8.py --layouts "1,2,1|sp;1,1,2;2,1,1|zero3;1,2,1|sp,amax=dp" [overrides]

For each layout "dp,tp,pp[,cp,ep]" (words after "|": ``sp`` sequence parallelism, ``zero3`` ZeRO-3,
``amax=AXIS`` the amaxes max-reduced over that grid axis instead of tp: the wrong group) train ``--steps``
steps and compare the losses with a one-process run of the same config (world rank 0 on MPI.COMM_SELF). The
micro-batch is ``train.micro_batch_size`` in every run, so every activation is scaled over the same tokens.
Prints ``OK <layout>: loss rel err E`` when within ``--rtol`` (``FAIL`` else); a wrong-group layout prints
``BREAKS`` when it is off by more than ``--wrong`` (``HOLDS`` else). Then ``FP8 OK`` when every line is OK or
BREAKS.
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
    """Collective over ``mpi_world``: (the losses of ``steps`` steps, the fp8 stats of the last one)."""
    grid = ProcessGrid.from_config(cfg, discover(mpi_world), mpi_world=mpi_world, timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens)
    if amax_group:  # test-only: the amaxes reduced over another group than tp
        use_fp8(trainer.parts.stages, trainer.fp8.recipe, grid.comm(amax_group), trainer.fp8.stats,
                cp_comm=grid.comm("cp"))
    losses, stats = [], {}
    for _ in range(steps):
        metrics = trainer.train_step()
        losses.append(metrics.loss)
        stats = {k: v for k, v in metrics.as_dict().items() if k.startswith("fp8_")}
    grid.close()
    return losses, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--wrong", type=float, default=1e-3, help="a wrong-group layout must be off by more")
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
    good = True
    for entry in args.layouts.split(";"):
        layout, _, words = entry.partition("|")
        words = words.split(",")
        dp, tp, pp, cp, ep = ([int(v) for v in layout.split(",")] + [1, 1])[:5]
        sp, zero = "sp" in words, 3 if "zero3" in words else 0
        amax_group = next((w[5:] for w in words if w.startswith("amax=")), "")
        cfg = load_config(None, base + [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                        f"parallel.cp={cp}", f"parallel.ep={ep}", f"parallel.sequence_parallel={sp}",
                                        f"parallel.zero={zero}"])
        losses, stats = train(cfg, world, tokens, args.steps, amax_group)
        if world.Get_rank() == 0:
            err = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
            if amax_group:
                tag = "BREAKS" if err > args.wrong else "HOLDS"
            else:
                tag = "OK" if err <= args.rtol else "FAIL"
            good = good and tag in ("OK", "BREAKS")
            print(f"{tag} {entry} {cfg.train.fp8} {cfg.train.dtype}: loss rel err {err:.2e} over {args.steps} steps "
                  f"(last loss {losses[-1]:.6f}, one process {reference[-1]:.6f}; last step's casts: {stats})",
                  flush=True)
    if world.Get_rank() == 0:
        print("FP8 OK" if good else "FP8 FAILED", flush=True)


if __name__ == "__main__":
    main()
