"""ZeRO-2/3 bookkeeping on one process (a replica group of 1: gathers are copies): which storage exists
between steps, how many all-gathers a step posts under each resharding policy, the prefetch order, and
that ZeRO 2/3 train exactly as ZeRO 0 (float64). Multi-rank exactness: tests/mpi/test_fidelity.py."""
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.parallel.buckets import is_allocated
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer

BASE = ["train.global_batch=4", "train.seq_len=16", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2",
        "train.dtype=float64", "train.warmup_steps=1", "train.lr=1e-2", "optim.grad_clip=1.0",
        "model.tie_embeddings=false"]


@pytest.fixture(scope="module")
def tokens():
    return load_tokens_collective(None, "builtin", None, 60000)


def trained(tokens, steps, *overrides, inspect=None):
    cfg = load_config(None, BASE + list(overrides))
    grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
    try:
        trainer = Trainer(cfg, grid, tokens=tokens)
        losses = [trainer.train_step().loss for _ in range(steps)]
        seen = inspect(trainer) if inspect else None
        with trainer.parts.params.gathered():
            params = {p.spec.name: p.detach().clone() for p in trainer.parts.local_model.parameters()}
        return losses, params, seen
    finally:
        grid.close()


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_two_and_three_train_as_zero_zero(tokens, zero):
    ref_losses, ref_params, _ = trained(tokens, 3, "parallel.microbatches=2")
    losses, params, _ = trained(tokens, 3, "parallel.microbatches=2", f"parallel.zero={zero}")
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-13, msg=name)


def storage(trainer):
    flat = trainer.parts.params.flat
    return {"values": [is_allocated(b.param_values) for b in flat.buckets if b.sliced],
            "grads": [is_allocated(b.grads) for b in flat.buckets if b.per_microbatch],
            "deferred": [b.deferred for b in flat.buckets], "gathers": trainer.parts.params.gather.gathers,
            "units": len(trainer.parts.params.flat.buckets)}


@pytest.mark.parametrize("reshard, microbatches", [(True, 1), (True, 4), (False, 4)])
def test_between_steps_only_the_shards_live_and_each_policy_gathers_what_it_says(tokens, reshard, microbatches):
    """After a step no unit is gathered and no per-micro-batch grad bucket exists. Gathers per step with U units
    (embedding, 3 blocks, norm + head) and M micro-batches: resharding, each forward (U) and each backward but
    the last unit's (U - 1), M times; without, each unit once."""
    _, _, seen = trained(tokens, 2, f"parallel.microbatches={microbatches}", "parallel.zero=3",
                         f"parallel.zero_reshard_after_forward={str(reshard).lower()}", inspect=storage)
    units = seen["units"]
    assert units == 5 and not any(seen["deferred"])
    assert not any(seen["values"]) and not any(seen["grads"])
    per_step = microbatches * (2 * units - 1) if reshard else units
    assert seen["gathers"] == 2 * per_step


def test_prefetch_posts_the_next_unit_before_the_current_one_computes(tokens):
    """With zero_prefetch = 1 the next unit's gather is on its way when a unit's forward starts (here, on one
    rank, already copied: ready); with 0 nothing is gathered ahead."""
    order = {}

    def watch(trainer):
        gather = trainer.parts.params.gather
        units = gather.stage_units[0]
        events = []
        for unit in units:
            unit.entry.register_forward_pre_hook(
                lambda m, a, u=unit: events.append((u.name, sorted(gather._ready | set(gather._posted)))))
        trainer.train_step()
        order[gather.prefetch] = events

    for prefetch in (0, 1):
        trained(tokens, 1, "parallel.zero=3", f"parallel.zero_prefetch={prefetch}", inspect=watch)
    # the hook registered after ParamGather's runs after it: the unit itself and (prefetch 1) the next one
    first, second = order[1][0], order[1][1]
    assert first[0] == "embed" and len(first[1]) == 2 and len(second[1]) == 2
    assert all(len(held) == 1 for _, held in order[0][:4])


@pytest.mark.parametrize("microbatches, prefetch", [(1, 1), (2, 1), (2, 0)])
def test_a_lora_base_is_sharded_and_only_the_running_units_are_gathered(tokens, microbatches, prefetch):
    """LoRA at zero 3: the frozen base of each unit is a gather-only bucket. Freed after each unit's forward,
    and after its backward as soon as the gradient reaches its input (the first block, whose input needs
    none, when the backward pass returns): when unit k's forward starts only k and the prefetched k + 1 are
    gathered, and never more than 3 of the 5 at once (the head's stays from its forward to its backward),
    where keeping them to the step's end would hold all 5. Trains exactly as zero 0."""
    seen: dict = {"most": 0, "extra": []}

    def watch(trainer):
        gather, frozen = trainer.parts.params.gather, trainer.parts.params.frozen
        position = {b.index: k for k, b in enumerate(frozen.buckets)}
        held: set[int] = set()
        post, release = gather._post, gather._free

        def posted(bucket):
            post(bucket)
            if bucket.index in position:
                held.add(position[bucket.index])
                seen["most"] = max(seen["most"], len(held))

        def freed(bucket):
            release(bucket)
            held.discard(position.get(bucket.index))

        gather._post, gather._free = posted, freed
        for k, unit in enumerate(gather.stage_units[0]):  # after ParamGather's own hook: the unit is gathered
            unit.entry.register_forward_pre_hook(lambda m, a, k=k: seen["extra"].append(sorted(held - {k, k + prefetch})))
        trainer.train_step()
        seen["units"] = len(frozen.buckets)
        seen["between"] = [is_allocated(b.param_values) for b in frozen.buckets]

    lora = ["lora.rank=4", f"parallel.microbatches={microbatches}"]
    sharded, params, _ = trained(tokens, 2, *lora, "parallel.zero=3", f"parallel.zero_prefetch={prefetch}",
                                 inspect=watch)
    whole, reference, _ = trained(tokens, 3, *lora)
    assert seen["units"] == 5 and seen["most"] <= 3 and not any(seen["between"]), seen
    assert len(seen["extra"]) == 5 * microbatches and not any(seen["extra"]), seen
    assert sharded == whole[:2]  # the watched step is the third
    assert all(torch.equal(params[name], reference[name]) for name in params)


def test_a_local_tier_piece_of_a_lora_zero3_rank_holds_the_frozen_slices(tokens):
    """The node-local tier's piece takes the frozen base through its slices (``frozen<i>``), never through the
    parameters (freed between steps); copying a piece's tensors into another run restores it bitwise."""
    from hpctrain.checkpoint.local_piece import piece_tensors

    def pieces(trainer):
        return [(name, t.clone()) for name, t in piece_tensors(trainer.state)]

    lora = ["lora.rank=4", "parallel.zero=3"]
    _, params, taken = trained(tokens, 2, *lora, inspect=pieces)
    names = [name for name, _ in taken]
    assert [n for n in names if n.startswith("frozen")] == [f"frozen{i}" for i in range(5)], names
    assert not any(n.startswith("param") for n in names), names  # every parameter is in a range or a slice

    def restore(trainer):
        for (name, target), (_, saved) in zip(piece_tensors(trainer.state), taken):
            target.copy_(saved)
        with trainer.parts.params.gathered():
            return {p.spec.name: p.detach().clone() for p in trainer.parts.local_model.parameters()}

    _, _, restored = trained(tokens, 0, *lora, "train.seed=7", inspect=restore)
    assert all(torch.equal(restored[name], params[name]) for name in params)


@pytest.mark.parametrize("zero", [0, 3])
def test_the_engine_alone_knows_where_a_lora_runs_bytes_live(tokens, zero):
    """The parameter engine (parallel/zero/engine.py) of a LoRA run: the adapters in the trainable group, the base
    whole below ZeRO-3 and in gather-only slices at 3 (``sliced``), nothing gathered between steps; its memory
    is the flat group's plus the base's, and the optimizer is always a group (one part without experts)."""
    def inspect(trainer):
        engine, model = trainer.parts.params, trainer.parts.local_model
        base = [p for p in model.parameters() if not p.requires_grad]
        assert base and len(engine.flat.parts) == 1 and len(trainer.parts.optimizer.parts) == 1
        assert {id(p) for p in engine.flat.params} == {id(p) for p in model.parameters() if p.requires_grad}
        assert [engine.sliced(p) for p in base] == [zero == 3] * len(base)
        assert (engine.gather is not None) == (zero == 3) and len(engine.frozen.parts) == (zero == 3)
        assert engine.after_backward == (engine.gather.backward_pass_done if zero == 3 else None)
        base_bytes = engine.frozen.memory_bytes() if zero == 3 else sum(p.nbytes for p in base)
        assert engine.memory_bytes() == {"params": engine.flat.memory_bytes()["params"] + base_bytes,
                                         "grads": engine.flat.memory_bytes()["grads"]}
        return [is_allocated(b.param_values) for b in engine.frozen.buckets]

    _, _, gathered = trained(tokens, 1, "lora.rank=4", f"parallel.zero={zero}", inspect=inspect)
    assert gathered == ([False] * 5 if zero == 3 else [])
