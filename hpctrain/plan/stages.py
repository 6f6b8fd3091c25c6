"""What one rank of a layout holds: its pipeline stage's layers, parameters and activation sizes.

Shared by the time model (cost.py) and the memory model (memory.py). Counts are per tensor-parallel
rank; bytes are for the training dtype (``dtype_bytes``: 2 for bfloat16/float16). ``moe``: a resolved
``[moe]`` section (``config.moe_keys.resolve_moe``), None for a dense model; ``ep``: ``parallel.ep``.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.arithmetic import moe_rank_parameters, partition_layers
from hpctrain.plan.devices import PlanError
from hpctrain.plan.shapes import block_matmul_params, position_params

RECOMPUTE = ("off", "selective", "full")


def recompute_kind(value) -> str:
    """"off", "selective" or "full" (booleans: True is "full", hpctrain's ``train.recompute``)."""
    if isinstance(value, bool) or value is None:
        return "full" if value else "off"
    if value not in RECOMPUTE:
        raise PlanError(f"recompute {value!r}: expected one of {', '.join(RECOMPUTE)}")
    return value


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``index`` holds ``layers`` blocks, ``moe_layers`` of them MoE blocks; the first embeds,
    the last has the LM head."""

    index: int
    layers: int
    first: bool
    last: bool
    moe_layers: int = 0

    @property
    def kind(self) -> tuple[int, bool, bool, int]:
        """What makes two stages alike (their memory and slot times are the same)."""
        return self.layers, self.first, self.last, self.moe_layers


def stages(model, layout, moe=None) -> list[Stage]:
    """The stages of ``layout`` with hpctrain's own split (``partition_layers``, balanced by parameters); with
    zb-v the first rank also holds the last virtual stage, the LM head (parallel/zero_bubble.py)."""
    ranges = partition_layers(model, layout.pp_size, list(layout.stage_layers) or None, moe)
    last = 0 if layout.schedule == "zb-v" else len(ranges) - 1  # zb-v's V turns back: the head is on rank 0
    routed = set(moe.layers) if moe is not None else set()
    return [Stage(i, hi - lo, i == 0, i == last, sum(1 for j in range(lo, hi) if j in routed))
            for i, (lo, hi) in enumerate(ranges)]


def stage_parameters(model, stage: Stage, tp: int, moe=None, ep: int = 1) -> int:
    """Parameters on one tp rank of ``stage``: its blocks' matrices / tp plus the replicated norm weights;
    the embedding rows / tp on the first stage; the final norm and LM head rows / tp on the last (a tied
    head is the embedding itself with one stage, a copy that is trained like a parameter with pp > 1);
    a learned position table on the first stage. ``model``'s vocabulary as given (padded by the caller).
    An MoE block holds ``arithmetic.moe_rank_parameters``: its dense part and ``num_experts / ep`` experts."""
    h, vh = model.d_model, model.vocab_size * model.d_model // tp
    n = (stage.layers - stage.moe_layers) * (block_matmul_params(model) // tp + 2 * h)
    if stage.moe_layers:
        n += stage.moe_layers * (sum(moe_rank_parameters(model, moe, tp, ep)) + 2 * h)
    if stage.first:
        n += vh + position_params(model)
    if stage.last:
        n += h + (0 if (model.tie_embeddings and stage.first) else vh)
    return n


def stage_expert_parameters(model, stage: Stage, tp: int, moe=None, ep: int = 1) -> int:
    """The part of ``stage_parameters`` that is routed experts (``num_experts / ep`` per MoE block / tp):
    reduced and sharded over the dp x cp / ep ranks that hold the same experts, not over dp x cp."""
    return stage.moe_layers * moe_rank_parameters(model, moe, tp, ep)[1] if stage.moe_layers else 0


def moe_activation_bytes(model, moe, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                         dtype_bytes: int) -> float:
    """Bytes an MoE block keeps beyond ``block_activation_bytes`` per tp rank and micro-batch (its dense MLP's
    share, ``3 f / t`` elements per token for SwiGLU, is replaced): each of the ``top_k`` routed copies of a token and each shared expert
    keeps a SwiGLU's input (``2 h``, / t with SP) and its gate, up and product (``6 f_e / t``), at 16 bits;
    plus the router's float32 logits and probabilities (``8 E`` bytes). Routing is taken as dropless and
    balanced (each rank's experts get ``top_k`` x its tokens)."""
    s, b, h, f, t = seq_len, micro_batch, model.d_model, moe.d_ff_expert, tp
    split = sequence_parallel or t == 1
    dense_mlp = (3.0 if model.mlp == "swiglu" else 2.0) * model.d_ff / t * 2  # bytes at 16 bits
    experts = (moe.top_k + moe.shared_experts) * ((2.0 * h / t if split else 2.0 * h) + 6.0 * f / t)
    return s * b * ((experts - dense_mlp) * dtype_bytes / 2 + 8.0 * moe.num_experts)


def layer_activation_bytes(model, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                           flash_attention: bool, dtype_bytes: int) -> float:
    """Bytes one block keeps for its backward, per tp rank and micro-batch, without recomputation.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2
    and 4), for 16-bit activations: ``s b h (34 + 5 a s / h) / t`` with sequence parallelism, and
    ``s b h (10 + 24 / t + 5 a s / (h t))`` without (the 10 s b h of norms, dropouts and residuals is
    then replicated over tp). ``5 a s / h`` is the attention score matrix (softmax, dropout mask and
    output): dropped with a fused (flash) attention kernel, which keeps no scores. Scaled by
    ``dtype_bytes / 2`` for other dtypes.
    """
    s, b, h, a, t = seq_len, micro_batch, model.d_model, model.n_heads, tp
    scores = 0.0 if flash_attention else 5.0 * a * s / h
    per = (34.0 + scores) / t if (sequence_parallel or t == 1) else 10.0 + (24.0 + scores) / t
    return s * b * h * per * dtype_bytes / 2


def block_activation_bytes(model, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                           flash_attention: bool, dtype_bytes: int) -> float:
    """Bytes one of hpctrain's blocks keeps for its backward, per tp rank and micro-batch, without
    recomputation: what autograd saves in hpctrain/models (measured by ``ActivationMeter``, hpctrain/profiling/
    activations.py, and held to it by tests/mpi/test_plan_activations.py), in units of ``s b h`` elements of
    ``dtype_bytes``:

    - each of the two RMSNorms: its input, the normalized input, and its output as the next linear's input
      (3); with sequence parallelism the first two are split over tp and the linear keeps the gathered output
      whole (``2 / t + 1``);
    - attention: q, k and v (k and v expanded to every head) and its output, the output projection's input
      (``4 / t``); an unfused kernel adds the scores (Korthikanti et al.'s ``5 a s / h`` bytes at 16 bits, ``/ t``);
    - the MLP: SwiGLU keeps gate(x), up(x) and their gated product (``3 f / (h t)``: models/swiglu.py recomputes
      silu(gate(x))), GELU up(x) and its activation (``2 f / (h t)``).

    Korthikanti et al. 2022 (``layer_activation_bytes``) count Megatron's GPT block: ``34 s b h / t`` bytes at
    16 bits with SP, which re-gathers a linear's input in its backward instead of keeping it.
    """
    s, b, h, t = seq_len, micro_batch, model.d_model, tp
    norms = 2 * ((2.0 / t + 1.0) if sequence_parallel and t > 1 else 3.0)
    scores = 0.0 if flash_attention else 2.5 * model.n_heads * s / h / t
    mlp = (3.0 if model.mlp == "swiglu" else 2.0) * model.d_ff / (h * t)
    return s * b * h * (norms + 4.0 / t + scores + mlp) * dtype_bytes


def deferred_weight_bytes(model, micro_batch: int, seq_len: int, tp: int, dtype_bytes: int) -> float:
    """Bytes a zero-bubble schedule keeps per block and micro-batch between its B and its W: each linear's input
    and output gradient (parallel/weight_grad.py ``WeightGradStore``), in ``s b h`` elements: the two norms'
    outputs as the linears took them (whole, gathered with SP) 2, attention's output ``1 / t``, the MLP's
    gated product (or activation) ``f / (h t)``; the gradients of q, k and v ``(1 + 2 kv / a) / t``, of the
    output and down projections' outputs (whole, before their reduction) 2, of gate and up ``2 f / (h t)``
    (GELU: up ``f / (h t)``)."""
    s, b, h, t = seq_len, micro_batch, model.d_model, tp
    f = model.d_ff / (h * t)
    inputs = 2.0 + 1.0 / t + f
    grads = (1.0 + 2.0 * model.n_kv_heads / model.n_heads) / t + 2.0 + (2.0 if model.mlp == "swiglu" else 1.0) * f
    return s * b * h * (inputs + grads) * dtype_bytes


def score_bytes(model, micro_batch: int, seq_len: int, tp: int, dtype_bytes: int) -> float:
    """The attention scores one unfused block keeps (softmax output, dropout mask and output: ``5 a s^2 b
    / t`` at 16 bits): what selective recomputation drops and recomputes (Korthikanti et al. 2022, 4.2)."""
    return 5.0 * model.n_heads * seq_len * seq_len * micro_batch / tp * dtype_bytes / 2


def recompute_layer_bytes(model, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                          dtype_bytes: int) -> float:
    """Bytes one block keeps with full recomputation: only its input ``s b h`` (``/ t`` with SP)."""
    n = seq_len * micro_batch * model.d_model * dtype_bytes
    return n / tp if sequence_parallel else float(n)


def in_flight(layout, stage: Stage, virtual_stages: int = 1) -> float:
    """Micro-batches' worth of the stage's layers whose activations ``stage`` holds at once: 1F1B
    ``min(pp - s, M)``, GPipe ``M``; interleaved 1F1B with ``V`` virtual stages of ``layers / V`` each holds
    Megatron's warm-up ``2 (pp - s - 1) + (V - 1) pp`` (micro-batch, virtual stage) units plus one, so
    ``(2 (pp - s - 1) + (V - 1) pp + 1) / V`` of the stage's layers (at most ``M``; all ``M`` when M = pp,
    whose warm-up is every forward). zb-h1 and zb-v hold a
    micro-batch from its forward until its W (the deferred weight gradients read the layers' saved inputs):
    ``min(pp, M)`` on every rank, 1F1B's first-rank peak (``zero_bubble.memory_problems`` keeps them within it)."""
    p, s, m, v = layout.pp_size, stage.index, layout.microbatches, virtual_stages
    if layout.schedule == "gpipe":
        return m
    if layout.schedule in ("zb-h1", "zb-v"):  # alive from F to W: 1F1B's first-rank peak on every rank
        return min(p, m)
    if v > 1 and p > 1:  # with M = pp every forward runs first (Megatron's rule; schedules.schedule_actions)
        return m if m == p else min((2 * (p - s - 1) + (v - 1) * p + 1) / v, m)
    return min(p - s, m)
