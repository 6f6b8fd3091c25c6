"""The ATen ops, and the bytes they read and write, that run outside compiled graphs (``--count-eager`` of
benchmarks/bench_gpu_train.py): a ``TorchDispatchMode`` that counts every op it sees, except those issued by
inductor's generated code (its extern kernels: matmuls, SDPA, fallbacks), which are compiled work.

An op is compiled work when a frame of inductor's output code (a module under inductor's cache directory,
``torch._inductor.runtime.cache_dir_utils.cache_dir()``) is on the Python stack when it dispatches: the forward
of a compiled region runs its ``call`` there, and the backward node of a compiled region runs the compiled
backward's ``call`` (the autograd engine carries the dispatch mode to its threads). Everything else, eager
modules, autograd's own backward kernels, the optimizer, is eager.

Bytes of an op: the sizes of its distinct tensor arguments and of its tensor results (what a kernel reads and
writes, once each), none for views (ops whose results alias an input without writing it move nothing). Graph,
break and recompile counts are torch's own (``torch._dynamo.utils.counters``, via hpctrain/models/compile.py
``dynamo_counts``).
"""
from __future__ import annotations

import sys
from types import FrameType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _nbytes(values) -> int:
    """Bytes of the distinct tensors among ``values`` (a pytree; ``dot(g, g)`` reads g once)."""
    tensors = {id(v): v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)}
    return sum(v.numel() * v.element_size() for v in tensors.values())


def _is_view(func) -> bool:
    """An op whose result aliases an input without moving data (view, reshape of a contiguous tensor...)."""
    schema = func._schema
    return bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                        for r in schema.returns)


class EagerOpCounter(TorchDispatchMode):
    """Counts the ops dispatched outside inductor's generated code while active: ``ops``, ``bytes``,
    ``by_op`` {op name: count} and ``bytes_by_op`` {op name: bytes}. ``ignore_compile_internals``: compiled regions still run compiled under it
    (dynamo does not skip frames for this mode)."""

    def __init__(self):
        super().__init__()
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        self.compiled_root = cache_dir()
        self.ops, self.bytes = 0, 0
        self.by_op: dict[str, int] = {}
        self.bytes_by_op: dict[str, int] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _in_compiled_code(self) -> bool:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(self.compiled_root):
                return True
            frame = frame.f_back
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._in_compiled_code():
            self.ops += 1
            name = str(func.overloadpacket)
            self.by_op[name] = self.by_op.get(name, 0) + 1
            if not _is_view(func):
                moved = _nbytes((args, kwargs)) + _nbytes(out)
                self.bytes += moved
                self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + moved
        return out
