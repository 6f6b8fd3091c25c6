"""Mixture of experts: the routed SwiGLU layer that replaces a block's MLP (``[moe]``, issue #41).

For the block input x [S(/tp), B, D] (gathered to the rank's whole local sequence [S, B, D] like the MLP's
input), each of the T = S x B tokens:

1. Router: logits = x W_r^T [T, E] in float32 (float64 for a float64 model), softmax over the E experts,
   the ``top_k`` largest probabilities renormalised to sum to 1 (Mixtral's routing).
2. Capacity (``capacity_factor`` > 0): per sequence, expert e serves at most C = ceil(cf x S_seq x k / E) of
   the choices made to it, first choices first, then by global position; the others are dropped (weight 0).
   The order depends only on the sequence, so the same choices drop in every layout; with context parallelism
   the ranks of a sequence gather each other's choices over cp (``keep_mask``).
3. Experts: the kept (token, choice) rows, sorted by expert, are padded per expert into [E_local, M, D] and
   go through the SwiGLU experts as batched matmuls (gate/up [E_local, F/tp, D], down [E_local, D, F/tp]:
   split over tp like the MLP, so the output is partial over tp and reduced like the MLP's). With expert
   parallelism the rows first travel to the ep rank holding their expert and back (``Dispatcher``,
   hpctrain/parallel/expert_parallel.py).
4. Combine: out_t = sum_j w_tj y_tj (dropped choices add 0), plus the shared experts' dense SwiGLU.

Auxiliary losses, per sequence and layer (Switch/Mixtral load balancing: E sum_e f_e P_e with f_e the
sequence's choices of e over its S_seq tokens and P_e its mean probability; ST-MoE z-loss: lse(logits)^2 per
token) join the step's loss as the token loss does: summed over tokens (the balance loss weighted by its
sequence's S_seq tokens) and multiplied by the step's ``loss_scale`` (1 / counted tokens, times the fp16
scale), which ``AuxLossWeight`` carries to the backward (Megatron's MoEAuxLossAutoScaler idea: the gradient
is attached to the layer's output, so it works on every pipeline stage). Every tp rank routes the same
tokens, so each contributes 1/tp of it. Reported values (``MoeStats``) are the unweighted sums.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.mlp import MLP
from hpctrain.models.swiglu import silu_mul
from hpctrain.parallel.context_parallel import zigzag_positions
from hpctrain.parallel.expert_parallel import Dispatcher
from hpctrain.parallel.fp8 import Fp8Linear, fp8_linear
from hpctrain.parallel.lora import LoraFactor, LoraSettings, kaiming_uniform_rule
from hpctrain.parallel.param_init import InitRule, new_param
from hpctrain.parallel.slab import make_spec
from hpctrain.parallel.tp_comm import copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq


class AuxLossWeight:
    """The factor of this step's summed token loss (``loss_scale``), set by the pipeline executor before its
    forwards; MoE layers multiply their auxiliary losses' gradient by it. One per stage."""

    def __init__(self):
        self.value: float | torch.Tensor = 1.0


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward also gives ``aux`` (a 0-d loss term) the gradient ``weight``."""

    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, (torch.ones((), dtype=torch.float64, device=grad.device) * ctx.weight).to(ctx.aux_dtype), None


@dataclasses.dataclass
class MoeStats:
    """What one MoE layer saw in the step's forwards (training only, counted once per token: tp rank 0 of
    a tp group reports it). ``tokens_per_expert`` [E]: kept choices per expert; ``dropped``: choices dropped
    by the capacity; ``aux``: sum over sequences of their balance loss (partial per cp rank); ``z``: sum over
    tokens of lse^2; ``tokens``: tokens routed."""
    tokens_per_expert: torch.Tensor
    dropped: float = 0.0
    aux: float = 0.0
    z: float = 0.0
    tokens: float = 0.0

    def clear(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped = self.aux = self.z = self.tokens = 0.0


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (probabilities [T, E], top-k weights [T, k] renormalised to sum 1, expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), experts


def capacity_slots(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts [S, B, k] (one sequence per column b, rows in position order) -> [S, B, k] int64: how many
    choices of the same expert in the same sequence come before each choice (first choices first, then by
    position)."""
    s, b, k = experts.shape
    by_choice = experts.permute(2, 0, 1).reshape(k * s, b)  # choice-major, then position
    onehot = F.one_hot(by_choice, num_experts)  # [k S, B, E]
    slots = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # [k S, B]
    return slots.view(k, s, b).permute(1, 2, 0)


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int, cp_comm=None) -> torch.Tensor:
    """[S_local, B, k] bool: the choices an expert's per-sequence ``capacity`` serves. With a cp group (size > 1,
    talks on it: one all-gather of the choices) the sequence is the cp ranks' zig-zag stripes together."""
    if cp_comm is None or cp_comm.size == 1:
        return capacity_slots(experts, num_experts) < capacity
    s, cp = experts.shape[0], cp_comm.size
    everyone = torch.empty((cp,) + tuple(experts.shape), dtype=experts.dtype, device=experts.device)
    cp_comm.allgather(everyone, experts.contiguous())
    whole = torch.empty((s * cp,) + tuple(experts.shape[1:]), dtype=experts.dtype, device=experts.device)
    for r in range(cp):
        whole[zigzag_positions(s * cp, r, cp, experts.device)] = everyone[r]
    mine = zigzag_positions(s * cp, cp_comm.rank, cp, experts.device)
    return (capacity_slots(whole, num_experts) < capacity)[mine]


class Router(nn.Module):
    """``name.weight`` [E, D], replicated over tp; its gradient is partial per tp rank when tp > 1 (each
    rank's expert outputs are partial sums over its d_ff slab), summed over tp before the dp reduction."""

    def __init__(self, name, num_experts, m, tp_comm, dtype, seed):
        super().__init__()
        tp = 1 if tp_comm is None else tp_comm.size
        spec = make_spec(f"{name}.weight", (num_experts, m.d_model), None, tp_comm, partial_grad_over_tp=tp > 1)
        self.weight = new_param(spec, dtype, InitRule.normal(m.init_std, seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> logits [T, E] in float32 (float64 for float64)."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        return F.linear(x.to(dtype), self.weight.to(dtype))


class Experts(nn.Module):
    """This rank's experts [first, first + count) of ``num_experts`` SwiGLU experts, each split over tp on its
    width: ``gate``, ``up`` [count, F/tp, D], ``down`` [count, D, F/tp]. Global tensors [E, F, D] / [E, D, F]
    (the checkpoint's), drawn from (seed, name) like every weight."""

    def __init__(self, name, m, moe, tp_comm, dtype, seed, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        e, f, d = moe.num_experts, moe.d_ff_expert, m.d_model
        self.count, self.first = e // ep_size, ep_rank * (e // ep_size)
        held = (self.first, self.count) if ep_size > 1 else None

        def weight(part, shape, split) -> nn.Parameter:
            spec = make_spec(f"{name}.{part}", shape, split, tp_comm, experts=held)
            return new_param(spec, dtype, InitRule.normal(m.init_std, seed))

        self.gate = weight("gate", (e, f, d), 1)
        self.up = weight("up", (e, f, d), 1)
        self.down = weight("down", (e, d, f), 2)
        self.name, self.held, self.dtype = name, held, dtype
        self.adapters = nn.ModuleDict()  # LoRA (``add_adapters``): part -> its factors
        self.lora: LoraSettings | None = None
        self.fp8: dict[str, Fp8Linear] = {}  # part -> its float8 settings (hpctrain/models/fp8.py), none: dtype

    def add_adapters(self, parts, rank: int, alpha: float, dropout: float, tp_comm, seed: int) -> None:
        """LoRA on the experts' ``parts`` (of gate, up, down), split like their weights (parallel/lora.py):
        gate/up (column) A [E, r, D] replicated over tp with partial grads, B [E, F/tp, r]; down (row)
        A [E, r, F/tp], B [E, D, r] replicated with partial grads. Global names ``<name>.<part>.lora_A.weight``
        (as PEFT names a linear's). A Kaiming-uniform over its input, B zero, from (seed, name)."""
        partial = tp_comm is not None and tp_comm.size > 1
        e, f, d = self.gate.spec.global_shape  # type: ignore[attr-defined]  # the SlabSpec (parallel/slab.py)
        for part in parts:
            column = part != "down"
            fan_in, out = (d, f) if column else (f, d)
            a_spec = make_spec(f"{self.name}.{part}.lora_A.weight", (e, rank, fan_in), None if column else 2, tp_comm,
                               partial_grad_over_tp=partial and column, experts=self.held)
            b_spec = make_spec(f"{self.name}.{part}.lora_B.weight", (e, out, rank), 1 if column else None, tp_comm,
                               partial_grad_over_tp=partial and not column, experts=self.held)
            lora_a = LoraFactor(a_spec, self.dtype, kaiming_uniform_rule(fan_in, seed))
            lora_b = LoraFactor(b_spec, self.dtype)  # zero
            self.adapters[part] = nn.ModuleDict({"lora_A": lora_a, "lora_B": lora_b})
        self.lora = LoraSettings(alpha / rank, dropout)

    def _factor(self, part: str, which: str) -> torch.Tensor:
        pair = self.adapters[part]
        assert isinstance(pair, nn.ModuleDict)
        factor = pair[which]
        assert isinstance(factor, LoraFactor)
        return factor.weight

    def _linear(self, x: torch.Tensor, part: str) -> torch.Tensor:
        """x [count, M, in] through every local expert's ``part`` weight (+ its adapter): [count, M, out]."""
        y = x @ getattr(self, part).transpose(1, 2)
        if part in self.adapters and self.lora is not None:
            a, b = self._factor(part, "lora_A"), self._factor(part, "lora_B")
            if self.lora.dropout and self.training:
                x = F.dropout(x, self.lora.dropout)
            y = y + (x @ a.transpose(1, 2)) @ b.transpose(1, 2) * self.lora.scaling
        return y

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, sources: torch.Tensor | None = None) -> torch.Tensor:
        """rows [N, D] sorted by local expert, ``counts`` [count] rows per expert -> [N, D] (partial over tp):
        one batched matmul per weight over the experts, each padded to the most rows any of them got. ``sources``
        [ep, count] (host): how many of each expert's rows came from each ep rank (they come in that order);
        None: all from this rank. With ``train.fp8``: ``_float8_forward``."""
        if self.fp8:
            return self._float8_forward(rows, counts, sources)
        n, d = rows.shape
        most = int(counts.max()) if n else 0
        expert = torch.repeat_interleave(torch.arange(self.count, device=rows.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = expert * most + torch.arange(n, device=rows.device) - starts[expert]
        padded = rows.new_zeros(self.count * most, d).index_copy(0, slot, rows).view(self.count, most, d)
        h = silu_mul(self._linear(padded, "gate"), self._linear(padded, "up"))  # [count, M, F/tp]
        return self._linear(h, "down").reshape(self.count * most, d)[slot]


    def _float8_forward(self, rows: torch.Tensor, counts: torch.Tensor, sources: torch.Tensor | None) -> torch.Tensor:
        """``forward`` with float8 linears: each expert runs its rows from each source rank (one replica's
        micro-batch) as a linear of its own, so their activations are scaled over the tokens one process's
        micro-batch gives the expert, whatever ep is (parallel/fp8.py); no padding."""
        per = 1 if sources is None else sources.shape[0]
        sizes = (counts.cpu() if sources is None else sources.t().reshape(-1)).tolist()  # expert-major, then source
        out, start = [], 0
        for i, n in enumerate(sizes):
            x, e = rows[start:start + n], i // per
            start += n
            h = silu_mul(self._expert_linear(x, e, "gate"), self._expert_linear(x, e, "up"))
            out.append(self._expert_linear(h, e, "down"))
        return torch.cat(out) if out else rows[:0]

    def _expert_linear(self, x: torch.Tensor, e: int, part: str) -> torch.Tensor:
        """x [M, in] through local expert ``e``'s ``part`` weight (float8 where ``fp8`` has it) + its adapter."""
        weight, f = getattr(self, part)[e], self.fp8.get(part)
        y = fp8_linear(x, weight, f) if f is not None else F.linear(x, weight)
        if part in self.adapters and self.lora is not None:
            a, b = self._factor(part, "lora_A")[e], self._factor(part, "lora_B")[e]
            if self.lora.dropout and self.training:
                x = F.dropout(x, self.lora.dropout)
            y = y + F.linear(F.linear(x, a), b) * self.lora.scaling
        return y


class MoE(nn.Module):
    """The routed layer of block ``name`` (module docstring). forward: x [S(/tp), B, D] -> [S(/tp), B, D].
    Talks on tp (like the MLP), on cp for the capacity's choices, on ep (``ep_comm``) for the dispatch."""

    def __init__(self, name, m, moe, tp_comm, sp, dtype, seed, cp_comm=None, ep_comm=None,
                 aux_weight: AuxLossWeight | None = None):
        super().__init__()
        self.tp_comm, self.sp, self.moe = tp_comm, sp, moe
        self.cp_comm = cp_comm if cp_comm is not None and cp_comm.size > 1 else None
        self.tp_size = 1 if tp_comm is None else tp_comm.size
        self.counts_once = tp_comm is None or tp_comm.rank == 0  # every tp rank routes the same tokens
        ep_rank, ep_size = (0, 1) if ep_comm is None else (ep_comm.rank, ep_comm.size)
        self.router = Router(f"{name}.router", moe.num_experts, m, tp_comm, dtype, seed)
        self.experts = Experts(f"{name}.experts", m, moe, tp_comm, dtype, seed, ep_rank, ep_size)
        self.dispatcher = Dispatcher(ep_comm, moe.num_experts, name)
        if moe.shared_experts:
            width = moe.shared_experts * moe.d_ff_expert
            self.shared = MLP(f"{name}.shared", dataclasses.replace(m, d_ff=width, mlp="swiglu"), tp_comm, sp, dtype,
                              seed)
        self.aux_weight = aux_weight if aux_weight is not None else AuxLossWeight()
        self.stats = MoeStats(torch.zeros(moe.num_experts, dtype=torch.float64, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under torch.compile (``train.compile``) the layer runs eagerly, a graph break by design: its shapes
        depend on the routing and it talks on ep and cp (hpctrain/models/compile.py); the rest of the block
        compiles."""
        if torch.compiler.is_compiling():
            return torch.compiler.disable(self._forward, reason="MoE routing: data-dependent shapes, all-to-all")(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gather_seq(x, self.tp_comm) if self.sp else copy_to_tp(x, self.tp_comm)
        s, b, d = h.shape
        tokens = h.reshape(s * b, d)
        logits = self.router(tokens)
        probs, weights, experts = route(logits, self.moe.top_k)
        k, e = self.moe.top_k, self.moe.num_experts
        seq = s * (self.cp_comm.size if self.cp_comm is not None else 1)  # the whole sequence's tokens
        keep = None
        if self.moe.capacity_factor > 0:
            capacity = math.ceil(self.moe.capacity_factor * seq * k / e)
            keep = keep_mask(experts.view(s, b, k), e, capacity, self.cp_comm).reshape(s * b, k)
        out = self._experts(tokens, weights, experts, keep)
        out = out.view(s, b, d)
        out = reduce_scatter_seq(out, self.tp_comm) if self.sp else reduce_from_tp(out, self.tp_comm)
        if self.training and torch.is_grad_enabled():
            out = self._auxiliary_losses(out, logits, probs, experts, keep, s, b, seq)
        if self.moe.shared_experts:
            out = out + self.shared(x)
        return out

    def _experts(self, tokens, weights, experts, keep):
        """Each kept (token, choice) row through its expert, combined per token: [T, D] (partial over tp)."""
        t, k = experts.shape
        choice = torch.arange(t * k, device=tokens.device)
        if keep is not None:
            choice = choice[keep.reshape(-1)]
        chosen = experts.reshape(-1)[choice]
        order = torch.argsort(chosen, stable=True)
        choice, chosen = choice[order], chosen[order]
        y = self.dispatcher.run(tokens[choice // k], chosen, self.experts)  # [N, D], rows in ``choice`` order
        per_choice = tokens.new_zeros(t * k, tokens.shape[1]).index_copy(0, choice, y)
        return (per_choice.view(t, k, -1) * weights.to(tokens.dtype).unsqueeze(-1)).sum(1)

    def _auxiliary_losses(self, out, logits, probs, experts, keep, s, b, seq):
        """Attach the balance and z losses' gradient to ``out``; add what was seen to ``stats`` (not in a
        recomputed forward, which runs inside backward)."""
        e, moe = self.moe.num_experts, self.moe
        chosen = F.one_hot(experts.view(s, b, -1), e).sum((0, 2)).to(probs.dtype)  # [B, E] choices per sequence
        if self.cp_comm is not None:
            self.cp_comm.allreduce(chosen)  # the whole sequence's
        mean_probs = probs.view(s, b, e).sum(0)  # [B, E], this rank's part of the sum over the sequence
        balance = e * (chosen * mean_probs).sum() / (seq * seq)  # sum over sequences of E sum_e f_e P_e
        lse_sq = torch.logsumexp(logits, dim=-1).pow(2).sum()
        loss = (moe.aux_loss_coef * seq * balance + moe.z_loss_coef * lse_sq) / self.tp_size
        if loss.requires_grad:
            out = _AttachAuxLoss.apply(out, loss, self.aux_weight.value)
        if self.counts_once and torch._C._current_graph_task_id() == -1:
            st = self.stats
            kept = experts.reshape(-1) if keep is None else experts.reshape(-1)[keep.reshape(-1)]
            st.tokens_per_expert += torch.bincount(kept, minlength=e).to(st.tokens_per_expert).cpu()
            st.dropped += 0.0 if keep is None else float((~keep).sum())
            st.aux += float(balance.detach())
            st.z += float(lse_sq.detach())
            st.tokens += float(s * b)
        return out


class MoeStepStats:
    """The MoE layers' ``MoeStats`` of a step, summed over the world: ``collect()`` (collective over the world:
    one all-reduce of (E + 4) numbers per MoE layer of the model) returns the record's ``moe_*`` fields and
    clears the layers' counts. ``layers``: the model's MoE blocks (resolved ``moe.layers``); ``global_batch``:
    the step's sequences."""

    def __init__(self, stages, moe, world, global_batch: int):
        self.moe, self.world, self.global_batch = moe, world, global_batch
        self.mine = {int(i): block.moe for stage in stages for i, block in stage.layers.items()
                     if getattr(block, "moe", None) is not None}

    def collect(self) -> dict:
        e, order = self.moe.num_experts, list(self.moe.layers)
        width = e + 4
        totals = torch.zeros(len(order) * width, dtype=torch.float64)
        for slot, layer in enumerate(order):
            if layer in self.mine:
                st = self.mine[layer].stats
                totals[slot * width:slot * width + e] = st.tokens_per_expert
                totals[slot * width + e:(slot + 1) * width] = torch.tensor([st.dropped, st.aux, st.z, st.tokens])
                st.clear()
        self.world.allreduce(totals)
        rows = totals.view(len(order), width)
        tokens = rows[:, e + 3].clamp(min=1)
        return {"moe_aux_loss": float((rows[:, e + 1] / self.global_batch).sum()),
                "moe_z_loss": float((rows[:, e + 2] / tokens).sum()),
                "moe_dropped_fraction": float(rows[:, e].sum() / (tokens.sum() * self.moe.top_k)),
                "moe_tokens_per_expert": {str(layer): [int(v) for v in rows[i, :e].tolist()]
                                          for i, layer in enumerate(order)}}
