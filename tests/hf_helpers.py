"""Shared by tests/unit/test_hf_interop.py and tests/mpi/test_hf_training.py: small random Llama, Mistral and
Mixtral models, the hpctrain forward of global weights, and transformers made float64-exact.

transformers' Llama, Mistral and Mixtral compute RMSNorm and the rotary cos/sin in float32 whatever the model
dtype (about 1e-7 off in a float64 model), and Mixtral's router its softmax; ``float64_exact_transformers``
patches those, in float64 models only, to the same formulas in float64 (as hpctrain computes them), so float64
logits can be compared to 1e-10.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def float64_exact_transformers():
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.mistral import modeling_mistral as mm
    from transformers.models.mixtral import modeling_mixtral as mx

    classes = [(ml.LlamaRMSNorm, ml.LlamaRotaryEmbedding), (mm.MistralRMSNorm, mm.MistralRotaryEmbedding),
               (mx.MixtralRMSNorm, mx.MixtralRotaryEmbedding)]
    originals = [(n, n.forward, r, r.forward) for n, r in classes]
    router_forward = mx.MixtralTopKRouter.forward

    def router(self, hidden_states):  # MixtralTopKRouter.forward with the softmax in the model's float64
        if hidden_states.dtype != torch.float64:
            return router_forward(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, indices = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), indices

    def exact(norm_forward, rotary_forward):
        def norm(self, x):
            if x.dtype != torch.float64:
                return norm_forward(self, x)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

        def rotary(self, x, position_ids):
            if x.dtype != torch.float64:
                return rotary_forward(self, x, position_ids)
            half, theta = self.inv_freq.numel(), self.config.rope_parameters["rope_theta"]
            freqs = position_ids[..., None].double() * theta ** (-torch.arange(half, dtype=torch.float64) / half)
            angles = torch.cat((freqs, freqs), dim=-1)
            return angles.cos(), angles.sin()
        return norm, rotary

    for norm_cls, norm_forward, rotary_cls, rotary_forward in originals:
        norm_cls.forward, rotary_cls.forward = exact(norm_forward, rotary_forward)
    mx.MixtralTopKRouter.forward = router
    try:
        yield
    finally:
        for norm_cls, norm_forward, rotary_cls, rotary_forward in originals:
            norm_cls.forward, rotary_cls.forward = norm_forward, rotary_forward
        mx.MixtralTopKRouter.forward = router_forward


def random_llama(directory, *, tied=False, kv_heads=2, dtype=torch.float64, seed=0, vocab=96, **overrides):
    """A small LlamaForCausalLM with random weights of a visible size (norm weights too), saved to
    ``directory`` with save_pretrained; returns the model (eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _random_model(LlamaForCausalLM, LlamaConfig, directory, tied, kv_heads, dtype, seed, vocab, overrides)


def random_mistral(directory, *, window=8, tied=False, kv_heads=2, dtype=torch.float64, seed=0, vocab=96,
                   **overrides):
    """A small MistralForCausalLM (``sliding_window=window``; no bos/eos, so generate() never stops early),
    otherwise as ``random_llama``."""
    from transformers import MistralConfig, MistralForCausalLM

    return _random_model(MistralForCausalLM, MistralConfig, directory, tied, kv_heads, dtype, seed, vocab,
                         {"sliding_window": window, "bos_token_id": None, "eos_token_id": None, **overrides})


EAGER_EXPERTS = {"experts_implementation": "eager"}  # for from_pretrained of a float64 Mixtral


def random_mixtral(directory, *, experts=4, top_k=2, window=None, tied=False, kv_heads=2, dtype=torch.float64,
                   seed=0, vocab=96, **overrides):
    """A small MixtralForCausalLM (``experts`` per block, ``top_k`` each token, ``sliding_window=window``;
    d_model 64; no bos/eos), otherwise as ``random_llama``. Its experts run transformers' "eager" loop
    (``EAGER_EXPERTS``): the default ``grouped_mm`` has no float64 kernel."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _random_model(MixtralForCausalLM, MixtralConfig, directory, tied, kv_heads, dtype, seed, vocab,
                         {"hidden_size": 64, "num_local_experts": experts, "num_experts_per_tok": top_k,
                          "sliding_window": window, "bos_token_id": None, "eos_token_id": None,
                          **EAGER_EXPERTS, **overrides})


def _random_model(model_cls, config_cls, directory, tied, kv_heads, dtype, seed, vocab, overrides):
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_theta=500.0,
              max_position_embeddings=64)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))
    if directory is not None:
        model.save_pretrained(str(directory))
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits  # [B, S, V]


def hpctrain_logits(m, tensors: dict, ids, dtype=torch.float64, moe=None):
    """hpctrain's one-process forward with global weights ``tensors`` (hpctrain names), as [B, S, V];
    ``moe``: a resolved ``[moe]`` section (its blocks' experts are in ``tensors``)."""
    from hpctrain.models.gpt import GPTStage

    stage = GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=dtype, moe=moe).eval()
    with torch.no_grad():
        for p in stage.parameters():
            p[p.spec.valid_local()] = tensors[p.spec.name]  # the vocabulary's padding rows stay zero
        return stage(ids).permute(1, 0, 2)
