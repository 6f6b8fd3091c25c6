"""Every parallel layout trains like one process.

    mpiexec -n K python -m mpi4py check_fidelity.py --layouts "2,2,2;1,2,4" --variants "1f1b,sp,zero1" ...

For each layout "dp,tp,pp" (or "dp,tp,pp,cp", or "dp,tp,pp,cp,ep") whose product is K and each variant (schedule x sequence parallel x ZeRO),
train ``--steps`` steps from the same seed and data, then compare the loss sequence and the final
GLOBAL parameters with a single-process run of the same config that world rank 0 runs on
MPI.COMM_SELF. Relative error bound: ``--rtol`` (1e-10 in float64). With ``lora.rank`` > 0 (an override)
every run also checks that the frozen weights are bit-identical after training and every adapter moved.
"""
import argparse
import itertools

import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.parallel.buckets import is_allocated
from hpctrain.parallel.lora import is_adapter
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer

from global_params import global_parameters


def poison_freed_storage() -> None:
    """ZeRO 2/3: NaN into every bucket storage before it is freed (the allocator may hand the same memory back
    untouched), so a parameter or gradient read after its free, without a new gather, shows in the results."""
    from hpctrain.parallel import data_parallel
    from hpctrain.parallel.zero import gather as zero3

    original = data_parallel.free
    if getattr(original, "poisons", False):  # already (several runs in one process: check_fidelity_many.py)
        return

    def poisoned(tensor):
        tensor.fill_(float("nan"))
        original(tensor)

    poisoned.poisons = True  # type: ignore[attr-defined]
    data_parallel.free = zero3.free = poisoned


def train(cfg, mpi_world, tokens, steps):
    info = discover(mpi_world)
    grid = ProcessGrid.from_config(cfg, info, mpi_world=mpi_world, timeout_s=120)
    trainer = Trainer(cfg, grid, tokens=tokens)
    initial = global_parameters(trainer) if cfg.lora.rank else None
    losses = [trainer.train_step().loss for _ in range(steps)]
    flat = trainer.parts.params.flat
    with trainer.parts.params.gathered():
        for p in trainer.parts.local_model.parameters():  # vocabulary padding rows: never trained, exactly zero
            pad = p.spec.valid_shape[0] if p.spec.padded_dim is not None else p.shape[0]
            kept = p.requires_grad and (flat.zero_stage <= 1 or flat.bucket_of[id(p)].deferred)  # else freed
            grad = p.main_grad[pad:] if kept else torch.zeros(0)
            assert not p.detach()[pad:].any() and not grad.any(), f"{p.spec.name}: padding rows changed"
    if flat.zero_stage == 3:  # every unit's bucket (the experts' too) kept as a slice, none gathered between steps
        groups = flat.parts  # dense, then with expert parallelism the experts
        for group in groups:
            assert all(b.sliced and not is_allocated(b.param_values) for b in group.buckets if not b.deferred), \
                "a zero-3 unit left whole or gathered"
        if len(groups) > 1 and mpi_world.Get_rank() == 0:
            print(f"EXPERTS SHARDED over {groups[1].dp_size} rank(s), {len(groups[1].buckets)} bucket(s)", flush=True)
    params = global_parameters(trainer)
    if cfg.lora.rank:
        check_lora(trainer, initial, params)
    route = grid.intra_node  # how dp reduced CPU floats (comm.intra_node): shm, shm-hierarchical or mpi
    grid.close()
    return losses, params, route


def check_lora(trainer, initial, params):
    """A LoRA run: only the adapters are in the flat buffers (no grad, no optimizer state for the base);
    on world rank 0 (``params`` not None): every frozen weight is bit-identical to its initial value, every
    adapter factor moved."""
    assert all(is_adapter(p.spec.name) for p in trainer.parts.params.flat.params), "a frozen weight in the flat buffers"
    for p in trainer.parts.local_model.parameters():
        assert p.requires_grad == is_adapter(p.spec.name) and (p.requires_grad or p.grad is None), p.spec.name
    flat, frozen = trainer.parts.params.flat, trainer.parts.params.frozen
    if flat.zero_stage == 3:  # the frozen base sharded over the replica group too, nothing gathered between steps
        whole = sum(p.nbytes for p in trainer.parts.local_model.parameters() if not p.requires_grad)
        assert frozen.parts, "zero 3 left the frozen base whole"
        groups = frozen.parts  # the dense base, then with ep the experts' (over ep_replica)
        assert sum(p.nbytes for g in groups for b in g.buckets for p in b.params) == whole, "a frozen weight unsharded"
        for g in groups:
            mine = sum(p.nbytes for b in g.buckets for p in b.params)
            padding = len(g.buckets) * g.dp_size * g.slices.element_size()
            assert mine / g.dp_size <= g.memory_bytes() <= mine / g.dp_size + padding, (g.memory_bytes(), mine)
        assert not any(is_allocated(b.param_values) for b in frozen.buckets), "a frozen unit left gathered"
        print(f"FROZEN SHARDED {frozen.memory_bytes()} of {whole} bytes kept", flush=True)
    if params is None:
        return
    for name, value in params.items():
        if is_adapter(name):
            assert not torch.equal(value, initial[name]), f"adapter {name} did not train"
        else:
            assert torch.equal(value, initial[name]), f"frozen {name} changed"
    print(f"LORA OK {sum(map(is_adapter, params))} adapters trained, "
          f"{sum(not is_adapter(n) for n in params)} frozen weights bit-identical", flush=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def variant_combos(variants: str) -> list:
    """[((schedule, virtual stages), sequence parallel, zero)] of a --variants string."""
    if variants == "all":
        return list(itertools.product([("1f1b", 1), ("gpipe", 1)], [False, True], [0, 1]))
    combos = []
    for combo in variants.split("/"):
        words = combo.split(",")
        schedule = next(((w[:11], int(w[11:])) for w in words if w.startswith("interleaved")),
                        ("gpipe", 1) if "gpipe" in words else ("zb-h1", 1) if "zbh1" in words
                        else ("zb-v", 2) if "zbv" in words else ("1f1b", 1))
        zero = next((int(w[4:]) for w in words if w in ("zero1", "zero2", "zero3")), 0)
        combos.append((schedule, "sp" in words, zero))
    return combos


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", required=True, help='";"-separated "dp,tp,pp", "dp,tp,pp,cp" or "dp,tp,pp,cp,ep", '
                                                     'each optionally "|variants": its own, in place of --variants')
    ap.add_argument("--variants", default="1f1b", help='"/"-separated combinations, each ","-separated words '
                                                       'from 1f1b, gpipe, interleavedV (V virtual stages), zbh1, zbv, sp, '
                                                       'zero1, zero2, zero3; or "all"')
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rtol", type=float, default=1e-10)
    ap.add_argument("--param-rtol", type=float, default=None)
    ap.add_argument("--reference", default="", help='","-separated overrides of the one-process reference only '
                                                    '(e.g. model.fused_head_loss=false: the other head path)')
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    poison_freed_storage()
    base = ["data.max_bytes=300000", "train.global_batch=8", "train.seq_len=16", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
            f"train.dtype={args.dtype}", "parallel.microbatches=2", "optim.grad_clip=1.0",
            "train.warmup_steps=1", "train.lr=1e-2", "model.tie_embeddings=false"] + args.overrides
    combos = variant_combos(args.variants)
    single = [o for o in base if not o.startswith("parallel.stage_layers")]  # a split for pp > 1 only
    single += [o for o in args.reference.split(",") if o]
    cfg0 = load_config(None, single)
    tokens = load_tokens_collective(world, cfg0.data.source, cfg0.data.cache_dir, cfg0.data.max_bytes)
    reference = None
    if world.Get_rank() == 0:
        reference = train(load_config(None, single + ["parallel.microbatches=1"]), MPI.COMM_SELF, tokens,
                          args.steps)[:2]
    world.Barrier()
    checks = 0
    for entry in args.layouts.split(";"):
        layout, _, own = entry.partition("|")  # "dp,tp,pp,cp,ep|variants": this layout's own variants
        dp, tp, pp, cp, ep = ([int(v) for v in layout.split(",")] + [1, 1])[:5]
        for (schedule, virtual), sp, zero in variant_combos(own) if own else combos:
            name = f"dp={dp} tp={tp} pp={pp}{f' cp={cp}' if cp > 1 else ''}{f' ep={ep}' if ep > 1 else ''} {schedule}{virtual if virtual > 1 else ''} sp={sp} zero={zero} " \
                   f"{args.dtype}"
            cfg = load_config(None, base + [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                            f"parallel.cp={cp}", f"parallel.ep={ep}",
                                            f"parallel.schedule={schedule}", f"parallel.virtual_stages={virtual}",
                                            f"parallel.sequence_parallel={sp}",
                                            f"parallel.zero={zero}"])
            losses, params, route = train(cfg, world, tokens, args.steps)
            if world.Get_rank() == 0:
                ref_losses, ref_params = reference
                loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                assert loss_err <= args.rtol, f"{name}: losses {losses} vs {ref_losses} (rel {loss_err:.2e})"
                assert params.keys() == ref_params.keys(), f"{name}: parameter names differ"
                if args.param_rtol is not None:
                    worst = max((rel_err(params[k], ref_params[k]), k) for k in ref_params)
                    assert worst[0] <= args.param_rtol, f"{name}: parameter {worst[1]} rel err {worst[0]:.2e}"
                else:
                    worst = (0.0, "-")
                print(f"OK {name} dp-reduction={route}: loss rel err {loss_err:.1e}, worst param rel err {worst[0]:.1e} ({worst[1]})",
                      flush=True)
                checks += 1
    if world.Get_rank() == 0:
        print(f"FIDELITY OK {checks} layouts/variants")


if __name__ == "__main__":
    main()
