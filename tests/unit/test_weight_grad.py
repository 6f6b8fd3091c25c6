"""The split backward of the zero-bubble schedules (hpctrain/parallel/weight_grad.py): B then W gives the
gradients a full backward gives, accumulated through the same hooks, and a missing W is an error."""
import pytest
import torch

from hpctrain.parallel.weight_grad import WeightGradStore, attach, deferrable_linear


class Tiny(torch.nn.Module):
    """Two deferring linears around a norm-like scale, the second weight used twice."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(6, 4, generator=g, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(torch.randn(6, 6, generator=g, dtype=torch.float64))
        self.scale = torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))
        self.weight_grads = None

    def forward(self, x):
        if self.weight_grads is None:
            h = torch.tanh(torch.nn.functional.linear(x, self.w1)) * self.scale
            return torch.nn.functional.linear(torch.nn.functional.linear(h, self.w2), self.w2).square().sum()
        s = self.weight_grads
        h = torch.tanh(deferrable_linear(x, self.w1, s)) * self.scale
        return deferrable_linear(deferrable_linear(h, self.w2, s), self.w2, s).square().sum()


def test_b_then_w_equals_a_full_backward_through_the_hooks():
    full, split = Tiny(), Tiny()
    store = WeightGradStore()
    assert attach([split], store) == 1 and split.weight_grads is store
    seen = []
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.shape))
    xs = [torch.randn(3, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    dx_full, dx_split = [], []
    for x in xs:
        x1 = x.clone().requires_grad_()
        full(x1).backward()
        dx_full.append(x1.grad)
    for i, x in enumerate(xs):  # both Bs first, then both Ws, in order
        x1 = x.clone().requires_grad_()
        params = list(split.parameters())
        with store.deferring((i, 0)):
            grads = torch.autograd.grad(split(x1), [x1] + params, allow_unused=True)
        assert grads[1] is None and grads[2] is None and grads[3] is not None  # the linears' wait for W
        store.keep((i, 0), params, grads[1:])
        dx_split.append(grads[0])
    assert all(p.grad is None for p in split.parameters()) and not seen  # nothing accumulated in B
    assert store.pending() == [(0, 0), (1, 0)]
    for i in range(2):
        store.run((i, 0))
    store.check_drained()
    assert len(seen) == 2 * 3  # one accumulation per parameter per micro-batch (w2, used twice, once)
    for a, b in zip(dx_full, dx_split):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
    for p, q in zip(full.parameters(), split.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=0)


def test_a_w_that_never_ran_is_an_error_naming_it():
    model, store = Tiny(), WeightGradStore()
    attach([model], store)
    x = torch.randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    with store.deferring((3, 1)):
        torch.autograd.grad(model(x), [x])
    with pytest.raises(RuntimeError, match=r"\(3, 1\)"):
        store.check_drained()


def test_outside_deferring_it_is_an_ordinary_linear():
    model, plain = Tiny(), Tiny()
    attach([model], WeightGradStore())
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    model(x).backward()
    plain(x).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=0)


def test_under_torch_compile_the_weight_gradient_is_still_deferred():
    """A compiled region would trace the linear's backward once, when nothing defers: it runs eagerly instead."""
    store = WeightGradStore()
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    compiled = torch.compile(lambda x: torch.tanh(deferrable_linear(x, w, store)), backend="aot_eager")
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with store.deferring((0, 0)):
        dx, dw = torch.autograd.grad(compiled(x).sum(), [x, w], allow_unused=True)
    assert dw is None and store.pending() == [(0, 0)]
    store.run((0, 0))
    expected = torch.autograd.grad(torch.tanh(torch.nn.functional.linear(x, w)).sum(), [w])[0]
    torch.testing.assert_close(w.grad, expected, rtol=1e-13, atol=0)
