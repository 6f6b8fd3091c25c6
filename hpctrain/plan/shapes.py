"""The model arithmetic the performance model needs beyond ``hpctrain/config/arithmetic.py``: the padded
vocabulary, the MLP kind, the matrix multiplications of one block per tensor-parallel rank.

Model objects are resolved ``ModelConfig``s or anything with the same fields (``published.py``'s
``Shape``). Optional fields are read with defaults so the planner works with or without them:
``mlp`` ("swiglu": gate, up, down, three ``d x d_ff`` matrices; "gelu" or "relu2": up and down, two),
``positions`` ("rope"; "learned": a ``max_seq_len x d`` table on the first stage), ``vocab_multiple``
(128, Megatron's ``make_vocab_size_divisible_by``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.config.arithmetic import block_matmul_parameters as block_matmul_params  # noqa: F401
from hpctrain.config.arithmetic import flops_per_token as model_flops_per_token  # noqa: F401
from hpctrain.config.arithmetic import mlp_matrices  # noqa: F401 (re-exported for plan/)
from hpctrain.config.arithmetic import position_parameters as position_params  # noqa: F401
from hpctrain.config.rules import padded_vocab  # noqa: F401 (the one rule; re-exported for plan/)

DEFAULT_VOCAB_MULTIPLE = 128


def for_tp(m, tp: int):
    """``m`` with its vocabulary padded for ``tp`` (what the ranks hold and compute; FLOPs and memory)."""
    v = padded_vocab(m, tp)
    return m if v == m.vocab_size else dataclasses.replace(m, vocab_size=v)


def block_gemms(m, tokens: int, tp: int) -> list[tuple[float, tuple[float, ...]]]:
    """One block's forward matrix multiplications on one tp rank: (FLOPs, (rows, columns, inner)).

    ``tokens``: rows of the activations (micro-batch x sequence; the full sequence also with sequence
    parallelism, which all-gathers it first). Column-parallel q/k/v and MLP-in split their columns,
    row-parallel o and MLP-out their inner dimension."""
    d, f, t = m.d_model, m.d_ff, tp
    kv = m.n_kv_heads * (d // m.n_heads)
    mats = mlp_matrices(m)
    shapes = [(tokens, d // t, d), (tokens, 2 * kv // t, d), (tokens, d, d // t),
              (tokens, (mats - 1) * f // t, d), (tokens, d, f // t)]
    return [(2.0 * r * c * k, (r, c, k)) for r, c, k in shapes]


def moe_block_gemms(m, moe, tokens: int, tp: int, ep: int) -> list[tuple[float, tuple[float, ...]]]:
    """One MoE block's forward matrix multiplications on one tp rank of an ep group (hpctrain/models/moe.py):
    the attention's (as ``block_gemms``), the router (``tokens x E x d``, whole on every tp rank), the rank's
    ``E / ep`` experts, each on ``tokens x top_k x ep / E`` rows (routing taken as balanced: the ep group's
    choices spread evenly over its experts), gate and up split over tp by columns, down by its inner
    dimension; the shared experts' SwiGLU (width ``S f_e``) on every token. An expert's GEMMs are listed once
    with the FLOPs of all ``E / ep`` of them."""
    d, f, t, e = m.d_model, moe.d_ff_expert, tp, moe.num_experts
    rows = tokens * moe.top_k * ep / e
    local = e // ep
    out = block_gemms(m, tokens, tp)[:3]
    out.append((2.0 * tokens * e * d, (tokens, e, d)))
    out += [(local * 2.0 * rows * c * k, (rows, c, k)) for c, k in ((2 * f // t, d), (d, f // t))]
    if moe.shared_experts:
        w = moe.shared_experts * f
        out += [(2.0 * tokens * c * k, (tokens, c, k)) for c, k in ((2 * w // t, d), (d, w // t))]
    return out


def megatron_flops_per_token(m, seq_len: int, recompute: str) -> float:
    """Megatron-LM's count of a step's FLOPs per token (Narayanan et al. 2021 eq. 3, Korthikanti et al.
    2022 appendix): matmuls + the FULL attention square (no causal halving), the padded vocabulary;
    ``recompute``: "full" adds a forward (HFU with full recomputation, PTD-P's TFLOP/s), "selective" the
    attention square once more, "off"/"model": nothing (MFU)."""
    h, layers = m.d_model, m.n_layers
    mm, attn = 2.0 * block_matmul_params(m), 4.0 * seq_len * h
    fwd = {"full": 4, "selective": 3, "off": 3, "model": 3}[recompute]
    extra = attn if recompute == "selective" else 0.0
    return layers * ((mm + attn) * fwd + extra) + 6.0 * h * m.vocab_size


@dataclass(frozen=True)
class Shape:
    """A model shape for the validation tables (published runs), read like a resolved ``ModelConfig``
    (``Layout.validate``, ``partition_layers`` and this package use only these fields), with the MLP kind,
    positions and vocabulary multiple that a published model needs whether or not ``ModelConfig`` has them."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    tie_embeddings: bool = False
    mlp: str = "swiglu"
    positions: str = "rope"
    vocab_multiple: int = DEFAULT_VOCAB_MULTIPLE


def gpt_shape(d_model: int, n_layers: int, n_heads: int, vocab_size: int, seq_len: int = 2048) -> Shape:
    """A GPT-2/GPT-3/Megatron GPT: GELU MLP of 4 d, learned positions, tied embeddings, multi-head."""
    return Shape(vocab_size, d_model, n_layers, n_heads, n_heads, 4 * d_model, seq_len, True, "gelu", "learned")
