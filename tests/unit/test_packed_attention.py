"""Packed documents (hpctrain/parallel/packed.py): a packed row computes what its documents compute one by
one (SDPA and the ring), and the trainer's SFT loss is the hand-computed masked cross-entropy."""
import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import load_config, resolve_model
from hpctrain.models.gpt import GPTStage
from hpctrain.parallel.context_parallel import ring_attention
from hpctrain.parallel.packed import document_positions
from ring_helpers import ring_of_threads

LENGTHS = [5, 9, 3, 7]  # a packed row of 4 documents, the last one padding-like, 24 positions


def packed_docs(lengths, batch=2):
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.stack([docs, docs.roll(-3).sort().values][:batch])  # two rows, documents cut differently


def test_document_positions_restart_with_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize("overrides", [
    [],                                                       # rope, SwiGLU
    ["model.positions=learned", "model.mlp=gelu"],           # a learned position table
    ["model.attention_window=3"],                            # a sliding window inside each document
])
def test_a_packed_row_equals_its_documents_one_by_one(overrides):
    m = resolve_model(load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4",
                                         "model.n_kv_heads=2", "model.vocab_size=50", *overrides]).model)
    stage = GPTStage(m, (0, 2), is_first=True, is_last=True, dtype=torch.float64, seed=7)
    docs = packed_docs(LENGTHS)
    ids = torch.randint(0, 50, docs.shape, generator=torch.Generator().manual_seed(1))
    packed = stage(ids, docs)  # [S, B, V]
    for b in range(docs.shape[0]):
        for d in docs[b].unique():
            where = (docs[b] == d).nonzero().flatten()
            alone = stage(ids[b:b + 1, where])[:, 0]  # the document as its own sequence, no mask needed
            assert torch.allclose(packed[where, b], alone, rtol=0, atol=1e-12)
    assert not torch.allclose(packed[:, 0], stage(ids)[:, 0], atol=1e-6)  # unpacked, the documents mix


def test_masked_loss_sum_counts_only_the_mask():
    m = resolve_model(load_config(None, ["model.n_layers=1", "model.d_model=16", "model.n_heads=2",
                                         "model.n_kv_heads=2", "model.vocab_size=30"]).model)
    stage = GPTStage(m, (0, 1), is_first=True, is_last=True, dtype=torch.float64, seed=2)
    ids, targets = torch.randint(0, 30, (2, 12)), torch.randint(0, 30, (2, 12))
    mask = torch.rand(2, 12, generator=torch.Generator().manual_seed(0)) < 0.4
    logits = stage(ids)
    by_hand = F.cross_entropy(logits.transpose(0, 1)[mask], targets[mask], reduction="sum")
    assert torch.allclose(stage.loss_sum(logits, targets, mask), by_hand, rtol=1e-13, atol=0)


def reference(q, k, v, docs, window=0):
    group, seq = q.shape[1] // k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    where = torch.arange(seq)
    ago = where[:, None] - where[None, :]
    allowed = (ago >= 0) & ((ago < window) if window else True) & (docs[:, :, None] == docs[:, None, :])
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("cp,window,tile", [(2, 0, 0), (3, 0, 2), (4, 4, 3)])
def test_ring_attention_stays_inside_documents(cp, window, tile):
    torch.manual_seed(4)
    seq = 24
    docs = packed_docs(LENGTHS)
    q, grad = (torch.randn(2, 4, seq, 8, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, seq, 8, dtype=torch.float64) for _ in range(2))
    got = ring_of_threads(q, k, v, grad, cp, window=window, tile=tile, docs=docs)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference(*full, docs, window)
    want = [expected.detach()] + list(torch.autograd.grad((expected * grad).sum(), full))
    for merged, ref in zip(got, want):
        assert torch.allclose(merged, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="docs must be"):
        ring_attention(q, k, v, None, docs=docs[:, :5])


def test_trainer_loss_is_the_hand_computed_masked_cross_entropy(tmp_path):
    """One process: the first step's loss is the sum of the response tokens' cross-entropies (each example
    on its own, no packing) over their count; validation uses the same rule."""
    from mpi4py import MPI

    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.data.corpus import load_tokens_collective
    from hpctrain.data.sft import prepare_sft
    from hpctrain.data.tokenizer import ByteTokenizer
    from hpctrain.runtime.launcher import discover
    from hpctrain.train.trainer import Trainer
    from test_sft_data import EXAMPLE

    prepare_sft([EXAMPLE], ByteTokenizer(), str(tmp_path / "sft.h5"))
    cfg = load_config(None, [f"data.source={tmp_path / 'sft.h5'}", "train.seq_len=255", "train.global_batch=4",
                             "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
                             "train.dtype=float64", "parallel.microbatches=2", "data.valid_fraction=0.25",
                             "train.eval_steps=1"])
    tokens = load_tokens_collective(None, cfg.data.source)
    grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
    try:
        trainer = Trainer(cfg, grid, tokens=tokens)
        stage = trainer.parts.stages[0]

        def by_hand(sampler, start):
            inputs, targets, mask, docs = sampler.batch(start, 4)
            total, count = 0.0, 0
            with torch.no_grad():
                for b in range(4):
                    for d in docs[b].unique():
                        where = (docs[b] == d).nonzero().flatten()
                        logits = stage(inputs[b:b + 1, where])[:, 0]
                        losses = F.cross_entropy(logits, targets[b, where], reduction="none")
                        total += float(losses[mask[b, where]].sum())
                        count += int(mask[b, where].sum())
            assert count == sampler.counted(start, 4) > 0
            return total / count

        valid = by_hand(trainer.parts.data.valid_sampler, 0)
        assert trainer.evaluate() == pytest.approx(valid, rel=1e-12)
        first = by_hand(trainer.parts.data.sampler, 0)
        assert trainer.train_step().loss == pytest.approx(first, rel=1e-12)
    finally:
        grid.close()
