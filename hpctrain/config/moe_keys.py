"""The mixture-of-experts keys: ``[moe]``, and how a preset fills them (``resolve_moe``).

A model with ``moe.num_experts`` > 0 replaces the MLP of the blocks ``moe.layers`` names by a routed layer of
``num_experts`` SwiGLU experts (hpctrain/models/moe.py); every other block keeps its dense MLP.
"""

import dataclasses
from dataclasses import dataclass

from hpctrain.config.keys import COUNT_MAX, SIZE_MAX, key

# Published MoE shapes (the model keys are in presets.py): Mixtral-8x7B (Jiang et al. 2024; HF
# mistralai/Mixtral-8x7B-v0.1 config.json: num_local_experts 8, num_experts_per_tok 2, intermediate_size 14336).
MOE_PRESETS: dict[str, dict] = {
    "mixtral-8x7b": dict(num_experts=8, top_k=2, d_ff_expert=14336),
}


@dataclass
class MoeConfig:
    """Mixture of experts (docs/models-and-data.md "Mixture of experts"). Off with ``num_experts`` = 0."""
    num_experts: int = key(0, min=0, max=COUNT_MAX, help=(
        "Routed experts per MoE layer. 0 = a dense model (or the preset's: 8 for `mixtral-8x7b`). Must be divisible "
        "by `parallel.ep`. An architecture key."))
    top_k: int = key(2, min=1, max=COUNT_MAX, help=(
        "Experts each token is routed to (Mixtral: 2); their softmax weights are renormalised to sum to 1 (Mixtral). "
        "At most `num_experts`. An architecture key."))
    layers: list[int] = key(factory=list, help=(
        "The blocks (0-based) whose MLP is a mixture of experts; empty = every block. An architecture key."))
    d_ff_expert: int = key(0, min=0, max=SIZE_MAX, help=(
        "Width of each expert's SwiGLU (gate, up: d_model x d_ff_expert, down: d_ff_expert x d_model); split over "
        "`parallel.tp` like the MLP. 0 = `model.d_ff`. An architecture key."))
    shared_experts: int = key(0, min=0, max=COUNT_MAX, help=(
        "Always-active experts (DeepSeek-MoE): a dense SwiGLU of width shared_experts x d_ff_expert added to the "
        "routed experts' output for every token. 0 = none. An architecture key."))
    capacity_factor: float = key(0.0, min=0, help=(
        "Expert capacity per sequence: each expert takes at most ceil(capacity_factor x seq_len x top_k / "
        "num_experts) of a sequence's token choices, the rest are dropped (that expert adds nothing to the token; "
        "the residual carries it). Choices are served first choice first, then by position, so what is dropped "
        "is the same in every layout. 0 = dropless (every choice served)."))
    aux_loss_coef: float = key(0.01, min=0, help=(
        "Load-balancing loss weight (Switch, Mixtral: num_experts x sum_e f_e P_e, f_e the fraction of a sequence's "
        "tokens routed to expert e, P_e its mean router probability), per MoE layer and per sequence, added to the "
        "loss as the token loss is (weighted by the sequence's tokens, divided by the step's counted tokens). "
        "Reported as `moe_aux_loss` (unweighted, summed over layers). 0 = off."))
    z_loss_coef: float = key(0.0, min=0, help=(
        "Router z-loss weight (ST-MoE): the mean over tokens of logsumexp(router logits)^2 per MoE layer, added "
        "like the token loss. Reported as `moe_z_loss`. 0 = off."))


# The keys that change the function (and weights) of a MoE model: two configs that agree on them hold
# interchangeable weights. capacity_factor and the loss weights change training, not the weights.
MOE_ARCHITECTURE_KEYS = ("num_experts", "top_k", "layers", "d_ff_expert", "shared_experts")


def resolve_moe(moe: "MoeConfig | None", m) -> "MoeConfig | None":
    """The ``[moe]`` section with the preset's values filled in (``m``: the resolved model, whose ``preset``
    names the shape), ``d_ff_expert`` 0 -> ``m.d_ff`` and ``layers`` [] -> every block; None for a dense model."""
    if moe is None:
        return None
    preset = MOE_PRESETS.get(getattr(m, "preset", ""), {})
    filled = {k: v for k, v in preset.items() if getattr(moe, k) == getattr(MoeConfig(), k)}
    r = dataclasses.replace(moe, **filled)
    if r.num_experts == 0:
        return None
    return dataclasses.replace(r, d_ff_expert=r.d_ff_expert or m.d_ff,
                               layers=sorted(r.layers) if r.layers else list(range(m.n_layers)))


def moe_architecture(moe: "MoeConfig | None") -> dict:
    """{key: value} of a resolved ``[moe]`` section's architecture keys; {} for a dense model."""
    if moe is None:
        return {}
    return {f"moe.{k}": getattr(moe, k) for k in MOE_ARCHITECTURE_KEYS}
