"""The fused head + loss's compiled chunks (hpctrain/parallel/head_chunks.py) against its eager path
(hpctrain/parallel/head_loss.py), at tp = 1. Under tp (two compiled calls around the all-gather, a rank without a
real vocabulary row): tests/mpi/test_compile.py's cp x tp + SP layout; float64 at tp = 4 with a padding-only
rank was checked at 1e-16 (docs/gpus.md)."""
import pytest
import torch

from hpctrain.bench.eager_ops import EagerOpCounter
from hpctrain.models.compile import dynamo_counts
from hpctrain.parallel.head_chunks import ChunkKernels, add_weight_grad, compiled_head_cross_entropy, \
    one_pass_float32_addmm
from hpctrain.parallel.head_loss import describe_head, even_chunk, fused_head_cross_entropy

EAGER = ChunkKernels(compile=lambda f: f)  # the same chunk code, run without torch.compile


def _problem(dtype, n=70, d=16, v=40, n_valid=37, masked=True, frozen=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(v, d, generator=g, dtype=torch.float64)
    w[n_valid:] = 0  # the padding rows, zero as the model's
    w = w.to(dtype).requires_grad_(not frozen)
    targets = torch.randint(0, n_valid + 5, (n,), generator=g)  # a few outside the vocabulary (ignored ids)
    mask = torch.rand(n, generator=g) > 0.3 if masked else None
    return h, w, targets, mask


def _train(fn, problem, chunk, **kw):
    h, w, targets, mask = (t.detach().clone().requires_grad_(t.requires_grad) if t is not None and t.is_floating_point()
                           else t for t in problem)
    loss = fn(h, w, targets, None, 0, 37, chunk, mask=mask, **kw)
    (loss * 0.7).backward()  # a scalar gradient of the summed loss, as the trainer's 1 / tokens
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [24, 32, 70, 200])  # padded last chunk (24, 32: 70 = 3 x 24 - 2), one chunk
@pytest.mark.parametrize("masked,frozen", [(True, False), (False, False), (True, True)])
def test_the_chunk_code_equals_the_eager_fused_head_in_float64(chunk, masked, frozen):
    problem = _problem(torch.float64, masked=masked, frozen=frozen)
    want = _train(fused_head_cross_entropy, problem, chunk)
    got = _train(compiled_head_cross_entropy, problem, chunk, kernels=EAGER)
    assert torch.allclose(got[0], want[0], rtol=1e-13, atol=0)
    assert torch.allclose(got[1], want[1], rtol=1e-12, atol=1e-14)
    if frozen:
        assert got[2] is None and want[2] is None  # LoRA's frozen head: no dW
    else:
        assert torch.allclose(got[2], want[2], rtol=1e-12, atol=1e-14)


def test_without_gradients_it_is_the_eager_loss_pass():
    h, w, targets, mask = _problem(torch.float32)
    with torch.no_grad():
        a = compiled_head_cross_entropy(h, w, targets, None, 0, 37, 32, EAGER, mask)
        b = fused_head_cross_entropy(h, w, targets, None, 0, 37, 32, mask)
    assert torch.equal(a, b)


def test_compiled_bfloat16_chunks_equal_eager_writes_no_float32_logits_and_never_recompile():
    """A real inductor compile: bfloat16 within its rounding of the eager fused head; three steps compile once
    (fixed chunk shapes: 70 tokens as 3 chunks of 24, the last padded); outside the compiled code no op makes a
    float32 [chunk, vocab] tensor."""
    kernels = ChunkKernels()
    problem = _problem(torch.bfloat16)
    want = _train(fused_head_cross_entropy, problem, 32)
    got = _train(compiled_head_cross_entropy, problem, 32, kernels=kernels)
    assert abs(float(got[0]) - float(want[0])) <= 1e-3 * abs(float(want[0]))
    for a, b in zip(got[1:], want[1:]):
        assert (a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max()
    since = dynamo_counts()
    wide = []

    class Watch(EagerOpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if not self._in_compiled_code() and isinstance(out, torch.Tensor) and out.dtype == torch.float32 \
                    and out.dim() == 2 and out.shape[1] == 40 and out.shape[0] >= 24:  # [>= chunk, vocab]
                wide.append((str(func), tuple(out.shape)))
            return out

    with Watch():
        for _ in range(2):
            _train(compiled_head_cross_entropy, problem, 32, kernels=kernels)
    assert dynamo_counts()["graphs"] == since["graphs"], "a later step compiled again"
    assert not wide, wide


def test_weight_gradient_accumulation():
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(8, 5, generator=g).to(torch.bfloat16)
    h = torch.randn(8, 3, generator=g).to(torch.bfloat16)
    acc = torch.ones(5, 3)
    add_weight_grad(acc, grad, h)  # the CPU: a bfloat16 matmul, then the add into float32
    assert torch.allclose(acc, 1 + (grad.t() @ h).float())
    same = torch.ones(5, 3, dtype=torch.bfloat16)
    add_weight_grad(same, grad, h)  # one in-place GEMM (beta = 1)
    assert torch.allclose(same.float(), 1 + (grad.t().float() @ h.float()), atol=0.05)
    assert not one_pass_float32_addmm(torch.device("cpu"))  # aten::addmm.dtype has no CPU kernel
    for dtype in (torch.float32, torch.bfloat16):  # the first chunk never reads dW: it may come from torch.empty
        fresh = torch.full((5, 3), float("nan"), dtype=dtype)
        add_weight_grad(fresh, grad, h, first=True)
        assert torch.allclose(fresh.float(), (grad.t() @ h).float(), atol=0.05)


@pytest.mark.parametrize("tokens,chunk", [(16384, 1280), (70, 32), (100, 60), (20, 2), (17, 16), (5, 8), (1000, 300)])
def test_even_chunks_keep_the_count_and_the_bound(tokens, chunk):
    even = even_chunk(tokens, chunk)
    count = -(-tokens // min(chunk, tokens))
    assert even <= max(chunk, 1) and -(-tokens // even) == count and even * count - tokens < 16 * count
    assert even_chunk(16384, 1280) == 1264  # gpt2-small on a GPU: 48 tokens padded, not 256


def test_the_start_up_line_names_the_compiled_chunks():
    assert describe_head(True, 32, 70, 40, compiled=True) == \
        "head: fused chunked CE (chunks of 24 of 70 tokens, compiled, the last padded by 2)"
    assert describe_head(True, 0, 128, 256, compiled=True) == \
        "head: fused chunked CE (one chunk of 128 tokens, automatic, compiled)"
