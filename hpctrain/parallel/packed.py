"""Packed sequences: several documents in one row, attention never crossing a document boundary.

A packed batch carries ``docs`` [B, S] (int64): the document of each position of the GLOBAL sequence
(every cp rank holds all of it; hpctrain/data/packing.py numbers them 0, 1, ... along a row, each
document one contiguous run). Attention is then block-diagonal causal (a query sees the keys of its
own document at or before it) and positions restart at 0 with each document (RoPE, learned tables),
so a packed row computes exactly what its documents would compute one by one.
"""
from __future__ import annotations

import torch


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """docs [B, S] (each document a contiguous run) -> [B, S] int64: the position within its document."""
    seq = docs.shape[-1]
    index = torch.arange(seq, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def local_document_positions(docs: torch.Tensor, where: torch.Tensor | None, seq: int) -> torch.Tensor:
    """Per-document positions [B, seq] of this rank's tokens: those at global positions ``where`` [seq]
    (a cp rank's zig-zag tokens), or of positions 0..seq-1 when ``where`` is None."""
    positions = document_positions(docs)
    return positions[:, :seq] if where is None else positions[:, where]


def same_document(docs_q: torch.Tensor, docs_k: torch.Tensor) -> torch.Tensor:
    """[B, Sq] and [B, Sk] document ids -> [B, Sq, Sk] bool: query and key in the same document."""
    return docs_q[:, :, None] == docs_k[:, None, :]
