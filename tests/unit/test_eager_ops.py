"""hpctrain/bench/eager_ops.py: the dispatch mode counts eager ATen ops and their bytes, not the ops a compiled
region issues (its extern matmul, forward and backward), and the region still runs compiled under it."""
import torch

from hpctrain.bench.eager_ops import EagerOpCounter


def f(x, w):
    return torch.relu(x @ w).sum()


def test_compiled_work_is_not_counted_and_eager_work_is():
    x, w = torch.randn(16, 8), torch.randn(8, 4, requires_grad=True)
    compiled = torch.compile(f)
    compiled(x, w).backward()  # compiled here, before counting
    with EagerOpCounter() as inside:
        compiled(x, w).backward()
    with EagerOpCounter() as eager:
        f(x, w).backward()
    assert "aten.mm" not in inside.by_op, inside.by_op  # the forward's and the backward's matmuls: compiled
    assert eager.by_op["aten.mm"] == 2 and eager.by_op["aten.relu"] == 1, eager.by_op
    assert eager.ops > inside.ops and eager.bytes > inside.bytes
    # x @ w reads x and w and writes [16, 4], all float32
    assert eager.bytes_by_op["aten.mm"] >= 4 * (16 * 8 + 8 * 4 + 16 * 4)
    with EagerOpCounter() as views:
        x.view(8, 16).t()
    assert views.ops == 2 and views.bytes == 0  # views move nothing
