"""Parameters created where they live (hpctrain/parallel/param_init.py, buckets.place_params): the counter-based
initialisation is a function of the global index alone, each rank draws only what it keeps, and a stage built
on the meta device holds the same values as one built whole."""
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hpctrain.config import load_config, resolve_model
from hpctrain.errors import HpcTrainError
from hpctrain.models.gpt import GPTStage
from hpctrain.parallel import param_init
from hpctrain.parallel.buckets import is_allocated, sliced_pieces
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.param_init import InitRule, fill_, give_storage, global_index, values_at
from hpctrain.parallel.slab import SlabSpec
from hpctrain.parallel.zero.gather import unit_params

SPECS = [((12, 6), 0, 2, None, None), ((12, 6), 1, 3, None, None), ((257, 3), 0, 4, 512, None),
         ((257, 3), 0, 1, 384, None), ((4, 6, 10), 1, 2, None, (2, 2)), ((4, 10, 6), 2, 2, None, (0, 2)),
         ((4, 6, 10), None, 1, None, (1, 2)), ((7,), None, 1, None, None), ((5, 8, 4), 2, 4, None, None)]


def brute_force_index(spec: SlabSpec, lo: int, hi: int):
    """Element by element: the local coordinates, shifted by the slab's offsets, raveled in the global shape."""
    offsets = [0] * len(spec.global_shape)
    if spec.split_dim is not None:
        offsets[spec.split_dim] = spec.tp_rank * (spec.split_length // spec.tp_size)
    if spec.experts is not None:
        offsets[0] += spec.experts[0]
    index, real = [], []
    for position in range(lo, hi):
        coords = [int(c) + o for c, o in zip(np.unravel_index(position, spec.local_shape), offsets)]
        inside = all(c < s for c, s in zip(coords, spec.global_shape))
        real.append(inside)
        index.append(int(np.ravel_multi_index(coords, spec.global_shape)) if inside else -1)
    return np.array(index, dtype=np.int64), np.array(real, dtype=bool)


@pytest.mark.parametrize("shape, split, tp, padded, experts", SPECS)
def test_global_index_of_any_flat_range_matches_element_by_element(shape, split, tp, padded, experts):
    rng = random.Random(0)
    for rank in range(tp):
        spec = SlabSpec("w", shape, split, rank, tp, padded_dim=padded, experts=experts)
        n = math.prod(spec.local_shape)
        for lo, hi in [(0, n), (0, 0), (n, n)] + [sorted((rng.randrange(n + 1), rng.randrange(n + 1))) for _ in range(6)]:
            index, real = global_index(spec, lo, hi)
            want_index, want_real = brute_force_index(spec, lo, hi)
            assert np.array_equal(real, want_real) and np.array_equal(index[real], want_index[want_real])


@pytest.mark.parametrize("shape, split, tp, padded, experts", SPECS)
def test_every_slab_and_every_slice_of_it_holds_the_global_tensors_values(shape, split, tp, padded, experts):
    """Drawn whole or as any flat range of a slab (a ZeRO-3 slice), an element has one value: its global one."""
    rule = InitRule("normal", 0.5, seed=3)
    whole = values_at(rule, "w", np.arange(math.prod(shape), dtype=np.int64)).view(shape)
    for rank in range(tp):
        spec = SlabSpec("w", shape, split, rank, tp, padded_dim=padded, experts=experts)
        slab = torch.full(spec.local_shape, float("nan"), dtype=torch.float64)
        fill_(slab, spec, rule)
        assert torch.equal(slab[spec.valid_local()], whole[spec.local_slices()])
        assert not slab.view(-1)[torch.from_numpy(~global_index(spec, 0, slab.numel())[1])].any()  # padding 0
        n = slab.numel()
        for lo, hi in [(0, n // 3), (n // 3, n - 1), (n - 1, n)]:
            part = torch.empty(hi - lo, dtype=torch.float64)
            fill_(part, spec, rule, lo=lo)
            assert torch.equal(part, slab.view(-1)[lo:hi])


def test_the_values_are_the_distributions_asked_for_and_keyed_by_seed_and_name():
    index = np.arange(400_000, dtype=np.int64)
    normal = values_at(InitRule("normal", 0.02, seed=1), "layers.0.attn.wq.weight", index.copy())
    assert abs(normal.mean().item()) < 1e-4 and abs(normal.std().item() - 0.02) < 2e-4
    assert abs(((normal / 0.02) ** 4).mean().item() - 3.0) < 0.05  # the normal's kurtosis
    uniform = values_at(InitRule("uniform", 0.3, seed=1), "a", index.copy())
    assert uniform.min().item() >= -0.3 and uniform.max().item() <= 0.3 and abs(uniform.std().item() - 0.3 / 3 ** 0.5) < 1e-3
    other_name = values_at(InitRule("normal", 0.02, seed=1), "layers.0.attn.wk.weight", index[:1000].copy())
    other_seed = values_at(InitRule("normal", 0.02, seed=2), "layers.0.attn.wq.weight", index[:1000].copy())
    for other in (other_name, other_seed):
        assert abs(torch.corrcoef(torch.stack([normal[:1000], other]))[0, 1].item()) < 0.1
    assert torch.equal(values_at(InitRule("ones"), "n", index[:5].copy()), torch.ones(5, dtype=torch.float64))


def test_a_shape_the_counter_cannot_address_is_refused_by_name():
    with pytest.raises(HpcTrainError, match="huge.weight.*cannot be addressed") as raised:
        param_init.check_addressable(SlabSpec("huge.weight", (2**40, 2**30)))
    assert raised.value.everywhere  # one line from rank 0, exit 2 (raised before anything is allocated or written)


def _stage(build_on_meta: bool, **overrides):
    m = resolve_model(load_config(None, ["model.preset=tiny", "model.vocab_size=131", *overrides.get("extra", [])]).model)
    if not build_on_meta:
        return GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64, seed=4)
    with torch.device("meta"):
        stage = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64, seed=4)
    give_storage(stage, torch.device("cpu"))
    return stage


@pytest.mark.parametrize("zero", [0, 3])
def test_a_stage_built_on_meta_holds_the_whole_builds_values_and_draws_only_its_slice(zero, monkeypatch):
    """Two replica ranks at zero 3 (no communication at construction): each draws exactly its slice's
    elements into ``param_slice`` (never the whole unit), and the slices put together are the whole build."""
    reference = {p.spec.name: p.detach().clone() for p in _stage(False).parameters()}
    drawn = []
    real_fill = param_init.fill_
    monkeypatch.setattr("hpctrain.parallel.buckets.fill_", lambda dest, *a, **k: (drawn.append(dest.numel()),
                                                                                  real_fill(dest, *a, **k)))
    slices = []
    for rank in range(2):
        drawn.clear()
        stage = _stage(True)
        assert all(not p.is_meta and not is_allocated(p) for p in stage.parameters())
        flat = FlatParams(list(stage.parameters()), SimpleNamespace(size=2, rank=rank), zero=zero,
                          units=unit_params([stage]) if zero == 3 else None)
        if zero == 3:  # the sharded buckets' pieces of this rank's slices, the whole ones (the deferred) whole
            kept = sum(piece.flat_hi - piece.flat_lo for b in flat.buckets if b.sliced
                       for piece, _ in sliced_pieces(b, flat._offsets, rank, 2))
            assert sum(drawn) == kept + sum(p.numel() for b in flat.buckets if not b.sliced for p in b.params)
            assert kept < sum(p.numel() for p in stage.parameters()) * 0.6
            assert not any(is_allocated(b.param_values) for b in flat.buckets if b.sliced)
            slices.append([b.param_slice.clone() for b in flat.buckets])
        else:
            assert sum(drawn) == sum(p.numel() for p in stage.parameters())
            for p in stage.parameters():
                assert torch.equal(p.detach(), reference[p.spec.name]), p.spec.name
    if zero == 3:  # the two ranks' slices, put together, are the whole build's values in flat order
        stage = _stage(False)
        whole = FlatParams(list(stage.parameters()), None, zero=3, units=unit_params([stage]))
        for k, b in enumerate(whole.buckets):
            assert torch.equal(torch.cat([slices[0][k], slices[1][k]])[:b.size], b.param_slice)
