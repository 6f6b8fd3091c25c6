"""Context parallelism's pieces on one process (hpctrain/parallel/context_parallel.py): the zig-zag stripe
assignment, the block plan, the log-sum-exp merge, and ring attention on a ring of one rank; the ring on
real ranks is tests/mpi/test_ring_attention.py."""
import pytest
import torch

from hpctrain.parallel.context_parallel import (RingStats, block_attention, block_plan, causal_window_mask,
                                                merge_partials, ring_attention, zigzag_stripes, zigzag_merge,
                                                zigzag_positions, zigzag_split)
from hpctrain.parallel.cp_comm import ring_plan
from hpctrain.parallel.schedules import rendezvous_completes
from ring_helpers import reference_attention, ring_of_threads


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_covers_every_position_once_and_round_trips(cp):
    seq = 2 * cp * 3
    positions = [zigzag_positions(seq, r, cp) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq))
    x = torch.arange(seq).view(1, seq, 1).expand(2, seq, 5).clone()  # every token carries its position
    parts = [zigzag_split(x, r, cp) for r in range(cp)]
    for r, part in enumerate(parts):
        assert part.shape == (2, seq // cp, 5)
        assert torch.equal(part[0, :, 0], positions[r])
        first, second = zigzag_stripes(r, cp)
        assert positions[r][0] == first * 3 and positions[r][-1] == second * 3 + 2
    assert torch.equal(zigzag_merge(parts), x)
    y = torch.randn(4, 3, seq, 2)
    assert torch.equal(zigzag_merge([zigzag_split(y, r, cp, dim=2) for r in range(cp)], dim=2), y)


def test_zigzag_rejects_a_length_not_divisible_by_2cp():
    with pytest.raises(ValueError, match=r"seq_len 12 % 8 != 0 \(cp = 4\)"):
        zigzag_positions(12, 0, 4)


def test_lse_merge_of_two_key_halves_is_full_softmax_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(8)
    for mask in (None, causal_window_mask(pos, pos), causal_window_mask(pos, pos, 3)):
        full_mask = torch.ones(8, 8, dtype=torch.bool) if mask is None else mask
        scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~full_mask, float("-inf"))
        expected = torch.softmax(scores, dim=-1) @ v
        halves = [block_attention(q, k[..., s, :], v[..., s, :], None if mask is None else mask[:, s], 0.5)
                  for s in (slice(0, 4), slice(4, 8))]
        if mask is not None:  # causal: early queries see none of the second half (out 0, lse -inf)
            assert torch.isinf(halves[1][1][..., 0]).all() and not halves[1][0][..., 0, :].any()
        out, lse = merge_partials(*halves[0], *halves[1])
        assert torch.allclose(out, expected, rtol=0, atol=1e-12), (out - expected).abs().max()
        assert torch.allclose(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-12)
        # merging in the other order gives the same
        assert torch.allclose(merge_partials(*halves[1], *halves[0])[0], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_block_plan_balances_causal_work_and_skips_outside_the_window(cp):
    stripe = 6
    seq = 2 * cp * stripe
    pos = torch.arange(seq)
    for window in (0, 1, 5, stripe * 3, seq):
        allowed = causal_window_mask(pos, pos, window)
        for tile in (0, 4, 3, 1):  # whole stripes; tiles of 4 + 2; of 3; single tokens
            per_rank = []
            for r in range(cp):
                q_pos, plan = zigzag_positions(seq, r, cp), []
                for src in range(cp):
                    k_pos = zigzag_positions(seq, src, cp)
                    for block in block_plan(r, src, cp, stripe, window, tile):
                        mask = allowed[q_pos[block.q]][:, k_pos[block.k]]  # the kind agrees with the tokens' mask
                        assert block.kind == ("skip" if not mask.any() else "full" if mask.all() else "masked")
                        assert block.q_first == q_pos[block.q][0] and block.k_first == k_pos[block.k][0]
                        plan.append(block)
                # every (query, key) pair in exactly one block
                assert sum((b.q.stop - b.q.start) * (b.k.stop - b.k.start) for b in plan) == cp * (seq // cp) ** 2
                per_rank.append(sum(block.kind != "skip" for block in plan))
            if tile == 0 and window in (0, seq):  # full causal: the lower triangle of stripe pairs, evenly
                assert per_rank == [2 * cp + 1] * cp
            if tile == 0:  # exactly the stripe pairs with a visible key
                assert sum(per_rank) == allowed.view(2 * cp, stripe, 2 * cp, stripe).any(3).any(1).sum()
            if window == 5 and cp > 1 and tile == 0:
                assert sum(per_rank) < 2 * cp * (2 * cp + 1) // 2


@pytest.mark.parametrize("heads,kv_heads,window", [(2, 2, 0), (4, 2, 0), (4, 2, 5), (2, 1, 3)])
@pytest.mark.parametrize("tile", [0, 4])
def test_ring_of_one_rank_is_attention(heads, kv_heads, window, tile):
    torch.manual_seed(1)
    q = torch.randn(2, heads, 12, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, heads, 12, 8, dtype=torch.float64)
    stats = RingStats()
    out = ring_attention(q, k, v, None, window=window, stats=stats, tile=tile)
    got = torch.autograd.grad((out * grad).sum(), (q, k, v))
    expected = reference_attention(q, k, v, window)
    want = torch.autograd.grad((expected * grad).sum(), (q, k, v))
    assert torch.allclose(out, expected, rtol=0, atol=1e-12)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=0, atol=1e-12), (g - w).abs().max()
    if tile == 0:  # 2 stripes of 6 tokens: (0, 1) is in the future; forward + backward
        assert stats.computed + stats.skipped == 2 * 4 and stats.computed == 2 * 3
    else:  # 4 tiles of 4 + 2 tokens
        assert stats.computed + stats.skipped == 2 * 16 and stats.computed < 2 * 16


def test_ring_attention_in_half_precision_keeps_fp32_statistics():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    out = ring_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, window=6)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.double(), reference_attention(q, k, v, 6), atol=3e-2)


def test_ring_attention_rejects_bad_shapes():
    q = torch.zeros(1, 3, 8, 4)
    with pytest.raises(ValueError, match="multiple of Hkv 2"):
        ring_attention(q, torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), None)
    with pytest.raises(ValueError, match="window -1"):
        ring_attention(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), None, window=-1)


@pytest.mark.parametrize("cp,heads,kv_heads,window,tile",
                         [(2, 2, 2, 0, 0), (3, 4, 2, 0, 3), (3, 4, 2, 5, 0), (4, 2, 1, 3, 2), (8, 2, 2, 9, 0)])
def test_ring_of_threads_is_attention(cp, heads, kv_heads, window, tile):
    import queue
    import threading

    torch.manual_seed(3)
    seq = 2 * cp * 4
    q, grad = (torch.randn(2, heads, seq, 8, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64) for _ in range(2))
    plans = [[] for _ in range(cp)]
    got = ring_of_threads(q, k, v, grad, cp, plans, window=window, tile=tile)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, window)
    want = [expected.detach()] + list(torch.autograd.grad((expected * grad).sum(), full))
    for merged, ref in zip(got, want):
        assert torch.allclose(merged, ref, rtol=0, atol=1e-12)
    assert all(len(plan) == 3 * cp - 2 for plan in plans)
    assert plans == [ring_plan(r, cp) for r in range(cp)]  # the plan as issued is the documented one
    assert rendezvous_completes(plans)  # and cannot deadlock, even on NCCL


def test_the_strict_model_detects_a_ring_deadlock():
    """Blocking sends around a ring before any receive deadlock under rendezvous; the grouped pass does not."""
    cp = 3
    ungrouped = [[[("send", (r + 1) % cp, 0)], [("recv", (r - 1) % cp, 0)]] for r in range(cp)]
    grouped = [[[("send", (r + 1) % cp, 0), ("recv", (r - 1) % cp, 0)]] for r in range(cp)]
    assert not rendezvous_completes(ungrouped)
    assert rendezvous_completes(grouped)
    mislabelled = [[[("send", (r + 1) % cp, 0 if r else 1), ("recv", (r - 1) % cp, 0)]] for r in range(cp)]
    assert not rendezvous_completes(mislabelled)


@pytest.mark.parametrize("cp", [2, 3, 4, 5, 8, 16])
def test_the_ring_plan_cannot_deadlock_at_any_size(cp):
    """The deadlock simulator over the ring's documented send/recv plan (cp_comm.ring_plan); swapping two
    posts of one rank (a dK/dV pass before its K/V pass) breaks the pairwise order and is caught."""
    plans = [ring_plan(r, cp) for r in range(cp)]
    assert all(len(plan) == 3 * cp - 2 for plan in plans) and rendezvous_completes(plans)
    swapped = [list(plan) for plan in plans]
    swapped[0][cp - 1], swapped[0][cp] = swapped[0][cp], swapped[0][cp - 1]  # backward's first KV <-> GRAD
    assert not rendezvous_completes(swapped)


def test_a_long_sequence_with_a_short_window_skips_blocks_on_one_rank_and_equals_the_sdpa_mask(monkeypatch):
    """cp = 1, window 100 of 1024 tokens: the model takes the blocked path (blocks outside the window never
    computed), equal in float64 to SDPA with the window's mask (the path of short sequences)."""
    import hpctrain.models.gpt as gpt
    from hpctrain.config import load_config, resolve_model

    torch.manual_seed(0)
    m = resolve_model(load_config(None, ["model.attention_window=100", "train.seq_len=1024",
                                         "model.max_seq_len=1024", "model.n_layers=2"]).model)
    stage = gpt.GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 1024))
    calls = []
    real_ring = gpt.ring_attention
    monkeypatch.setattr(gpt, "ring_attention", lambda *a, **kw: calls.append(1) or real_ring(*a, **kw))
    blocked = stage(ids)
    assert len(calls) == m.n_layers
    monkeypatch.setattr(gpt, "default_tile", lambda device: 10**6)  # no block can be skipped: SDPA's mask
    masked = stage(ids)
    assert len(calls) == m.n_layers
    assert torch.allclose(blocked, masked, rtol=0, atol=1e-12)
