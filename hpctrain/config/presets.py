"""Named model shapes: the published models (GPT-2, GPT-3, Megatron-LM's PTD-P GPTs, Llama 2, Llama 3) and two
small ones for demos and tests. Pure data; ``resolve_model`` (``validation.py``) applies them.

Each preset's source and published parameter count are listed (and checked within 1% against
``count_parameters``) in tests/unit/test_presets.py; docs/models-and-data.md has the table.
"""
from __future__ import annotations

# Published model shapes; the named source of each, and its parameter count, are in tests/unit/test_presets.py.
# GPT-2 (OpenAI / HF `gpt2*` configs) and GPT-3 (Brown et al. 2020, Table 2.1): (d_model, n_layers, n_heads,
# max_seq_len); GELU MLP of d_ff = 4 * d_model, learned positions, tied embeddings, vocabulary 50257.
_GPT_SHAPES = {
    "gpt2-small": (768, 12, 12, 1024), "gpt2-medium": (1024, 24, 16, 1024),
    "gpt2-large": (1280, 36, 20, 1024), "gpt2-xl": (1600, 48, 25, 1024),
    "gpt3-2.7b": (2560, 32, 32, 2048), "gpt3-6.7b": (4096, 32, 32, 2048),
    "gpt3-13b": (5120, 40, 40, 2048), "gpt3-175b": (12288, 96, 96, 2048),
}
# gpt3-13b: the paper's d_model 5140 is not its 40 heads x d_head 128 = 5120; we keep 5120 (40 heads of 128)
# and the paper's MLP width 4 x 5140 = 20560, which puts the count 0.5% under the paper's shape (12.88B).
_D_FF = {"gpt3-13b": 4 * 5140}
# Megatron-LM PTD-P weak-scaling models (Narayanan et al., SC21, Table 1; NVIDIA/Megatron-LM
# examples/sc21/run_table_1.sh): (d_model, n_layers, n_heads); Megatron's GPT: GELU MLP of 4 * d_model,
# learned positions, tied embeddings, vocabulary 51200, sequence 2048.
_PTDP_SHAPES = {
    "gpt-1.7b": (2304, 24, 24), "gpt-3.6b": (3072, 30, 32), "gpt-7.5b": (4096, 36, 32),
    "gpt-18b": (6144, 40, 48), "gpt-39b": (8192, 48, 64), "gpt-76b": (10240, 60, 80),
    "gpt-145b": (12288, 80, 96), "gpt-310b": (16384, 96, 128), "gpt-530b": (20480, 105, 128),
    "gpt-1t": (25600, 128, 160),
}
# Llama 2 (Touvron et al. 2023; HF meta-llama/Llama-2-*-hf) and Llama 3 (Meta 2024; HF meta-llama/Meta-Llama-3-8B,
# -70B and Llama-3.1-405B): (vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, rope_theta, max_seq_len);
# SwiGLU, rotary positions, untied. llama-3-405b keeps the 8192 pre-training context (Llama 3.1 extends it to
# 131072 with rope scaling, which hpctrain does not implement).
_LLAMA_SHAPES = {
    "llama-2-7b": (32000, 4096, 32, 32, 32, 11008, 10000.0, 4096),
    "llama-2-13b": (32000, 5120, 40, 40, 40, 13824, 10000.0, 4096),
    "llama-2-70b": (32000, 8192, 80, 64, 8, 28672, 10000.0, 4096),
    "llama-3-8b": (128256, 4096, 32, 32, 8, 14336, 500000.0, 8192),
    "llama-3-70b": (128256, 8192, 80, 64, 8, 28672, 500000.0, 8192),
    "llama-3-405b": (128256, 16384, 126, 128, 8, 53248, 500000.0, 8192),
    # Mixtral-8x7B (Jiang et al. 2024; HF mistralai/Mixtral-8x7B-v0.1 config.json): its experts are [moe] keys
    # (moe_keys.MOE_PRESETS); d_ff is each expert's width. rope_theta 1e6, 32768 positions, no sliding window.
    "mixtral-8x7b": (32000, 4096, 32, 32, 8, 14336, 1000000.0, 32768),
}
# What a key left unset (0, "auto", None) takes when its preset does not give it; "custom" takes these
# and nothing else (its sizes have no default: custom gives every one).
MODEL_DEFAULTS: dict = dict(vocab_size=256, tie_embeddings=False, rope_theta=10000.0, mlp="swiglu", positions="rope")
_GPT = dict(tie_embeddings=True, mlp="gelu", positions="learned")

# Model shapes by preset name (read-only by convention): every key the preset gives fills that key of a
# ModelConfig left unset (sizes and rope_theta at 0, mlp/positions "auto", tie_embeddings None).
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=256),
    "small": dict(vocab_size=256, d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=1024, max_seq_len=512),
    **{name: dict(vocab_size=50257, d_model=d, n_layers=n, n_heads=h, n_kv_heads=h, d_ff=_D_FF.get(name, 4 * d),
                  max_seq_len=s, **_GPT) for name, (d, n, h, s) in _GPT_SHAPES.items()},
    **{name: dict(vocab_size=51200, d_model=d, n_layers=n, n_heads=h, n_kv_heads=h, d_ff=4 * d, max_seq_len=2048,
                  **_GPT) for name, (d, n, h) in _PTDP_SHAPES.items()},
    **{name: dict(vocab_size=v, d_model=d, n_layers=n, n_heads=h, n_kv_heads=kv, d_ff=ff, max_seq_len=s,
                  rope_theta=theta, tie_embeddings=False, mlp="swiglu", positions="rope")
       for name, (v, d, n, h, kv, ff, theta, s) in _LLAMA_SHAPES.items()},
}
# The keys a preset (or MODEL_DEFAULTS) may fill.
PRESET_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "tie_embeddings",
               "rope_theta", "mlp", "positions")
