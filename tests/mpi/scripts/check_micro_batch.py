"""``train.micro_batch_size`` is gradient accumulation: the same training whatever the micro-batch.

    mpiexec -n 4 python -m mpi4py check_micro_batch.py --sizes 1,2,4

Two layouts: dp=2 (world ranks 0 and 1, a split communicator) and dp=2 x pp=2 (all 4 ranks). In each,
train ``--steps`` steps with the default micro-batching (micro_batch_size=0, one micro-batch) and with
every ``--sizes`` micro_batch_size; compare losses and final global parameters with the default run
(relative error <= ``--rtol``, float64) and check the dp reduction: every bucket is reduced exactly once
per step, after the last micro-batch's gradient is in (``flat.last_microbatch``), some of them during
that backward (before ``finish_reduction``), with the same bytes on the dp group whatever the micro-batch.
"""
import argparse

import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer

from global_params import global_parameters


def train(cfg, mpi_comm, tokens, steps):
    """Losses, global parameters (world rank 0 of ``mpi_comm``), reductions per step and dp bytes per step."""
    grid = ProcessGrid.from_config(cfg, discover(mpi_comm), mpi_world=mpi_comm, timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens)
    flat, starts = trainer.parts.params.flat, []
    original = flat.reducer.start

    def counted_start(bucket):
        starts.append((trainer.step, bucket.index, flat.last_microbatch))
        return original(bucket)

    flat.reducer.start = counted_start
    finish, in_backward = flat.finish_reduction, []

    def counted_finish():  # reductions started so far this step were launched by backward's hooks
        in_backward.append(sum(1 for s, _, _ in starts if s == trainer.step))
        return finish()

    flat.finish_reduction = counted_finish
    losses, dp_bytes = [], []
    for _ in range(steps):
        record = trainer.train_step()
        losses.append(record.loss)
        dp_bytes.append(record.groups.get("dp", {}).get("bytes_sent", 0))
    assert all(last for _, _, last in starts), f"a dp reduction started before the last micro-batch: {starts}"
    per_step = [sorted(b for s, b, _ in starts if s == k) for k in range(steps)]
    buckets = list(range(len(flat.buckets)))
    assert all(p == buckets for p in per_step), f"buckets reduced per step {per_step}, expected each of {buckets} once"
    assert all(n > 0 for n in in_backward), f"no reduction overlapped the last backward: {in_backward}"
    params = global_parameters(trainer)
    micro = (trainer.parts.layout.microbatches, trainer.parts.layout.micro_batch)
    grid.close()
    return losses, params, len(starts) // steps, dp_bytes, micro


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def compare(name, result, reference, rtol):
    losses, params, reductions, dp_bytes, micro = result
    ref_losses, ref_params, ref_reductions, ref_bytes, _ = reference
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert loss_err <= rtol, f"{name}: losses {losses} vs {ref_losses} (rel {loss_err:.2e})"
    worst = max((rel_err(params[k], ref_params[k]), k) for k in ref_params)
    assert worst[0] <= rtol, f"{name}: parameter {worst[1]} rel err {worst[0]:.2e}"
    assert reductions == ref_reductions, f"{name}: {reductions} bucket reductions per step vs {ref_reductions}"
    assert dp_bytes == ref_bytes, f"{name}: dp bytes per step {dp_bytes} vs {ref_bytes}"
    print(f"OK {name}: {micro[0]} micro-batch(es) of {micro[1]}, loss rel err {loss_err:.1e}, worst param rel "
          f"err {worst[0]:.1e}, {reductions} bucket reductions and {dp_bytes[0]} dp bytes per step", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rtol", type=float, default=1e-10)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    base = ["data.max_bytes=100000", "train.global_batch=8", "train.seq_len=16", "model.n_layers=2",
            "train.dtype=float64", "train.warmup_steps=1", "train.lr=1e-2", "parallel.bucket_mb=0.02",
            "comm.intra_node=mpi", "model.tie_embeddings=false"]
    cfg0 = load_config(None, base)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    checks = 0
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    for layout, comm in (("dp=2", pair), ("dp=2 x pp=2", world)):
        if comm == MPI.COMM_NULL:
            continue
        sizes = ["parallel.dp=2", f"parallel.pp={2 if 'pp' in layout else 1}"]
        reference = train(load_config(None, base + sizes), comm, tokens, args.steps)
        for size in (int(s) for s in args.sizes.split(",")):
            result = train(load_config(None, base + sizes + [f"train.micro_batch_size={size}"]), comm, tokens,
                           args.steps)
            if comm.Get_rank() == 0:
                compare(f"{layout} micro_batch_size={size}", result, reference, args.rtol)
                checks += 1
    if pair != MPI.COMM_NULL:
        pair.Free()
    world.Barrier()
    if world.Get_rank() == 0:
        print(f"MICRO-BATCH OK {checks} runs")


if __name__ == "__main__":
    main()
