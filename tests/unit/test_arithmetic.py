"""The arithmetic under every layout, one process, no MPI: slabs, checkpoint boxes, stage split, lr.

Expected values are derived independently (by hand or by a direct construction), not read back
from the code under test.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hpctrain.checkpoint.format import local_range_boxes
from hpctrain.config import load_config, resolve_model
from hpctrain.models.gpt import partition_layers
from hpctrain.optim.flat import lr_at
from hpctrain.parallel.param_init import init_from_global_
from hpctrain.parallel.slab import SlabSpec, make_spec


# ---------------------------------------------------------------- slabs (SlabSpec)
@pytest.mark.parametrize("split_dim, tp_size", [(0, 2), (1, 2), (0, 4), (1, 3), (None, 4)])
def test_slabs_of_all_tp_ranks_reassemble_the_global_tensor(split_dim, tp_size):
    shape = (12, 6)
    full = torch.empty(shape, dtype=torch.float64)
    seen = torch.zeros(shape, dtype=torch.int64)
    for rank in range(tp_size):
        spec = SlabSpec("w", shape, split_dim, rank, tp_size)
        slab = torch.empty(spec.local_shape, dtype=torch.float64)
        init_from_global_(slab, spec, seed=7, std=0.5)
        full[spec.local_slices()] = slab
        seen[spec.local_slices()] += 1
    expected_cover = tp_size if split_dim is None else 1  # replicated: every rank holds everything
    assert bool((seen == expected_cover).all())
    reference = torch.empty(shape, dtype=torch.float64)
    init_from_global_(reference, SlabSpec("w", shape), seed=7, std=0.5)
    assert torch.equal(full, reference)


def test_local_shape_and_slices_by_hand():
    spec = SlabSpec("w", (8, 6), split_dim=1, tp_rank=2, tp_size=3)  # columns 6/3 = 2 each: rank 2 has 4..5
    assert spec.local_shape == (8, 2)
    assert spec.local_slices() == (slice(None), slice(4, 6))
    spec = SlabSpec("w", (8, 6), split_dim=0, tp_rank=1, tp_size=4)  # rows 8/4 = 2 each: rank 1 has 2..3
    assert spec.local_shape == (2, 6)
    assert spec.local_slices() == (slice(2, 4), slice(None))
    spec = SlabSpec("b", (12,), split_dim=0, tp_rank=2, tp_size=3)  # 1-D split: rank 2 has 8..11
    assert spec.local_shape == (4,) and spec.local_slices() == (slice(8, 12),)
    replicated = SlabSpec("b", (8, 3), None, 1, 2)  # every tp rank holds all of it
    assert replicated.local_shape == (8, 3) and replicated.local_slices() == (slice(None), slice(None))


def test_make_spec_rejects_an_indivisible_split():
    comm = SimpleNamespace(size=3, rank=0)
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        make_spec("w", (8, 6), 0, comm)
    assert make_spec("w", (9, 6), 0, comm).local_shape == (3, 6)


# ---------------------------------------------------------------- checkpoint boxes
def local_index(spec):
    """The global tensor with each element of this rank's slab holding its C-order index in the slab
    (built directly from the slab's slices), -1 elsewhere."""
    index = np.full(spec.global_shape, -1, dtype=np.int64)
    index[spec.local_slices()] = np.arange(int(np.prod(spec.local_shape))).reshape(spec.local_shape)
    return index


def cover(spec, a, b):
    """Mark the global elements that local_range_boxes(a, b) maps to; check each piece's own bounds,
    that its box holds exactly local elements lo..hi-1 in row-major order (what a writer copies from
    the flat range into the box), and that the pieces follow each other from a to b."""
    index = local_index(spec)
    marks = np.zeros(spec.global_shape, dtype=np.int64)
    total, end = 0, a
    for box, lo, hi in local_range_boxes(spec, a, b):
        assert box.size == hi - lo and lo == end and lo < hi <= b
        assert np.array_equal(index[box.slices()].reshape(-1), np.arange(lo, hi)), (box, lo, hi)
        marks[box.slices()] += 1
        total += hi - lo
        end = hi
    assert end == b or a >= b
    return marks, total


@pytest.mark.parametrize("split_dim, tp_rank", [(0, 1), (1, 1), (None, 0)])
@pytest.mark.parametrize("a, b", [(0, 24), (3, 17), (4, 8), (5, 6), (0, 1), (23, 24), (7, 7)])
def test_boxes_cover_exactly_the_flat_range(split_dim, tp_rank, a, b):
    spec = SlabSpec("w", (8, 8) if split_dim == 1 else (6, 4) if split_dim is None else (12, 4), split_dim,
                     tp_rank, 1 if split_dim is None else 2)
    marks, total = cover(spec, a, b)
    assert total == b - a and marks.max(initial=0) <= 1  # every element once, none twice
    # the same elements, found directly: the local slab in C order, elements a..b-1
    local = np.arange(int(np.prod(spec.local_shape))).reshape(spec.local_shape)
    expected = np.zeros(spec.global_shape, dtype=np.int64)
    expected[spec.local_slices()] = (local >= a) & (local < b)
    assert np.array_equal(marks, expected)


def test_one_dimensional_box():
    spec = SlabSpec("norm", (10,))
    (box, lo, hi), = local_range_boxes(spec, 2, 9)
    assert (box.offset, box.shape, lo, hi) == ((2,), (7,), 2, 9)
    # split over tp=3, rank 2: its slab starts at global 8, so local 1..2 are global 9..10
    spec = SlabSpec("bias", (12,), 0, 2, 3)
    (box, lo, hi), = local_range_boxes(spec, 1, 3)
    assert (box.offset, box.shape, lo, hi) == ((9,), (2,), 1, 3)
    marks, total = cover(spec, 0, 4)
    assert total == 4 and marks.tolist() == [0] * 8 + [1] * 4


def test_an_empty_range_is_no_box():
    for a in (0, 5, 24):
        assert local_range_boxes(SlabSpec("w", (12, 4), 0, 1, 2), a, a) == []
    assert local_range_boxes(SlabSpec("b", (10,)), 4, 4) == []


def test_a_mid_row_range_is_three_boxes():
    spec = SlabSpec("w", (4, 5))
    boxes = [(b.offset, b.shape) for b, _, _ in local_range_boxes(spec, 3, 17)]
    assert boxes == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    # the same range on tp rank 1 of a (4, 10) weight split on dim 1 (its slab is columns 5..9):
    # 3..16 = row 0 cols 3-4, rows 1-2, row 3 cols 0-1 of the slab, shifted right by 5
    spec = SlabSpec("w", (4, 10), 1, 1, 2)
    pieces = [(b.offset, b.shape, lo, hi) for b, lo, hi in local_range_boxes(spec, 3, 17)]
    assert pieces == [((0, 8), (1, 2), 3, 5), ((1, 5), (2, 5), 5, 15), ((3, 5), (1, 2), 15, 17)]
    # a range inside one row is one box; one ending at a row's end has no partial last row
    assert [(b.offset, b.shape) for b, _, _ in local_range_boxes(spec, 6, 8)] == [((1, 6), (1, 2))]
    assert [(b.offset, b.shape) for b, _, _ in local_range_boxes(spec, 2, 10)] == [((0, 7), (1, 3)),
                                                                                  ((1, 5), (1, 5))]


# ---------------------------------------------------------------- pipeline stages
def model(*overrides):
    return resolve_model(load_config("configs/tiny.toml", list(overrides)).model)


def test_explicit_stage_layers_are_taken_as_given():
    assert partition_layers(model("model.n_layers=6", "parallel.pp=3"), 3, [1, 3, 2]) == [(0, 1), (1, 4), (4, 6)]


def test_one_layer_per_stage_when_pp_equals_layers():
    assert partition_layers(model(), 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_balanced_split_gives_heavy_end_stages_fewer_blocks():
    # d_model 64, d_ff 256: a block is 4*64*64 + 3*64*256 = 65536 params; an embedding of 256*64 = 1/4 block.
    # With vocab 8192 the embedding and the untied head weigh 8 blocks each: ends get 1 block, the middle the rest.
    m = model("model.vocab_size=8192", "model.n_layers=8")
    assert partition_layers(m, 3) == [(0, 1), (1, 7), (7, 8)]
    # a small vocabulary barely weighs: ends carry 1/4 block each, so the middle stage is the lightest
    # at every tie; by hand: [1,1,1] -> middle 2 -> first 2 (1.25 < 2) -> last 2 -> middle 3 -> first 3
    assert partition_layers(model("model.n_layers=8"), 3) == [(0, 3), (3, 6), (6, 8)]


def test_a_tied_head_on_the_last_stage_still_weighs_there():
    # pp=2, tied: the last stage holds a copy of the 8-block embedding, so both ends weigh the same
    m = model("model.vocab_size=8192", "model.n_layers=8", "model.tie_embeddings=true")
    assert partition_layers(m, 2) == [(0, 4), (4, 8)]
    # and so exactly as an untied head of that size: tying never lightens the last stage at pp > 1
    untied = model("model.vocab_size=8192", "model.n_layers=8")
    assert partition_layers(untied, 2) == [(0, 4), (4, 8)]
    for pp in (2, 3, 4):
        assert partition_layers(m, pp) == partition_layers(untied, pp)
    # untied with a light head (tiny vocab): still even
    assert partition_layers(model("model.n_layers=8"), 2) == [(0, 4), (4, 8)]
    # one stage holds every layer, tied or not
    assert partition_layers(m, 1) == partition_layers(untied, 1) == [(0, 8)]


# ---------------------------------------------------------------- learning rate
def train(**kw):
    base = dict(lr=1.0, min_lr=0.1, warmup_steps=4, steps=104, lr_schedule="cosine")
    return SimpleNamespace(**{**base, **kw})


def test_warmup_is_linear_from_lr_over_warmup():
    assert [lr_at(s, train()) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_endpoints_and_midpoint():
    t = train()
    assert lr_at(4, t) == pytest.approx(1.0)
    assert lr_at(54, t) == pytest.approx(0.1 + 0.5 * 0.9 * (1 + math.cos(math.pi / 2)))  # = 0.55
    assert lr_at(104, t) == pytest.approx(0.1) and lr_at(500, t) == pytest.approx(0.1)
    # a quarter of the way (step 29): cosine is above the straight line, 0.1 + 0.45 * (1 + sqrt(2)/2)
    assert lr_at(29, t) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert lr_at(29, train(lr_schedule="linear")) == pytest.approx(1.0 - 0.9 * 0.25)


def test_linear_and_constant():
    assert lr_at(54, train(lr_schedule="linear")) == pytest.approx(0.55)
    assert lr_at(80, train(lr_schedule="constant")) == 1.0


def test_steps_not_beyond_warmup_keep_the_peak():
    assert lr_at(10, train(steps=3, warmup_steps=4)) == 1.0
    assert [lr_at(s, train(steps=4, warmup_steps=4)) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_no_warmup_starts_at_the_peak():
    assert lr_at(0, train(warmup_steps=0, steps=100)) == pytest.approx(1.0)
    assert lr_at(50, train(warmup_steps=0, steps=100, lr_schedule="linear")) == pytest.approx(0.55)
