"""Compiled training (train.compile=true, inductor) equals eager training in every layout given.

    mpiexec -n K python -m mpi4py check_compile.py --layouts "2,2,1;1,2,2" [section.key=value ...]

For each layout "dp,tp,pp[,cp[,ep]]][+sp]" whose product (without ep) is K (``+sp``: sequence parallel): train ``--steps`` steps eagerly, then compiled, from the same
seed and data; world rank 0 compares the losses and the final GLOBAL parameters (relative error <= ``--rtol``).
The compiled runs also check that the dp reduction still overlaps the backward: every bucket of the replica
group (dp x cp > 1) was launched by the gradient hooks before ``finish_reduction``, the first while other buckets
were still waiting for gradients; and torch.compile broke the blocks' graphs only at tp collectives and ring attention
(none with tp = cp = 1), and at the MoE layers, which run eagerly (with ``moe.num_experts`` set). Compare with ``optim.name=sgd``: AdamW's first steps move every weight by about lr x sign(grad),
so float32 rounding of near-zero gradients shows in the weights (eager tp=2 against one process differs by
~4e-4 there too); SGD's updates are linear in the gradients.
"""
import argparse

from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.models.compile import compile_report
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer

from global_params import global_parameters


def watch_launches(flat) -> list:
    """Record, for each bucket launch, (launched before finish_reduction, grads still awaited elsewhere)."""
    launches, in_backward = [], [True]
    launch, finish = flat._launch, flat.finish_reduction

    def recording_launch(bucket):
        waiting = sum(b.pending for b in flat.buckets if b is not bucket and not b.deferred)
        launches.append((in_backward[0], waiting))
        return launch(bucket)

    def recording_finish():
        in_backward[0] = False
        finish()
        in_backward[0] = True

    flat._launch, flat.finish_reduction = recording_launch, recording_finish
    return launches


def train(cfg, world, tokens, steps, timeout_s):
    grid = ProcessGrid.from_config(cfg, discover(world), mpi_world=world, timeout_s=timeout_s)
    trainer = Trainer(cfg, grid, tokens=tokens)
    dense = trainer.parts.params.flat.parts[0]  # the dense parameters' FlatParams (with experts, theirs second)
    launches = watch_launches(dense)
    losses = [trainer.train_step().loss for _ in range(steps)]
    report = compile_report(trainer.parts.compile_since) if trainer.parts.compiled else None
    params = global_parameters(trainer)
    regular = sum(not b.deferred for b in dense.buckets)
    grid.close()
    return losses, params, launches, regular, report


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help='";"-separated "dp,tp,pp[,cp[,ep]][+sp]"')
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--timeout-s", default="300",
                    help="comm timeout (a wait on a rank compiling is not a hang: the watchdog says so and waits); "
                         "\";\"-separated: one per layout, in order")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    base = ["data.max_bytes=200000", "train.global_batch=8", "train.seq_len=32", "model.n_layers=2",
            "model.d_ff=128", "train.dtype=float32", "train.warmup_steps=1", "train.lr=1e-2",
            "parallel.bucket_mb=0.05", "train.progress=false"] + args.overrides
    cfg0 = load_config(None, base)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    layouts = args.layouts.split(";")
    timeouts = [float(t) for t in args.timeout_s.split(";")]
    timeouts += timeouts[-1:] * (len(layouts) - len(timeouts))
    for layout, timeout_s in zip(layouts, timeouts):
        sizes, sp = layout.removesuffix("+sp"), layout.endswith("+sp")
        dp, tp, pp, cp, ep = ([int(v) for v in sizes.split(",")] + [1, 1])[:5]
        micro = 8 // dp // 4  # every layout feeds micro-batches of 4 sequences: one graph shape for all
        layout_keys = [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}",
                       f"parallel.ep={ep}", f"parallel.microbatches={micro}", f"parallel.sequence_parallel={str(sp).lower()}"]
        runs = {mode: train(load_config(None, base + layout_keys + [f"train.compile={mode}"]), world, tokens,
                            args.steps, timeout_s) for mode in ("false", "true")}
        (eager_losses, eager_params, *_), (losses, params, launches, regular, report) = runs["false"], runs["true"]
        name = f"dp={dp} tp={tp} pp={pp} cp={cp} ep={ep}{' sp' if sp else ''}"
        breaks = int(report[0].split(", ")[1].split()[0])  # "torch.compile: G graph(s) compiled, B graph break(s)"
        if tp == cp == 1 and not cfg0.moe.num_experts:  # one graph per block shape, no break
            assert breaks == 0, f"{name}: {report}"
        else:  # the tp collectives, ring attention and MoE layers (torch.compiler.disable'd), nothing else, split the blocks
            assert breaks > 0 and all("by design" in line for line in report[1:]), f"{name}: {report}"
        if dp * cp > 1:  # hooks fired in the compiled backward: every regular bucket launched before finish_reduction
            early = [waiting for during, waiting in launches if during]
            assert len(early) == regular * args.steps and regular > 1, f"{name}: launches {launches}, {regular} buckets"
            assert max(early) > 0, f"{name}: no bucket launched while others awaited gradients: {launches}"
        if world.Get_rank() == 0:
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
            assert loss_err <= args.rtol, f"{name}: losses {losses} vs eager {eager_losses} (rel {loss_err:.1e})"
            assert params.keys() == eager_params.keys(), f"{name}: parameter names differ"
            worst = max((rel_err(params[k], eager_params[k]), k) for k in eager_params)
            assert worst[0] <= args.rtol, f"{name}: parameter {worst[1]} rel err {worst[0]:.1e}"
            print(f"OK {name}: compiled = eager, loss rel err {loss_err:.1e}, worst param rel err {worst[0]:.1e} ({worst[1]}); "
                  f"{len(launches)} bucket launches; {report[0]}", flush=True)
    if world.Get_rank() == 0:
        print("COMPILE OK", flush=True)


if __name__ == "__main__":
    main()
