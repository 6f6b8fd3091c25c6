"""Vocabulary padding (model.vocab_multiple): the row arithmetic, the slab specs of a padded vocabulary,
its checkpoint boxes, and the cross-entropy over vocab-parallel slabs (one of them empty) without MPI:
the loss is F.cross_entropy over the true vocabulary and the padding rows get exactly zero gradient."""
import threading

import pytest
import torch
import torch.nn.functional as F

from hpctrain.checkpoint.format import local_range_boxes
from hpctrain.config import ConfigError, load_config, resolve_model
from hpctrain.models.gpt import GPTStage
from hpctrain.config.layout import Layout
from hpctrain.config.rules import padded_vocab
from hpctrain.parallel.param_init import init_from_global_
from hpctrain.parallel.slab import SlabSpec, make_spec
from hpctrain.parallel.tensor_parallel import vocab_parallel_cross_entropy
from hpctrain.tools.generate import generate_ids


class _Model:
    def __init__(self, vocab_size, vocab_multiple=128):
        self.vocab_size, self.vocab_multiple = vocab_size, vocab_multiple


@pytest.mark.parametrize("vocab, multiple, tp, rows", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200),  # GPT-2 / GPT-3 (Megatron's)
    (32000, 128, 8, 32768), (32001, 64, 1, 32064), (256, 128, 2, 256), (256, 128, 4, 512),
    (257, 1, 2, 258), (257, 1, 1, 257), (251, 8, 4, 256),
])
def test_padded_rows(vocab, multiple, tp, rows):
    assert padded_vocab(_Model(vocab, multiple), tp) == rows


def test_slabs_of_a_padded_vocabulary_cover_the_true_one_once():
    """257 rows over tp=4 padded to 512: 128 rows each; real rows 128, 128, 1, 0."""
    specs = [SlabSpec("embed.weight", (257, 3), 0, r, 4, padded_dim=512) for r in range(4)]
    assert {s.local_shape for s in specs} == {(128, 3)}
    assert [s.local_slices()[0] for s in specs] == [slice(0, 128), slice(128, 256), slice(256, 257),
                                                    slice(257, 257)]
    assert [s.valid_shape for s in specs] == [(128, 3), (128, 3), (1, 3), (0, 3)]
    assert [s.valid_local()[0] for s in specs] == [slice(0, 128), slice(0, 128), slice(0, 1), slice(0, 0)]
    assert [s.valid_numel for s in specs] == [384, 384, 3, 0]
    unpadded = SlabSpec("w", (8, 3), 0, 1, 2)
    assert unpadded.local_shape == unpadded.valid_shape == (4, 3) and unpadded.local_slices()[0] == slice(4, 8)
    with pytest.raises(ValueError, match="padding is along the split dim 0"):
        SlabSpec("w", (3, 257), 1, 0, 2, padded_dim=258)


def test_checkpoint_boxes_leave_out_the_padding():
    """A ZeRO-1 range over a whole padded slab writes only its real rows; an all-padding slab writes nothing."""
    one_real = SlabSpec("embed.weight", (257, 3), 0, 2, 4, padded_dim=512)
    assert [(b.offset, b.shape, a, e) for b, a, e in local_range_boxes(one_real, 0, 384)] == [((256, 0), (1, 3), 0, 3)]
    assert [(b.offset, b.shape) for b, _, _ in local_range_boxes(one_real, 2, 50)] == [((256, 2), (1, 1))]
    assert local_range_boxes(one_real, 3, 384) == []
    assert local_range_boxes(SlabSpec("embed.weight", (257, 3), 0, 3, 4, padded_dim=512), 0, 384) == []


def test_initial_values_do_not_depend_on_the_padding():
    """Each rank's real rows are the same rows of the one global tensor; padding rows are zero."""
    whole = torch.empty(257, 3, dtype=torch.float64)
    init_from_global_(whole, SlabSpec("embed.weight", (257, 3)), 5, 0.02)
    for tp in (1, 2, 4):
        rows = []
        for r in range(tp):
            spec = SlabSpec("embed.weight", (257, 3), 0, r, tp, padded_dim=512 if tp > 1 else 384)
            slab = torch.full(spec.local_shape, float("nan"), dtype=torch.float64)
            init_from_global_(slab, spec, 5, 0.02)
            assert not slab[spec.valid_shape[0]:].any()
            rows.append(slab[spec.valid_local()])
        assert torch.equal(torch.cat(rows), whole)


class _ThreadComm:
    """``size`` threads as a tp group: allreduce (sum/max) in place, through a shared board."""

    def __init__(self, board, rank):
        self.board, self.rank, self.size = board, rank, board["size"]

    def allreduce(self, tensor, op="sum"):
        board = self.board
        board["parts"][self.rank] = tensor.clone()
        board["barrier"].wait()
        stacked = torch.stack(board["parts"])
        tensor.copy_(stacked.amax(0) if op == "max" else stacked.sum(0))
        board["barrier"].wait()


def test_vocab_parallel_cross_entropy_with_an_empty_slab_is_the_true_softmax():
    """Logits of 257 ids split 128/128/1/0 over 4 'ranks' (threads): the loss equals F.cross_entropy on the
    whole vocabulary and the gradient is its gradient, the empty slab taking part with nothing."""
    torch.manual_seed(0)
    full = torch.randn(5, 2, 257, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 127, 128, 255, 256, 3, 200, 256, 1, 130]).view(5, 2)
    expected = F.cross_entropy(full.reshape(-1, 257), targets.reshape(-1), reduction="none").view(5, 2)
    expected.sum().backward()
    board = {"size": 4, "parts": [None] * 4, "barrier": threading.Barrier(4)}
    bounds, results = [(0, 128), (128, 256), (256, 257), (257, 257)], [None] * 4

    def rank(r):
        lo, hi = bounds[r]
        logits = full.detach()[..., lo:hi].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(logits, targets, _ThreadComm(board, r), lo)
        loss.sum().backward()
        results[r] = (loss.detach(), logits.grad)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for r, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, full.grad[..., bounds[r][0]:bounds[r][1]], rtol=0, atol=1e-12)
    assert results[3][1].shape == (5, 2, 0)


@pytest.mark.parametrize("tied", [False, True])
def test_padded_logits_never_count_and_padding_rows_get_zero_gradient(tied):
    """One process, 251 tokens (256 rows): the logits are the 251 real ones, the loss is F.cross_entropy
    over them, and the padding rows of the embedding and LM head get exactly zero gradient."""
    m = resolve_model(load_config(None, ["model.vocab_size=251", f"model.tie_embeddings={tied}"]).model)
    stage = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64)
    assert stage.embed.weight.shape == (256, 64) and stage.head.w.spec.global_shape == (251, 64)
    with torch.no_grad():  # even non-zero padding rows cannot reach the logits or the loss
        stage.head.w[251:] = 1.0
        stage.embed.weight[251:] = 1.0
    ids = torch.randint(0, 251, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = stage(ids[:, :-1])
    assert logits.shape == (8, 2, 251)
    loss = stage.loss_sum(logits, ids[:, 1:])
    expected = F.cross_entropy(logits.reshape(-1, 251), ids[:, 1:].t().reshape(-1), reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=0)
    loss.backward()
    for p in {id(stage.embed.weight): stage.embed.weight, id(stage.head.w): stage.head.w}.values():
        assert p.grad[:251].abs().sum() > 0 and not p.grad[251:].any()
    sampled = generate_ids(stage.eval(), [1, 2, 3], 40, m.max_seq_len, temperature=50.0, seed=1)
    assert max(sampled) < 251 and max(sampled[3:]) > 128  # near-uniform sampling over the true vocabulary only
    bytes_only = generate_ids(stage, [1, 2, 3], 40, m.max_seq_len, temperature=50.0, seed=1, vocab_limit=100)
    assert max(bytes_only) < 100  # and only ids the tokenizer has


def test_any_vocabulary_splits_over_tp_and_vocab_multiple_is_checked():
    lay = Layout.from_config(load_config("configs/tiny.toml", ["model.vocab_size=50257", "parallel.tp=2",
                                                               "parallel.pp=1"]), 2)
    assert lay.tp_size == 2
    with pytest.raises(ConfigError, match="model.vocab_multiple: must be >= 1, got 0"):
        load_config(None, ["model.vocab_multiple=0"])
    assert make_spec("embed.weight", (251, 4), 0, None, padded_dim=251).padded_dim is None  # nothing to pad


def test_the_planner_counts_the_padded_vocabulary_and_plans_tp8_for_gpt3():
    """GPT-3's 50257 tokens: 51200 rows at tp=8 in the LM head's memory and FLOPs; tp=8 layouts fit."""
    from hpctrain.config import ModelConfig
    from hpctrain.plan.cost import executed_flops_per_token
    from hpctrain.plan.devices import device_preset
    from hpctrain.plan.machine import Machine, links_from_bandwidth
    from hpctrain.plan.planner import SearchSpace, plan
    from hpctrain.plan.shapes import for_tp
    from hpctrain.plan.stages import Stage, stage_parameters

    m = resolve_model(ModelConfig(preset="gpt3-175b", vocab_size=0))
    head_only = Stage(0, 0, False, True)
    assert stage_parameters(for_tp(m, 8), head_only, 8) == m.d_model + 51200 * m.d_model // 8
    assert executed_flops_per_token(for_tp(m, 8), 2048, False, True) \
        - executed_flops_per_token(for_tp(m, 1), 2048, False, True) == 6.0 * m.d_model * (51200 - 50304)
    machine = Machine(device_preset("a100"), links_from_bandwidth(2400, 200), 128, 8)
    result = plan(m, machine, 512, 2048, space=SearchSpace(tp=8, pp=16, zero=(1,), sequence_parallel=(True,),
                                                           recompute=(True,)))
    assert result.plans and all(p.candidate.layout.tp_size == 8 for p in result.plans)
    assert not any("vocab" in i.reason for i in result.infeasible)
