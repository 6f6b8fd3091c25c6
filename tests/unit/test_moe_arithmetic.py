"""The mixture-of-experts arithmetic (hpctrain/config/arithmetic.py): parameters, active parameters, FLOPs per
token, the stage split and a rank's parameters, on a tiny MoE model counted by hand. No torch, no MPI.

The model: vocabulary 96, d_model 32, 3 blocks, 4 heads, 2 KV heads (k and v: 16 columns), SwiGLU MLP of 80,
untied, rope; experts in blocks 0 and 2: 4 SwiGLU experts of width 24, top 2, one shared expert.
"""
import dataclasses
import itertools

import pytest

from hpctrain.config import ModelConfig, resolve_model
from hpctrain.config.arithmetic import (active_parameters, count_parameters, flops_per_token, partition_layers,
                                        rank_parameters)
from hpctrain.config.moe_keys import MoeConfig, resolve_moe

ATTENTION = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32  # q, k, v, o = 3072
DENSE_MLP = 3 * 32 * 80  # gate, up, down = 7680
ROUTER = 4 * 32  # 128
EXPERT = 3 * 24 * 32  # one SwiGLU expert = 2304 (the shared expert has the same width)
NORMS = 2 * 32
EMBEDDING = HEAD = 96 * 32


def tiny(**moe):
    m = resolve_model(ModelConfig(preset="custom", vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                  d_ff=80, max_seq_len=40))
    given = dict(num_experts=4, top_k=2, layers=[0, 2], d_ff_expert=24, shared_experts=1)
    return m, resolve_moe(MoeConfig(**{**given, **moe}), m)


def test_total_and_active_parameters_by_hand():
    m, moe = tiny()
    dense_block = ATTENTION + DENSE_MLP + NORMS  # 10816
    moe_block = ATTENTION + ROUTER + 4 * EXPERT + EXPERT + NORMS  # 4 routed + 1 shared: 14784
    active_block = ATTENTION + ROUTER + 2 * EXPERT + EXPERT + NORMS  # top 2 + shared: 10176
    ends = EMBEDDING + HEAD + 32  # + the final norm
    assert count_parameters(m, moe) == ends + dense_block + 2 * moe_block == 46560
    assert active_parameters(m, moe) == ends + dense_block + 2 * active_block == 37344
    assert count_parameters(m) == active_parameters(m, None) == ends + 3 * dense_block  # dense: as before
    no_shared = tiny(shared_experts=0)[1]
    assert count_parameters(m, moe) - count_parameters(m, no_shared) == 2 * EXPERT  # one shared per MoE block


def test_flops_per_token_count_the_active_matmuls_router_included():
    m, moe = tiny()
    matmuls = (ATTENTION + DENSE_MLP) + 2 * (ATTENTION + ROUTER + 2 * EXPERT + EXPERT) + HEAD  # 34048
    attention = 6 * 3 * 32 * 16  # causal scores at seq_len 16: 12 L d S / 2
    assert flops_per_token(m, 16, moe=moe) == 6.0 * matmuls + attention == 213504.0
    assert flops_per_token(m, 16) == 6.0 * (3 * (ATTENTION + DENSE_MLP) + HEAD) + attention
    everywhere = tiny(layers=[], shared_experts=0)[1]  # layers [] = every block
    assert everywhere.layers == [0, 1, 2]
    assert flops_per_token(m, 16, moe=everywhere) == 6.0 * (3 * (ATTENTION + ROUTER + 2 * EXPERT) + HEAD) + attention


def test_rank_parameters_hold_num_experts_over_ep_and_the_rest_whole():
    m, moe = tiny()
    padded = 2 * 128 * 32  # the vocabulary padded to 128 rows (model.vocab_multiple) for the embedding and head
    for ep, local in ((1, 4), (2, 2), (4, 1)):
        parts = rank_parameters(m, 1, 1, 0, moe=moe, ep=ep)
        assert parts["experts"] == 2 * local * EXPERT, ep
        assert parts["blocks"] == (ATTENTION + DENSE_MLP + NORMS) + 2 * (ATTENTION + ROUTER + EXPERT + NORMS) + 32
        assert parts["vocabulary"] == padded
    # tp = 2: the experts' and the shared expert's width is split, the router is whole on every tp rank
    parts = rank_parameters(m, 2, 1, 0, moe=moe, ep=2)
    assert parts["experts"] == 2 * 2 * EXPERT // 2
    assert parts["blocks"] == ((ATTENTION + DENSE_MLP) // 2 + NORMS) + 2 * ((ATTENTION + EXPERT) // 2 + ROUTER + NORMS) + 32
    assert set(rank_parameters(m, 1, 1, 0)) == {"vocabulary", "blocks", "positions"}  # dense: as before


def mid_model(**keys):
    """d_model 64, d_ff 256, vocabulary 8192, 8 blocks: a dense block is 4 x 64^2 + 3 x 64 x 256 = 65536 and the
    embedding (and the untied head) 8192 x 64 = 524288 = 8 dense blocks."""
    return resolve_model(ModelConfig(preset="custom", vocab_size=8192, d_model=64, n_layers=8, n_heads=4,
                                     n_kv_heads=4, d_ff=256, max_seq_len=64, **keys))


def test_a_model_of_moe_blocks_splits_as_equal_blocks_of_their_weight():
    m = mid_model()
    assert partition_layers(m, 3) == [(0, 1), (1, 7), (7, 8)]  # the ends weigh 8 dense blocks each
    # every block MoE: 16384 + 8 x 64 (router) + 8 x 3 x 64 x 256 = 410112; the embedding is 1.28 of it, so
    # (load, stage) from (2.28, 1, 2.28): middle 2, middle 3, first 2 (3.28), last 2, middle 4
    moe = resolve_moe(MoeConfig(num_experts=8, top_k=2), m)
    assert partition_layers(m, 3, moe=moe) == [(0, 2), (2, 6), (6, 8)]
    assert partition_layers(m, 3, [3, 3, 2], moe) == [(0, 3), (3, 6), (6, 8)]  # explicit: as given


def test_moe_blocks_on_some_layers_minimise_the_heaviest_stage():
    m = mid_model()
    moe = resolve_moe(MoeConfig(num_experts=8, top_k=2, layers=[4, 5, 6, 7]), m)
    # in dense blocks: embedding 8, head 8, blocks 0-3 weigh 1, blocks 4-7 410112 / 65536 = 6.26 each.
    # pp = 2: stage 0 = 0..5 weighs 8 + 4 + 2 x 6.26 = 24.5, stage 1 = 8 + 2 x 6.26 = 20.5 (0..4: 26.8 behind;
    # 0..6: 30.8 in front)
    assert partition_layers(m, 2, moe=moe) == [(0, 6), (6, 8)]
    assert partition_layers(m, 8, moe=moe) == [(i, i + 1) for i in range(8)]
    for pp in range(1, 9):  # contiguous, every block once, each stage at least one
        ranges = partition_layers(m, pp, moe=moe)
        assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(lo < hi for lo, hi in ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("layers", [[1, 2, 6], [0], [7], [0, 7], [3, 4], [0, 1, 2, 3, 4, 5, 6]])
def test_heaviest_stage_is_no_heavier_than_any_other_split(layers):
    m = mid_model()
    moe = resolve_moe(MoeConfig(num_experts=8, top_k=2, layers=layers), m)
    weight = [6.2578125 if i in layers else 1.0 for i in range(8)]  # in dense blocks (410112 / 65536)
    for pp in (1, 2, 3, 4, 5):
        extra = {0: 8.0, pp - 1: 8.0 + (8.0 if pp == 1 else 0.0)}  # embedding; the head (both on one stage)

        def heaviest(bounds):
            return max(sum(weight[lo:hi]) + extra.get(s, 0.0) for s, (lo, hi) in enumerate(bounds))
        every = [list(zip((0, *cuts), (*cuts, 8))) for cuts in itertools.combinations(range(1, 8), pp - 1)]
        assert heaviest(partition_layers(m, pp, moe=moe)) == pytest.approx(min(map(heaviest, every)), rel=1e-8)


def test_a_dense_model_split_is_unchanged_with_no_moe():
    m = mid_model()
    for pp in (1, 2, 3, 4, 8):
        assert partition_layers(m, pp, moe=None) == partition_layers(m, pp)
    tied = dataclasses.replace(m, tie_embeddings=True)
    assert partition_layers(tied, 2, moe=None) == [(0, 4), (4, 8)]
