"""The floating-point dtypes hpctrain trains, exports and benchmarks in, by their config names.

``DTYPE_NAMES`` is the one table: it needs no torch (config validation and the CLI's ``--dtype``
choices import it), and each name is the ``torch`` attribute that ``torch_dtype`` returns.
"""
from __future__ import annotations

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")


def torch_dtype(name: str):
    """The ``torch.dtype`` called ``name`` (one of ``DTYPE_NAMES``)."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)
