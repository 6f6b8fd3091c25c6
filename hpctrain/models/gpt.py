"""Decoder-only GPT built only from tensor-parallel layers; one pipeline stage per instance.

RMSNorm, grouped-query causal attention (``model.attention_window`` W > 0: sliding window, token t sees
t-W+1..t), optional tied embeddings; ``model.positions``: rotary ("rope",
Llama) or a learned absolute table added to the token embedding ("learned", GPT-2/3); ``model.mlp``:
SwiGLU ("swiglu", Llama) or GELU ("gelu", GPT: up, tanh-approximated GELU as GPT-2 and Megatron, down).
Activations are ``[S, B, D]`` (``[S/tp, B, D]`` between blocks with sequence parallelism). With context
parallelism (``cp_comm`` of size cp > 1) S is this cp rank's S_global/cp tokens in zig-zag order
(hpctrain/parallel/context_parallel.py): positions are the global ones, attention is a ring over cp.
Packed batches (SFT data) pass ``docs`` [B, S_global], the document of every position: attention is
then block-diagonal causal and positions restart with each document (hpctrain/parallel/packed.py).
Every parameter's initial value is its slab of a global tensor drawn from (seed, name), so every
(dp, tp, pp) layout starts from the same model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpctrain.config import resolve_model
from hpctrain.models.attention_backend import HOST as HOST_SDPA, attention as sdpa
from hpctrain.config.arithmetic import count_parameters, flops_per_token, partition_layers  # noqa: F401 (re-exported)
from hpctrain.models.lora import add_adapters, enabled as lora_enabled
from hpctrain.models.mlp import MLP
from hpctrain.models.moe import AuxLossWeight, MoE
from hpctrain.parallel.context_parallel import causal_window_mask, default_tile, ring_attention, zigzag_positions
from hpctrain.parallel.head_chunks import ChunkKernels, compiled_head_cross_entropy
from hpctrain.parallel.head_loss import chunk_tokens, fused_head_cross_entropy
from hpctrain.parallel.packed import local_document_positions, same_document
from hpctrain.config.rules import check_tp_divisibility, padded_vocab
from hpctrain.parallel.param_init import InitRule, new_param
from hpctrain.parallel.slab import make_spec
from hpctrain.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      vocab_parallel_cross_entropy)
from hpctrain.parallel.tp_comm import copy_to_tp, gather_seq


def eager_ring_attention(*args, **kwargs):
    """``ring_attention``; under torch.compile run eagerly (mpi4py exchanges, a blocked loop): a graph break
    by design (hpctrain/models/compile.py). Decorated lazily: torch._dynamo costs a second to import."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(ring_attention, reason="ring attention (mpi4py)")(*args, **kwargs)
    return ring_attention(*args, **kwargs)


class RMSNorm(nn.Module):
    """Bias-free RMSNorm: x / rms(x) * weight, in float32 for half inputs (fused by ``train.compile``); the
    output is in the weight's dtype (a float32 residual stream feeds half-precision sublayers)."""

    def __init__(self, name, dim, eps, tp_comm, sp, dtype):
        super().__init__()
        spec = make_spec(f"{name}.weight", (dim,), None, tp_comm,
                         partial_grad_over_tp=bool(sp and tp_comm and tp_comm.size > 1))
        self.weight = new_param(spec, dtype, InitRule("ones"))
        self.eps = eps

    def forward(self, x):
        compute = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(self.weight.dtype) * self.weight


def residual_dtype(m, dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype for training dtype ``dtype``: float32 when ``model.residual_dtype`` is
    "float32" and ``dtype`` is a half type (Megatron's --fp32-residual-connection), else ``dtype`` itself (a
    float32/float64 run is never narrowed)."""
    if getattr(m, "residual_dtype", "auto") == "float32" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def local_positions(seq: int, cp_comm, device=None) -> torch.Tensor | None:
    """Global positions [seq] (int64) of this cp rank's ``seq`` local tokens; None without context
    parallelism (positions 0..seq-1)."""
    if cp_comm is None or cp_comm.size == 1:
        return None
    return zigzag_positions(seq * cp_comm.size, cp_comm.rank, cp_comm.size, device=device)


def rotary_tables(seq: int, theta: float, head_dim: int, dtype, positions: torch.Tensor | None = None,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, B or 1, 1, head_dim/2] in ``dtype`` of the rotary angles (computed in float64) at
    ``positions`` ([S], or [B, S] per row (packed documents); None: 0..S-1)."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64, device=device) / half)
    where = torch.arange(seq, device=device) if positions is None else positions
    angles = where.to(torch.float64)[..., None] * freqs  # [S, half] or [B, S, half]
    angles = angles.transpose(0, 1) if angles.dim() == 3 else angles[:, None]  # [S, B or 1, half]
    return angles.cos().to(dtype)[:, :, None, :], angles.sin().to(dtype)[:, :, None, :]


def apply_rotary(x, cos, sin):
    """Rotate pairs of channels (i, i + hd/2) of x [S, B, H, hd] by the angles of ``rotary_tables``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def rotary(x, theta: float, positions: torch.Tensor | None = None):
    """Rotate pairs of channels of x [S, B, H, hd] by position (``positions`` [S], or [B, S] per row (packed
    documents); None: 0..S-1)."""
    return apply_rotary(x, *rotary_tables(x.shape[0], theta, x.shape[-1], x.dtype, positions, x.device))


class Attention(nn.Module):
    """Causal grouped-query attention; this TP rank holds n_heads/tp query and n_kv_heads/tp KV heads.
    One rank of the sequence: SDPA (with a mask for a sliding window), or for a window shorter than the
    sequence by more than a block the blocked attention of ``ring_attention`` on one rank, which never computes
    the blocks outside the window (3.1x faster and 2.3x less activation memory than SDPA's mask at 8K tokens,
    window 1024: docs/benchmarks.md); a cp group: ring attention on it."""

    def __init__(self, name, m, tp_comm, sp, dtype, seed, cp_comm=None):
        super().__init__()
        tp_size = 1 if tp_comm is None else tp_comm.size
        self.head_dim = m.d_model // m.n_heads
        self.local_heads, self.local_kv = m.n_heads // tp_size, m.n_kv_heads // tp_size
        self.theta, self.sp, self.tp_comm = m.rope_theta, sp, tp_comm
        self.window = m.attention_window
        self.cp_comm = cp_comm if cp_comm is not None and cp_comm.size > 1 else None
        self.rope = m.positions == "rope"  # learned positions are added to the embedding instead
        self.sdpa_choice = HOST_SDPA  # the SDPA kernels (attention_backend.use_sdpa sets the device's)
        kw = dict(dtype=dtype, seed=seed, std=m.init_std)
        kv_out = m.n_kv_heads * self.head_dim
        kw["input_mode"] = "none"  # forward() gathers/copies x once for q, k and v
        self.wq = ColumnParallelLinear(f"{name}.wq", m.d_model, m.d_model, tp_comm, **kw)
        self.wk = ColumnParallelLinear(f"{name}.wk", m.d_model, kv_out, tp_comm, **kw)
        self.wv = ColumnParallelLinear(f"{name}.wv", m.d_model, kv_out, tp_comm, **kw)
        del kw["input_mode"]
        self.wo = RowParallelLinear(f"{name}.wo", m.d_model, m.d_model, tp_comm, sp=sp, **kw)

    def rotary_tables(self, seq: int, docs, device, dtype):
        """cos, sin of this rank's ``seq`` positions (global ones with cp; restarting per document with
        ``docs``): ``rotary_tables``, computed once per stage forward and shared by its blocks."""
        positions = local_positions(seq, self.cp_comm, device)
        if docs is not None:  # positions restart with each document
            positions = local_document_positions(docs, positions, seq)
        return rotary_tables(seq, self.theta, self.head_dim, dtype, positions, device)

    def forward(self, x, docs=None, tables=None):
        """x [S(/tp), B, D] -> [S(/tp), B, D]; ``docs`` [B, S_global] int64: packed documents, or None;
        ``tables``: the rotary (cos, sin) of ``rotary_tables`` (None: computed here). Given from outside, a
        compiled block loads them instead of recomputing float64 cos/sin in every fused element."""
        x = gather_seq(x, self.tp_comm) if self.sp else copy_to_tp(x, self.tp_comm)  # one op feeds q, k and v
        seq, batch = x.shape[0], x.shape[1]
        q = self.wq(x).view(seq, batch, self.local_heads, self.head_dim)
        k = self.wk(x).view(seq, batch, self.local_kv, self.head_dim)
        v = self.wv(x).view(seq, batch, self.local_kv, self.head_dim)
        if self.rope:
            cos, sin = self.rotary_tables(seq, docs, x.device, x.dtype) if tables is None else tables
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, H, S, hd]
        sparse_window = 0 < self.window and self.window + default_tile(x.device) < seq and seq % 2 == 0
        if self.cp_comm is not None or sparse_window:  # the ring (of one rank: blocks outside the window skipped)
            out = eager_ring_attention(q, k, v, self.cp_comm, window=self.window, docs=docs)
        else:
            group = self.local_heads // self.local_kv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            if docs is not None:  # block-diagonal causal: [B, 1, S, S]
                where = torch.arange(seq, device=x.device)
                mask = causal_window_mask(where, where, self.window) & same_document(docs, docs)
                out = sdpa(q, k, v, self.sdpa_choice, attn_mask=mask[:, None])
            elif 0 < self.window < seq:
                where = torch.arange(seq, device=x.device)
                out = sdpa(q, k, v, self.sdpa_choice, attn_mask=causal_window_mask(where, where, self.window))
            else:
                out = sdpa(q, k, v, self.sdpa_choice)
        return self.wo(out.permute(2, 0, 1, 3).reshape(seq, batch, self.local_heads * self.head_dim))


class LearnedPositions(nn.Module):
    """GPT's absolute position table ``pos_embed.weight`` [max_seq_len, D], replicated over TP, added to the
    token embedding on the first stage. With sequence parallelism the embedding is this tp rank's local
    sequence [S/tp, B, D], positions ``tp_rank * S/tp`` onwards, and the table's gradient is partial per tp rank
    (summed over TP like the norms'); without it every tp rank adds all S positions and gets the whole grad.
    With context parallelism the positions are those of this cp rank's zig-zag stripes (then the tp rank's
    part of them)."""

    def __init__(self, m, tp_comm, sp, dtype, seed, cp_comm=None):
        super().__init__()
        split_seq = bool(sp and tp_comm is not None and tp_comm.size > 1)
        spec = make_spec("pos_embed.weight", (m.max_seq_len, m.d_model), None, tp_comm, partial_grad_over_tp=split_seq)
        self.weight = new_param(spec, dtype, InitRule.normal(m.init_std, seed))
        self.sp_index: int  # which S/tp part of the sequence this tp rank holds (0 without SP)
        self.split_over: int
        self.sp_index, self.split_over = (tp_comm.rank, tp_comm.size) if split_seq else (0, 1)
        self.cp_comm = cp_comm

    def forward(self, x, docs=None):
        """x [S_local, B, D] -> x + the table's rows of this rank's positions (per document when ``docs``)."""
        start, full = self.sp_index * x.shape[0], x.shape[0] * self.split_over
        positions = local_positions(full, self.cp_comm, x.device)
        if docs is not None:
            positions = local_document_positions(docs, positions, full)[:, start:start + x.shape[0]]
            return x + self.weight[positions.t()]
        if positions is None:
            return x + self.weight[start:start + x.shape[0]].unsqueeze(1)
        return x + self.weight[positions[start:start + x.shape[0]]].unsqueeze(1)


class Block(nn.Module):
    """Attention and an MLP, each after an RMSNorm, each added to the residual. With ``moe`` (a resolved
    ``[moe]`` section naming this block) the MLP is the routed ``MoE`` layer (hpctrain/models/moe.py), at
    ``name.moe``; ``ep_comm``: its expert-parallel group, ``aux_weight``: its stage's ``AuxLossWeight``."""

    def __init__(self, name, m, tp_comm, sp, dtype, seed, cp_comm=None, moe=None, ep_comm=None, aux_weight=None):
        super().__init__()
        self.attn_norm = RMSNorm(f"{name}.attn_norm", m.d_model, m.norm_eps, tp_comm, sp, dtype)
        self.attn = Attention(f"{name}.attn", m, tp_comm, sp, dtype, seed, cp_comm)
        self.mlp_norm = RMSNorm(f"{name}.mlp_norm", m.d_model, m.norm_eps, tp_comm, sp, dtype)
        self.routed = moe is not None
        if moe is not None:
            self.moe = MoE(f"{name}.moe", m, moe, tp_comm, sp, dtype, seed, cp_comm, ep_comm, aux_weight)
        else:
            self.mlp = MLP(f"{name}.mlp", m, tp_comm, sp, dtype, seed)

    def forward(self, x, docs=None, tables=None):
        x = x + self.attn(self.attn_norm(x), docs, tables)
        return x + (self.moe if self.routed else self.mlp)(self.mlp_norm(x))


class GPTStage(nn.Module):
    """Layers ``[first_layer, last_layer)`` of the GPT; the first stage embeds, the last computes logits.

    forward: first stage ids [B, S] -> hidden; other stages hidden [S(/tp), B, D] -> hidden (hidden in
    ``residual_dtype``: the training dtype, or float32 with ``model.residual_dtype``);
    the last stage returns vocab-parallel logits [S, B, n]: this tp rank's real vocabulary ids
    [vocab_start, vocab_start + n) (with tp = 1 the whole true vocabulary, [S, B, vocab_size]). The LM
    head holds ``padded_vocab`` rows; their padding columns are cut off here, before any loss, softmax or
    sampling sees them (so the padding rows get zero gradient). ``loss_sum`` turns the logits into the SUM
    of per-token losses (the trainer divides by the global count of counted tokens); ``forward_loss``: both,
    fused over loss chunks (of tokens) without logits (hpctrain/parallel/head_loss.py). ``docs`` [B, S_global]:
    the packed documents of every position (hpctrain/parallel/packed.py), or None. ``lora``: a ``[lora]``
    section with rank > 0 adds adapters and freezes the rest (hpctrain/models/lora.py); None or rank 0: none.
    ``moe``: a resolved ``[moe]`` section (config.moe_keys.resolve_moe) or None: its blocks route over experts
    (hpctrain/models/moe.py), split over ``ep_comm`` (expert parallelism; None: all local).
    """

    def __init__(self, m, layer_range: tuple[int, int], *, is_first: bool, is_last: bool, tp_comm=None,
                 sp: bool = False, dtype=torch.float32, seed: int = 0, recompute: bool = False, cp_comm=None,
                 lora=None, moe=None, ep_comm=None):
        super().__init__()
        m = resolve_model(m)  # a preset's mlp/positions/tie_embeddings
        tp_size = 1 if tp_comm is None else tp_comm.size
        check_tp_divisibility(m, tp_size)
        self.is_first, self.is_last, self.tp_comm, self.sp, self.recompute = is_first, is_last, tp_comm, sp, recompute
        self.layer_range = layer_range
        # the residual stream (embedding output, between blocks and stages, the final norm's input) may be
        # wider than the weights: each sublayer computes in ``dtype`` (``residual_dtype``)
        self.compute_dtype, self.residual_dtype = dtype, residual_dtype(m, dtype)
        vocab = padded_vocab(m, tp_size)
        if is_first:
            self.embed = VocabParallelEmbedding("embed", m.vocab_size, m.d_model, tp_comm, sp=sp, dtype=dtype,
                                                seed=seed, std=m.init_std, padded_vocab=vocab)
            if m.tie_embeddings and not is_last:  # pp > 1: the last stage holds a copy
                self.embed.weight.spec = replace(self.embed.weight.spec, tied="original")
            if m.positions == "learned":
                self.pos_embed = LearnedPositions(m, tp_comm, sp, dtype, seed, cp_comm)
        self.aux_weight = AuxLossWeight()  # the MoE layers' auxiliary-loss factor (the executor sets it)
        moe_layers = set(moe.layers) if moe is not None else set()
        self.layers = nn.ModuleDict({str(i): Block(f"layers.{i}", m, tp_comm, sp, dtype, seed, cp_comm,
                                                   moe if i in moe_layers else None, ep_comm, self.aux_weight)
                                     for i in range(*layer_range)})
        if is_last:
            self.norm = RMSNorm("norm", m.d_model, m.norm_eps, tp_comm, sp, dtype)
            if m.tie_embeddings and is_first:
                self.head = ColumnParallelLinear("embed", m.d_model, m.vocab_size, tp_comm, sp=sp, weight=self.embed.weight)
            elif m.tie_embeddings:  # pp > 1: a copy of the embedding; its grad is summed with stage 0's
                self.head = ColumnParallelLinear("embed", m.d_model, m.vocab_size, tp_comm, sp=sp, dtype=dtype,
                                                 seed=seed, std=m.init_std, padded_out=vocab)
                self.head.weight.spec = replace(self.head.weight.spec, tied="copy")
            else:
                self.head = ColumnParallelLinear("head", m.d_model, m.vocab_size, tp_comm, sp=sp, dtype=dtype,
                                                 seed=seed, std=m.init_std, padded_out=vocab)
            spec = self.head.w.spec  # head rows: vocabulary ids [vocab_start, + vocab_valid), then padding
            self.vocab_start, self.vocab_valid = spec.tp_rank * spec.local_shape[0], spec.valid_shape[0]
            self.fused_loss, self.loss_chunk = m.fused_head_loss, m.loss_chunk_tokens
        # torch.compile of ``tail_loss``, or of ``whole_loss`` (hpctrain/models/compile.py ``compile_stage``), or
        # None: eager; with the fused head: of ``hidden`` (the whole stage but its head) and the head's chunks
        self.compiled_tail: Callable[..., torch.Tensor] | None = None
        self.compiled_whole: Callable[..., torch.Tensor] | None = None
        self.compiled_hidden: Callable[..., torch.Tensor] | None = None
        self.head_chunks: ChunkKernels | None = None
        # another library's fused head + loss at tp = 1 (hpctrain/parallel/head_kernels.py, model.head_kernel):
        # (h [N, D], w [n_valid, D], targets [N], -100 = not counted) -> summed loss; None: hpctrain's own
        self.head_kernel: Callable[..., torch.Tensor] | None = None
        if lora_enabled(lora):  # adapters on the lora.targets linears; every other weight frozen
            add_adapters(self, m, lora, tp_comm, dtype, seed)

    def forward(self, x, docs=None):
        x = self._trunk(x, docs)
        return self._logits(x) if self.is_last else x

    def _logits(self, h):
        """The LM head on the final norm's output h [S(/tp), B, D] -> this rank's real-vocabulary logits."""
        x = self.head(h)
        if x.shape[-1] > self.vocab_valid:
            x = x[..., :self.vocab_valid]  # padding columns dropped (a view)
        return x

    def tail_loss(self, h, targets, mask=None):
        """The last stage's tail on the blocks' output h [S(/tp), B, D]: final norm, LM head and the summed
        loss (``loss_sum``); ``train.compile`` makes it one compiled region (hpctrain/models/compile.py)."""
        return self.loss_sum(self._logits(self.norm(h)), targets, mask)

    def whole_loss(self, x, targets, mask=None, docs=None):
        """A one-stage model's whole forward and summed loss (embedding, blocks, final norm, LM head, loss) on
        tokens x [B, S]: with ``train.compile`` at dp = pp = tp = cp = 1 one compiled region, forward and
        backward (no reduction for per-block gradient hooks to overlap; hpctrain/models/compile.py)."""
        return self.tail_loss(self._trunk(x, docs, norm=False), targets, mask)

    def hidden(self, x, docs=None):
        """The stage without its LM head: the final norm's output [S(/tp), B, D] (last stage) or the hidden state
        it sends on; with the fused head under ``train.compile`` at dp = pp = tp = cp = 1 one compiled region."""
        return self._trunk(x, docs)

    def _trunk(self, x, docs, norm: bool = True):
        """Embedding (first stage), blocks, final norm (last stage; ``norm=False``: without it): the stage
        without its LM head."""
        if self.is_first:
            x = self.embed(x.t().contiguous()).to(self.residual_dtype)
            if hasattr(self, "pos_embed"):
                x = self.pos_embed(x, docs)
        tables = self._rotary_tables(x, docs)
        for block in self.layers.values():
            recompute = self.recompute and self.training
            x = checkpoint(block, x, docs, tables, use_reentrant=False) if recompute else block(x, docs, tables)
        return self.norm(x) if self.is_last and norm else x

    def _rotary_tables(self, x, docs):
        """The blocks' rotary (cos, sin) for the hidden state x [S(/tp), B, D], once per forward; None
        without rotary positions or blocks."""
        first = next(iter(self.layers.values()), None)
        if not isinstance(first, Block) or not first.attn.rope:  # None: no blocks
            return None
        split = self.tp_comm.size if self.sp and self.tp_comm is not None else 1  # attention sees all S
        return first.attn.rotary_tables(x.shape[0] * split, docs, x.device, self.compute_dtype)  # as q and k

    def loss_sum(self, logits, targets, mask=None):
        """Sum over tokens of the cross-entropy; targets [B, S]; ``mask`` [B, S] bool: only the tokens where it
        is True count (None: all). Talks on tp."""
        losses = vocab_parallel_cross_entropy(logits, targets.t().contiguous(), self.tp_comm, self.vocab_start)
        return losses.sum() if mask is None else torch.where(mask.t(), losses, 0).sum()

    def forward_loss(self, x, targets, mask=None, docs=None):
        """The last stage's ``loss_sum(forward(x, docs), targets, mask)``; with ``model.fused_head_loss`` over
        loss chunks of ``model.loss_chunk_tokens`` tokens, never [S, B, vocab] logits; with a compiled tail
        (``compiled_tail``, train.compile) the tail is one compiled region (under tp broken at its collectives),
        or with ``compiled_whole`` the whole stage. Talks on tp."""
        eager_head = self.head.weight_grads is not None or self.head.fp8 is not None
        # (a zero-bubble schedule's deferred weight gradient, a float8 head: eager by design)
        if self.compiled_whole is not None and not eager_head:
            return self.compiled_whole(x, targets, mask, docs)
        if self.compiled_tail is not None and not eager_head:
            return self.compiled_tail(self._trunk(x, docs, norm=False), targets, mask)
        if not self.fused_loss or self.head.lora is not None:
            return self.loss_sum(self(x, docs), targets, mask)
        h = self.compiled_hidden(x, docs) if self.compiled_hidden is not None else self._trunk(x, docs)
        h = gather_seq(h, self.tp_comm) if self.sp else copy_to_tp(h, self.tp_comm)  # as the head's input
        h, targets = h.flatten(0, 1), targets.t().reshape(-1)
        mask = None if mask is None else mask.t().reshape(-1)
        if self.head_kernel is not None and torch.is_grad_enabled():  # tp = 1: the start-up trial's pick
            return self.head_kernel(h, self.head.w[:self.vocab_valid],
                                    targets if mask is None else targets.masked_fill(~mask, -100))
        chunk = chunk_tokens(self.loss_chunk, h.shape[0], self.head.w.shape[0])
        if self.head_chunks is not None:  # the summed loss
            return compiled_head_cross_entropy(h, self.head.w, targets, self.tp_comm, self.vocab_start,
                                               self.vocab_valid, chunk, self.head_chunks, mask)
        return fused_head_cross_entropy(h, self.head.w, targets, self.tp_comm, self.vocab_start, self.vocab_valid,
                                        chunk, mask)
