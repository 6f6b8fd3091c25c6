"""Flat buffers, buckets and the state contract the checkpoint uses (no MPI: a fake dp group)."""
from dataclasses import replace
from types import SimpleNamespace

import torch
from torch import nn

from hpctrain.optim.flat import FlatOptimizer
from hpctrain.parallel.buckets import intersect
from hpctrain.parallel.data_parallel import FlatParams
from hpctrain.parallel.slab import SlabSpec


def params(*specs):
    out = []
    for spec in specs:
        p = nn.Parameter(torch.arange(float(torch.Size(spec.local_shape).numel())).view(spec.local_shape))
        p.spec = spec
        out.append(p)
    return out


def flat_of(ps, dp_size=1, dp_rank=0, bucket_mb=25.0, zero=False):
    dp = None if dp_size == 1 else SimpleNamespace(size=dp_size, rank=dp_rank)
    return FlatParams(ps, dp, bucket_mb=bucket_mb, zero=zero)


def test_intersect():
    assert intersect(0, 10, 5, 20) == (5, 10) and intersect(0, 5, 5, 9) is None and intersect(3, 4, 0, 9) == (3, 4)


def test_buckets_are_reverse_order_padded_to_dp_and_sized():
    a, b, c = params(SlabSpec("a", (3, 4)), SlabSpec("b", (5,)), SlabSpec("c", (2, 3)))
    # 4-byte elements, bucket_mb so that a bucket closes at >= 8 elements
    flat = flat_of([a, b, c], dp_size=4, bucket_mb=8 * 4 / 2**20)
    assert [[q.spec.name for q in bk.params] for bk in flat.buckets] == [["c", "b"], ["a"]]  # backward order
    assert [(bk.start, bk.end) for bk in flat.buckets] == [(0, 12), (12, 24)]  # 11 -> 12, 12 -> 12
    assert flat.offset_of(c) == (0, 6) and flat.offset_of(b) == (6, 5) and flat.offset_of(a) == (12, 12)
    assert torch.equal(a.data, torch.arange(12.0).view(3, 4))  # values kept, storage now the flat buffer
    assert a.data.data_ptr() == flat.param_buffer[12:].data_ptr()


def test_grads_needing_another_group_go_to_a_last_deferred_bucket():
    ps = params(SlabSpec("w", (4, 4)), SlabSpec("norm", (4,), partial_grad_over_tp=True),
                SlabSpec("embed", (8, 4), 0, tied="original"))
    flat = flat_of(ps)
    assert [bk.deferred for bk in flat.buckets] == [False, True]
    assert {q.spec.name for q in flat.buckets[-1].params} == {"norm", "embed"}


def test_pieces_and_param_ranges_of_a_zero_slice():
    a, b = params(SlabSpec("a", (2, 3)), SlabSpec("b", (4,)))
    flat = flat_of([a, b], dp_size=2, dp_rank=1, zero=True)  # one bucket [0, 10): b at 0..4, a at 4..10
    (bucket, start, end), = flat.owned_ranges()
    assert (start, end) == (5, 10)
    pieces = flat.pieces(start, end)
    assert [(p.param.spec.name, p.flat_lo, p.flat_hi, p.param_lo, p.param_hi) for p in pieces] == [("a", 5, 10, 1, 6)]
    assert flat.param_ranges(0, 10, lambda p: True) == [(0, 10)]  # adjacent ranges merged
    assert flat.param_ranges(0, 10, lambda p: p.dim() >= 2) == [(4, 10)]


def test_counted_once_over_tp_ranks_and_the_tied_copy():
    split = SlabSpec("w", (4, 4), 0, 1, 2)
    replicated = SlabSpec("n", (4,), None, 1, 2)
    assert split.counted_on(1) and not replicated.counted_on(1) and replicated.counted_on(0)
    assert not replace(SlabSpec("embed", (8, 4)), tied="copy").counted_on(0)
    assert replace(SlabSpec("embed", (8, 4)), tied="original").counted_on(0)


def test_optimizer_slices_describe_owned_state_and_norm_ranges():
    w, v = params(SlabSpec("w", (2, 2), None, 1, 2), SlabSpec("v", (2, 2), 0, 1, 2))
    flat = flat_of([w, v], dp_size=2, dp_rank=0)  # no ZeRO: this rank updates all, counts half
    opt = FlatOptimizer(flat, SimpleNamespace(), tp_rank=1)
    part, = opt.owned_slices
    assert flat.offset_of(v) == (0, 2) and flat.offset_of(w) == (2, 4) and (part.start, part.end) == (0, 6)
    # tp rank 1: only the TP-split "v" counts (w is replicated: tp rank 0 counts it), inside [0, 3)
    assert part.norm_ranges == [(0, 2)]
    assert FlatOptimizer(flat, SimpleNamespace(), tp_rank=0).owned_slices[0].norm_ranges == [(0, 3)]
    assert opt.state_kinds == ("exp_avg", "exp_avg_sq")
    part.exp_avg[:] = torch.arange(float(part.exp_avg.numel()))
    assert torch.equal(part.state("exp_avg", 1, 3), torch.tensor([1.0, 2.0]))
    assert [(piece.param.spec.name, piece.flat_lo) for piece, _ in opt.owned_pieces()] == \
        [("v", 0), ("w", 2)]


class SumOfOne:
    """A dp group of "2" whose reduction keeps this rank's values and records what it read."""

    size, rank = 2, 0

    def __init__(self):
        self.stats, self.read = SimpleNamespace(total_sent=lambda: 0), []

    def allreduce(self, x, nonblocking=False):
        self.read.append(x.clone())
        return SimpleNamespace(test=lambda: True, wait=lambda: None)


def test_main_grads_are_copied_then_added_and_stale_values_never_reach_the_reduction():
    """No zeroing pass over the buffer: a step's first grad is copied, later ones added; a parameter with no
    grad this step and the bucket's padding (a compressed reducer writes it) are zeroed before the reduction."""
    a, b = (nn.Parameter(torch.ones(shape, dtype=torch.bfloat16)) for shape in ((2, 3), (3,)))
    a.spec, b.spec = SlabSpec("a", (2, 3)), SlabSpec("b", (3,))
    comm = SumOfOne()
    flat = FlatParams([a, b], comm)  # one bucket: b at [0, 3), a at [3, 9), padding [9, 10)
    assert flat.grad_buffer.dtype == torch.float32 and flat.buckets[0].size == 10
    for step, both in enumerate([False, True]):
        users = (a, b) if both else (a,)
        flat.grad_buffer.fill_(7.0)  # stale: last step's reduced grads, noise in the padding
        flat.start_step()
        for last in (False, True):  # two micro-batches
            flat.last_microbatch = last
            sum((p.float() * (2.0 if last else 3.0)).sum() for p in users).backward()
        flat.finish_reduction()
        read = comm.read[step]
        assert torch.equal(read[3:9], torch.full((6,), 5.0)), read  # 3 + 2: copied, then added
        assert torch.equal(read[:3], torch.full((3,), 5.0 if both else 0.0)), read  # no grad: zero, not 7
        assert read[9] == 0, read  # the padding
        assert torch.equal(flat.grad_buffer, read)
