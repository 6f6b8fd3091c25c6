"""The config.json translation between Hugging Face Llama / Mistral / Mixtral and hpctrain's ModelConfig (and
``[moe]`` section).

Mistral (``model_type: "mistral"``, ``MistralForCausalLM``) is Llama plus ``sliding_window``, which is
hpctrain's ``model.attention_window`` (``sliding_window: null`` -> 0, full causal). The two windows mean
the same thing: transformers 5's mask (``masking_utils.sliding_window_causal_mask_function``) lets query
``q`` see key ``kv`` when ``q - sliding_window < kv <= q``, and hpctrain's window W lets token t attend
t-W+1..t; both are W keys, the token itself included (``causal_window_mask``,
hpctrain/parallel/context_parallel.py). Export writes a Mistral when ``model.attention_window > 0`` and a
Llama otherwise, so import -> export gives back the same config.json and weights.
Mixtral (``model_type: "mixtral"``, ``MixtralForCausalLM``) is Mistral (``sliding_window`` null or a window)
with every MLP a mixture of experts: ``num_local_experts`` -> ``moe.num_experts``, ``num_experts_per_tok`` ->
``moe.top_k``, ``intermediate_size`` -> ``moe.d_ff_expert`` (and ``model.d_ff``), ``router_aux_loss_coef`` ->
``moe.aux_loss_coef`` (training only). Its routing (softmax over all experts, top k, renormalised) is
hpctrain's, dropless (``moe.capacity_factor`` 0). A ``[moe]`` model exports as a Mixtral when every block is
routed and it has no shared experts.
Everything else hpctrain's model cannot compute (rope scaling, biases, another head_dim, per-layer
attention kinds, dropout, ...) is refused in one line naming the config.json field.
"""
from __future__ import annotations

from hpctrain.config import Config, ConfigError, ModelConfig, resolve_model, validate
from hpctrain.config.moe_keys import MoeConfig
from hpctrain.errors import HpcTrainError

LLAMA, MISTRAL, MIXTRAL = "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"
ARCHITECTURES = {"llama": LLAMA, "mistral": MISTRAL, "mixtral": MIXTRAL}  # model_type -> the transformers class
# Fields of other MoE families' configs (Qwen2-MoE's shared expert, DeepSeek's, dense blocks): not Mixtral's
_FOREIGN_MOE = ("shared_expert_intermediate_size", "n_shared_experts", "moe_intermediate_size", "mlp_only_layers",
                "first_k_dense_replace")
CONFIG_FILE = "config.json"
DEFAULT_SEQ_LEN = Config().train.seq_len


class HFError(HpcTrainError, ValueError):
    """A Hugging Face model directory cannot be read, is not a supported Llama, or does not match."""

    everywhere = True  # every rank reads the same directory


def require_llama(m: ModelConfig, what: str, moe: MoeConfig | None = None) -> None:
    """HFError unless the model ``m`` is the Llama architecture (SwiGLU, rotary positions) and its resolved
    ``[moe]`` section (None: dense) Mixtral's (every block routed, no shared experts)."""
    m = resolve_model(m)
    other = [f"model.{k}={getattr(m, k)}" for k, llama in (("mlp", "swiglu"), ("positions", "rope"))
             if getattr(m, k) != llama]
    if other:
        raise HFError(f"{what}: {', '.join(other)}: Hugging Face interop is the Llama architecture only "
                      f"(model.mlp=swiglu, model.positions=rope)")
    if moe is not None and moe.layers != list(range(m.n_layers)):
        raise HFError(f"{what}: moe.layers={moe.layers}: a Hugging Face Mixtral routes every block (moe.layers "
                      f"empty); a model with dense blocks has no Hugging Face form")
    if moe is not None and moe.shared_experts:
        raise HFError(f"{what}: moe.shared_experts={moe.shared_experts}: a Hugging Face Mixtral has no shared "
                      f"experts")


def hf_model_type(m: ModelConfig, moe: MoeConfig | None = None) -> str:
    """``mixtral`` for a model with experts (``moe``: its resolved ``[moe]``), ``mistral`` for a sliding-window
    model (``model.attention_window`` > 0), else ``llama``."""
    return "mixtral" if moe is not None else "mistral" if resolve_model(m).attention_window > 0 else "llama"


def hf_config(m: ModelConfig, dtype: str, eos_token_id: int | None = None, moe: MoeConfig | None = None) -> dict:
    """A ``transformers.LlamaConfig`` (or, with a sliding window, ``MistralConfig``; with ``moe``, the resolved
    ``[moe]``, ``MixtralConfig``) config.json dict of the resolved model ``m``. The rotary base is written
    both as ``rope_theta`` (transformers 4) and ``rope_parameters`` (transformers 5)."""
    require_llama(m, "export to Hugging Face", moe)
    m = resolve_model(m)
    model_type = hf_model_type(m, moe)
    config = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": m.vocab_size,
        "hidden_size": m.d_model, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.d_model // m.n_heads,
        "intermediate_size": moe.d_ff_expert if moe is not None else m.d_ff,
        "hidden_act": "silu", "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0, "initializer_range": m.init_std,
        "use_cache": True, "torch_dtype": dtype, "dtype": dtype, "bos_token_id": None,
        "eos_token_id": eos_token_id, "pad_token_id": None,
    }
    if model_type == "mistral":  # MistralConfig has no bias / pretraining_tp fields
        config["sliding_window"] = m.attention_window
    elif moe is not None:  # MixtralConfig: no bias fields either; no window is null
        config.update(sliding_window=m.attention_window or None, num_local_experts=moe.num_experts,
                      num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef,
                      router_jitter_noise=0.0, output_router_logits=False)
    else:
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return config


def import_seq_len(m: ModelConfig) -> int:
    """The ``train.seq_len`` an imported model's checkpoint config records: hpctrain's default, raised to the
    sliding window (``model.attention_window`` <= ``train.seq_len``), at most ``model.max_seq_len``."""
    return min(max(DEFAULT_SEQ_LEN, m.attention_window), m.max_seq_len)


def _sliding_window(d: dict, model_type: str, bad) -> int:
    """``model.attention_window`` of a config.json: Mistral's or Mixtral's ``sliding_window`` (null -> 0);
    Llama: 0."""
    if model_type == "llama":
        return 0
    window = d.get("sliding_window")
    if window is None:
        return 0
    if type(window) is not int or window < 1:
        raise bad(f"sliding_window {window!r} is not supported: a positive number of tokens or null")
    kinds = set(d.get("layer_types") or ())
    if kinds - {"sliding_attention"}:  # transformers' MistralModel ignores layer_types, its generate() does not
        raise bad(f"layer_types {sorted(kinds)} is not supported: hpctrain applies sliding_window={window} to "
                  f"every layer (per-layer attention kinds are Ministral's, not Mistral's)")
    where = d.get("max_position_embeddings")
    if isinstance(where, int) and window > where:
        raise bad(f"sliding_window={window} > max_position_embeddings={where} is not supported: hpctrain trains "
                  f"at most model.max_seq_len tokens, and model.attention_window must fit train.seq_len")
    return window


def _refuse_unsupported(d: dict, model_type: str, bad) -> dict:
    """HFError for the first field hpctrain cannot compute; returns ``rope_parameters``."""
    if d.get("architectures") and ARCHITECTURES[model_type] not in d["architectures"]:
        raise bad(f"architectures {d['architectures']} do not include {ARCHITECTURES[model_type]}")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise bad(f"{key} = true: hpctrain's Llama has no biases")
    if d.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act {d['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if d.get("attention_dropout"):
        raise bad(f"attention_dropout = {d['attention_dropout']} is not supported: hpctrain trains without dropout")
    if d.get("rope_scaling"):
        raise bad(f"rope_scaling {d['rope_scaling']} is not supported (plain rotary embeddings only)")
    rope = d.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or set(rope) - {"rope_type", "type", "rope_theta"}:
        raise bad(f"rope_parameters {rope} are not supported (plain rotary embeddings only: rope_type \"default\")")
    if d.get("quantization_config"):
        raise bad("quantized models are not supported")
    for key in _FOREIGN_MOE:
        if d.get(key):
            raise bad(f"{key} = {d[key]!r} is not supported: another mixture of experts than Mixtral's (hpctrain "
                      f"imports Mixtral: every block routed, no shared experts)")
    if model_type == "mixtral" and d.get("router_jitter_noise"):
        raise bad(f"router_jitter_noise = {d['router_jitter_noise']} is not supported: hpctrain's router has no "
                  f"jitter noise")
    if model_type == "mixtral" and d.get("norm_topk_prob") is False:
        raise bad("norm_topk_prob = false is not supported: hpctrain renormalises the top-k weights (Mixtral)")
    return rope


def model_config_from_hf(d: dict, where: str = CONFIG_FILE) -> ModelConfig:
    """The hpctrain ModelConfig of an HF config.json dict (``hf_model_configs``)."""
    return hf_model_configs(d, where)[0]


def _moe_config(d: dict) -> MoeConfig:
    """The ``[moe]`` section of a Mixtral config.json (MixtralConfig's defaults for absent fields)."""
    return MoeConfig(num_experts=int(d.get("num_local_experts", d.get("num_experts", 8))),
                     top_k=int(d.get("num_experts_per_tok", 2)), d_ff_expert=int(d["intermediate_size"]),
                     aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)))


def hf_model_configs(d: dict, where: str = CONFIG_FILE) -> tuple[ModelConfig, MoeConfig]:
    """(ModelConfig, ``[moe]`` section: num_experts 0 but for a Mixtral) of an HF config.json dict (Llama,
    Mistral or Mixtral); HFError naming the field for anything hpctrain's model cannot compute."""
    def bad(detail):
        return HFError(f"{where}: {detail}")

    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise bad(f"model_type {model_type!r} is not supported: hpctrain imports the Llama architecture "
                  f"(model_type \"llama\", {LLAMA}; \"mistral\", {MISTRAL}: Llama with a sliding window; "
                  f"\"mixtral\", {MIXTRAL}: Mistral with a mixture of experts)")
    rope = _refuse_unsupported(d, model_type, bad)
    try:
        heads = int(d["num_attention_heads"])
        m = ModelConfig(preset="custom", mlp="swiglu", positions="rope", vocab_size=int(d["vocab_size"]),
                        d_model=int(d["hidden_size"]),
                        n_layers=int(d["num_hidden_layers"]), n_heads=heads,
                        n_kv_heads=int(d.get("num_key_value_heads") or heads), d_ff=int(d["intermediate_size"]),
                        max_seq_len=int(d.get("max_position_embeddings", 2048)),
                        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                        init_std=float(d.get("initializer_range", 0.02)) or 0.02,
                        attention_window=_sliding_window(d, model_type, bad))
        moe = _moe_config(d) if model_type == "mixtral" else MoeConfig()
    except HFError:
        raise  # a field named by _sliding_window
    except KeyError as exc:
        raise bad(f"missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise bad(f"malformed value: {exc}") from None
    if model_type == "mixtral" and moe.num_experts < 1:
        raise bad(f"num_local_experts = {moe.num_experts}: a Mixtral needs at least one expert")
    if d.get("head_dim") not in (None, m.d_model // m.n_heads) or m.d_model % m.n_heads:
        raise bad(f"head_dim {d.get('head_dim')} != hidden_size / num_attention_heads = {m.d_model}/{m.n_heads}: "
                  f"not supported")
    cfg = Config(model=m, moe=moe)
    cfg.train.seq_len = import_seq_len(m)
    try:
        validate(cfg)
    except ConfigError as exc:
        raise bad(f"not a model hpctrain can build: {exc}") from None
    return m, moe
