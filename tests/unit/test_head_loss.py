"""The fused LM head + cross-entropy (hpctrain/parallel/head_loss.py, ``model.fused_head_loss``) on one
process: float64 summed losses and gradients equal today's logits + ``vocab_parallel_cross_entropy`` (1e-10)
for chunks that do not divide the tokens, ignore-index and masked tokens, a padded vocabulary, tp slabs
(threads, one slab empty), the GPT's tied/untied head with LoRA and packed masks, a frozen head, micro-batches
accumulated, without gradients; bf16 and float16 as close as the unfused path; 3 head matmuls per chunk
(float16: 4); no [tokens, vocab] tensor is saved for backward. Every layout on real ranks: tests/mpi/test_fused_head_loss.py."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.config import ConfigError, LoraConfig, load_config, resolve_model
from hpctrain.models.gpt import GPTStage
from hpctrain.parallel.head_loss import AUTO_CHUNK_BYTES, chunk_tokens, describe_head, fused_head_cross_entropy
from hpctrain.parallel.tensor_parallel import vocab_parallel_cross_entropy

EXACT = dict(rtol=1e-10, atol=1e-12)


class _ThreadComm:
    """``size`` threads as a tp group: allreduce (sum/max) in place through a shared board."""

    def __init__(self, board, rank):
        self.board, self.rank, self.size = board, rank, board["size"]

    def allreduce(self, tensor, op="sum"):
        self.board["parts"][self.rank] = tensor.clone()
        self.board["barrier"].wait()
        stacked = torch.stack(self.board["parts"])
        tensor.copy_(stacked.amax(0) if op == "max" else stacked.sum(0))
        self.board["barrier"].wait()

    def allgather(self, output, input):
        self.board["parts"][self.rank] = input.clone()
        self.board["barrier"].wait()
        output.copy_(torch.stack(self.board["parts"]).view(output.shape))
        self.board["barrier"].wait()


def unfused(h, weight, targets, n_valid, mask=None, tp_comm=None, vocab_start=0):
    """Today's path: full logits, padding columns cut, vocab-parallel cross-entropy, summed where ``mask``."""
    losses = vocab_parallel_cross_entropy(F.linear(h, weight)[..., :n_valid], targets, tp_comm, vocab_start)
    return losses.sum() if mask is None else torch.where(mask, losses, 0).sum()


def problem(tokens, dim, vocab, padded, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=g, dtype=dtype)
    weight = torch.randn(padded, dim, generator=g, dtype=dtype)
    weight[vocab:] = 1.0  # padding rows: finite, not zero, masked out of every result
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::5] = -100  # ignore index: loss logsumexp (mostly masked by the caller)
    mask = torch.rand(tokens, generator=g) < 0.7
    grad = torch.tensor(0.37, dtype=torch.float32 if dtype != torch.float64 else dtype)  # d(objective)/d(sum)
    return h, weight, targets, mask, grad


def loss_and_grads(fn, h, weight, *args, weight_grad=True):
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_(weight_grad)
    loss = fn(h, weight, *args)
    return loss, h, weight


@pytest.mark.parametrize("tokens, dim, vocab, padded, chunk", [
    (37, 8, 51, 64, 5), (37, 8, 51, 64, 37), (37, 8, 51, 64, 100), (16, 4, 7, 7, 1), (64, 16, 300, 384, 24),
])
@pytest.mark.parametrize("masked", [True, False])
def test_one_process_equals_the_unfused_loss_and_gradients(tokens, dim, vocab, padded, chunk, masked):
    h, weight, targets, mask, grad = problem(tokens, dim, vocab, padded, seed=tokens + chunk)
    mask = mask if masked else None
    ref, ref_h, ref_w = loss_and_grads(lambda a, b: unfused(a, b, targets, vocab, mask), h, weight)
    ref.backward(grad)
    got, got_h, got_w = loss_and_grads(lambda a, b: fused_head_cross_entropy(a, b, targets, None, 0, vocab, chunk,
                                                                             mask), h, weight)
    got.backward(grad)
    assert got.shape == ()
    torch.testing.assert_close(got, ref, **EXACT)
    torch.testing.assert_close(got_h.grad, ref_h.grad, **EXACT)
    torch.testing.assert_close(got_w.grad, ref_w.grad, **EXACT)
    assert not got_w.grad[vocab:].any()  # padding rows: exactly zero gradient
    if masked:
        assert not got_h.grad[~mask].any()  # a token that does not count: exactly zero gradient
    counted = targets >= 0
    torch.testing.assert_close(fused_head_cross_entropy(h, weight, targets, None, 0, vocab, chunk, counted),
                               F.cross_entropy(h @ weight[:vocab].t(), targets, reduction="sum"), **EXACT)


def test_tp_slabs_with_an_empty_one_equal_one_process():
    """257 ids over 4 'ranks' (threads) of 128 rows: 128/128/1/0 real ones; losses equal one process's,
    dh summed over the ranks (the caller's copy_to_tp) and each slab's dW equal its rows of the whole;
    training (one all-gather a chunk) and the loss without gradients (two all-reduces) alike."""
    tokens, dim, vocab = 23, 6, 257
    h, weight, targets, mask, grad = problem(tokens, dim, vocab, 512, seed=3)
    ref, ref_h, ref_w = loss_and_grads(lambda a, b: unfused(a, b, targets, vocab, mask), h, weight)
    ref.backward(grad)
    board = {"size": 4, "parts": [None] * 4, "barrier": threading.Barrier(4)}
    results = [None] * 4

    def rank(r):
        lo = r * 128
        n_valid = max(0, min(vocab - lo, 128))
        slab = weight[lo:lo + 128]
        loss, gh, gw = loss_and_grads(lambda a, b: fused_head_cross_entropy(a, b, targets, _ThreadComm(board, r), lo,
                                                                            n_valid, 5, mask), h, slab)
        loss.backward(grad)
        with torch.no_grad():
            again = fused_head_cross_entropy(h, slab, targets, _ThreadComm(board, r), lo, n_valid, 5, mask)
        results[r] = (loss.detach(), gh.grad, gw.grad, again)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    for r, (loss, _, gw, again) in enumerate(results):
        torch.testing.assert_close(loss, ref.detach(), **EXACT)
        torch.testing.assert_close(again, ref.detach(), **EXACT)
        torch.testing.assert_close(gw, ref_w.grad[r * 128:(r + 1) * 128], **EXACT)
    torch.testing.assert_close(sum(r[1] for r in results), ref_h.grad, **EXACT)
    assert not results[3][1].any() and not results[2][2][1:].any()


def gpt(fused, chunk=0, lora=None, **overrides):
    keys = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.vocab_size": 61, "model.vocab_multiple": 16, **overrides}
    m = resolve_model(load_config(None, [f"{k}={v}" for k, v in keys.items()] +
                                  [f"model.fused_head_loss={fused}", f"model.loss_chunk_tokens={chunk}"]).model)
    return GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64, seed=5, lora=lora)


@pytest.mark.parametrize("tied, lora", [("false", None), ("true", None), ("false", LoraConfig(rank=2, targets=["q", "down"]))])
def test_the_gpt_stage_fused_equals_unfused_with_masks_and_documents(tied, lora):
    """forward_loss with a packed row's documents and a loss mask (SFT), chunks of 7 of 2 x 12 tokens: the
    loss and every gradient equal the plain head's (1e-10); generation's logits are unchanged."""
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(-1, 1)
    mask = torch.rand(2, 12, generator=torch.Generator().manual_seed(1)) < 0.6
    targets[~mask] = -100
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    results = []
    for stage in (gpt("false", lora=lora, **{"model.tie_embeddings": tied}),
                  gpt("true", 7, lora=lora, **{"model.tie_embeddings": tied})):
        loss = stage.forward_loss(ids, targets, mask, docs)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in stage.named_parameters() if p.requires_grad},
                        stage(ids).detach()))
    (ref, ref_grads, ref_logits), (got, grads, logits) = results
    torch.testing.assert_close(got, ref, **EXACT)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **EXACT, msg=name)
    assert torch.equal(logits, ref_logits) and logits.shape == (12, 2, 61)
    if lora is None:
        assert not grads["head.weight" if tied == "false" else "embed.weight"][61:].any()


def test_nothing_of_tokens_x_vocab_is_saved_for_backward():
    """The plain path keeps the [S, B, V] softmax for backward; the fused one only h, W and per-token stats."""
    ids = torch.randint(0, 61, (4, 12), generator=torch.Generator().manual_seed(0))
    for fused in (True, False):
        stage, shapes = gpt(str(fused).lower(), 8), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            stage.forward_loss(ids, ids)
        by_vocab = [s for s in shapes if s[-1] in (61, 64) and s[0] in (12, 48)]  # per token x vocabulary
        assert by_vocab == ([] if fused else [(12, 4, 61)]), shapes


@pytest.mark.parametrize("dtype, chunk", [(torch.bfloat16, 40), (torch.bfloat16, 96), (torch.float16, 40)])
def test_half_precision_is_as_close_to_float64_as_the_unfused_path(dtype, chunk):
    """Also with grad_output 1 / 4097 (not a power of two: half gradients are scaled in float32)."""
    h, weight, targets, mask, _ = problem(96, 32, 500, 512, seed=4)
    grad = torch.tensor(1 / 4097, dtype=torch.float64)
    exact, exact_h, exact_w = loss_and_grads(lambda a, b: unfused(a, b, targets, 500, mask), h, weight)
    exact.backward(grad)
    errors = {}
    for name, fn in (("unfused", lambda a, b: unfused(a, b, targets, 500, mask)),
                     ("fused", lambda a, b: fused_head_cross_entropy(a, b, targets, None, 0, 500, chunk, mask))):
        loss, gh, gw = loss_and_grads(fn, h.to(dtype), weight.to(dtype))
        assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == dtype
        loss.backward(grad.float())
        errors[name] = [float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
                        for a, b in ((loss, exact), (gh.grad, exact_h.grad), (gw.grad, exact_w.grad))]
    assert all(f <= 2 * u + 1e-3 for f, u in zip(errors["fused"], errors["unfused"])), errors


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count, self.shapes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                    torch.ops.aten.addmm_.default):
            self.count += 1
            self.shapes.update(tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and a.dim() == 2)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, head_grad, matmuls", [
    (torch.float64, True, 3 * 4), (torch.float64, False, 2 * 4), (torch.float16, True, 4 * 4)])
def test_head_matmuls_per_chunk_and_a_frozen_head(dtype, head_grad, matmuls):
    """Training forms dh and dW with the logits: 3 head matmuls a chunk (2 with a frozen head: no dW),
    none in backward; float16 recomputes the logits in backward (4). Without gradients: 1 a chunk."""
    h, weight, targets, mask, grad = problem(37, 8, 51, 64, seed=9, dtype=dtype)
    ref, ref_h, _ = loss_and_grads(lambda a, b: unfused(a, b, targets, 51, mask), h.double(), weight.double())
    ref.backward(grad.double())
    with _CountMatmuls() as counted:
        loss, gh, gw = loss_and_grads(lambda a, b: fused_head_cross_entropy(a, b, targets, None, 0, 51, 10, mask),
                                      h, weight, weight_grad=head_grad)
        loss.backward(grad)
    assert counted.count == matmuls and (gw.grad is not None) == head_grad
    # every matmul spans the padded slab (64 rows), never the 51 real ones: an odd row count (GPT-2's 50257)
    # leaves cuBLAS only unaligned kernels, 1.5x slower a step at gpt2-small on an H100
    assert not any(51 in shape for shape in counted.shapes) and any(64 in shape for shape in counted.shapes)
    tol = EXACT if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gh.grad.double(), ref_h.grad, **tol)
    with _CountMatmuls() as counted, torch.no_grad():
        again = fused_head_cross_entropy(gh, gw, targets, None, 0, 51, 10, mask)
    assert counted.count == 4 and not again.requires_grad
    torch.testing.assert_close(again.double(), ref.detach(), **tol)


def test_micro_batches_accumulate_and_a_second_backward_is_refused():
    """Two forwards before their backwards (GPipe's order): each backward adds its own stored dh/dW
    (dW into the weight's grad); a second backward over one forward raises instead of adding stale grads."""
    h, weight, targets, mask, grad = problem(40, 8, 51, 64, seed=11)
    halves = [(slice(0, 23), 0.5), (slice(23, 40), 2.0)]
    ref_h, ref_w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    got_h, got_w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    losses = [fused_head_cross_entropy(got_h[rows], got_w, targets[rows], None, 0, 51, 7, mask[rows]) * g
              for rows, g in halves]
    for loss in reversed(losses):
        loss.backward(retain_graph=True)
    for rows, g in halves:
        (unfused(ref_h[rows], ref_w, targets[rows], 51, mask[rows]) * g).backward()
    torch.testing.assert_close(got_h.grad, ref_h.grad, **EXACT)
    torch.testing.assert_close(got_w.grad, ref_w.grad, **EXACT)
    with pytest.raises(RuntimeError, match="inplace"):
        losses[0].backward()


def test_chunk_size_setting_and_start_up_words():
    assert chunk_tokens(5, 37, 64) == 5 and chunk_tokens(100, 37, 64) == 37  # a last, smaller chunk is fine
    assert chunk_tokens(0, 8192, 1000) == 8192  # small: one chunk
    auto = chunk_tokens(0, 8192, 50304)
    assert auto % 128 == 0 and auto * 50304 * 4 <= AUTO_CHUNK_BYTES < (auto + 128) * 50304 * 4
    assert chunk_tokens(0, 10**6, AUTO_CHUNK_BYTES // 4) == 1
    assert describe_head(True, 0, 8192, 50304) == f"head: fused chunked CE (chunks of {auto} of 8192 tokens, automatic)"
    assert describe_head(True, 500, 128, 256) == "head: fused chunked CE (one chunk of 128 tokens)"
    assert "fused_head_loss=false" in describe_head(False, 0, 8192, 50304)
    with pytest.raises(ConfigError, match="model.loss_chunk_tokens"):
        load_config(None, ["model.loss_chunk_tokens=-1"])
