"""Hugging Face Llama <-> hpctrain: parameter names and shapes, the config translation, and reading and
writing an HF model directory (``config.json`` + ``model.safetensors``, or the sharded
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``).

hpctrain's GPT (hpctrain/models/gpt.py) with model.mlp=swiglu and model.positions=rope (the only models
export and import accept: ``require_llama``) is the Llama architecture: RMSNorm, rotary embeddings, GQA,
SwiGLU, no biases, optional tied embeddings. Weights map one to one, with the same ``[out, in]`` layout.
Rotary convention: ``rotary()`` rotates channel ``i`` of a head with channel ``i + head_dim/2`` (the two
halves) at frequency ``theta^(-2i/head_dim)``, which is exactly HF's ``rotate_half``; so q_proj/k_proj rows
need NO permutation (the permutation in HF's convert_llama_weights_to_hf.py is for Meta's original
interleaved-pair checkpoints). The logits tests (tests/unit/test_hf_interop.py) prove it to 1e-10 in float64.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from hpctrain.config import Config, ConfigError, ModelConfig, resolve_model, validate
from hpctrain.errors import HpcTrainError
from hpctrain.runtime.dtypes import torch_dtype

ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64", "BF16": "bfloat16", "F16": "float16"}
_TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older HF checkpoints stored; recomputed, not weights


class HFError(HpcTrainError, ValueError):
    """A Hugging Face model directory cannot be read, is not a supported Llama, or does not match."""

    everywhere = True  # every rank reads the same directory


def hf_name(name: str) -> str:
    """The HF Llama name of an hpctrain parameter, e.g. ``layers.3.attn.wq.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``."""
    base = name.removesuffix(".weight")
    if base in _TOP:
        return f"{_TOP[base]}.weight"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    raise HFError(f"no Hugging Face Llama name for the parameter {name!r}")


def parameter_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global parameter of the model ``m``, hpctrain name -> shape, in model order."""
    m = resolve_model(m)
    d, hd = m.d_model, m.d_model // m.n_heads
    kv = m.n_kv_heads * hd
    shapes = {"embed.weight": (m.vocab_size, d)}
    if m.positions == "learned":
        shapes["pos_embed.weight"] = (m.max_seq_len, d)
    gate = (("mlp.gate", (m.d_ff, d)),) if m.mlp == "swiglu" else ()
    for i in range(m.n_layers):
        for key, shape in (("attn_norm", (d,)), ("attn.wq", (d, d)), ("attn.wk", (kv, d)), ("attn.wv", (kv, d)),
                           ("attn.wo", (d, d)), ("mlp_norm", (d,)), *gate,
                           ("mlp.up", (m.d_ff, d)), ("mlp.down", (d, m.d_ff))):
            shapes[f"layers.{i}.{key}.weight"] = shape
    shapes["norm.weight"] = (d,)
    if not m.tie_embeddings:
        shapes["head.weight"] = (m.vocab_size, d)
    return shapes


def require_llama(m: ModelConfig, what: str) -> None:
    """HFError unless the model ``m`` is the Llama architecture (SwiGLU, rotary positions)."""
    m = resolve_model(m)
    other = [f"model.{k}={getattr(m, k)}" for k, llama in (("mlp", "swiglu"), ("positions", "rope"))
             if getattr(m, k) != llama]
    if other:
        raise HFError(f"{what}: {', '.join(other)}: Hugging Face interop is the Llama architecture only "
                      f"(model.mlp=swiglu, model.positions=rope)")


def supported_tp(m: ModelConfig) -> list[int]:
    """The tensor-parallel sizes (up to 64) that can split this model (heads, KV heads, d_ff; any vocabulary:
    it is padded, ``model.vocab_multiple``)."""
    return [t for t in range(1, 65) if not (m.n_heads % t or m.n_kv_heads % t or m.d_ff % t)]


def hf_config(m: ModelConfig, dtype: str, eos_token_id: int | None = None) -> dict:
    """A ``transformers.LlamaConfig``-compatible config.json dict of the resolved model ``m``. The rotary base
    is written both as ``rope_theta`` (transformers 4) and ``rope_parameters`` (transformers 5)."""
    require_llama(m, "export to Hugging Face")
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": m.vocab_size,
        "hidden_size": m.d_model, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.d_model // m.n_heads, "intermediate_size": m.d_ff,
        "hidden_act": "silu", "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": m.init_std, "pretraining_tp": 1, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype, "bos_token_id": None, "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }


def model_config_from_hf(d: dict, where: str = CONFIG_FILE) -> ModelConfig:
    """The hpctrain ModelConfig of an HF config.json dict; HFError for anything hpctrain's model cannot compute."""
    def bad(detail):
        return HFError(f"{where}: {detail}")

    if d.get("model_type") != "llama":
        raise bad(f"model_type {d.get('model_type')!r} is not supported: hpctrain imports the Llama architecture "
                  f"(model_type \"llama\", {ARCHITECTURE})")
    if d.get("architectures") and ARCHITECTURE not in d["architectures"]:
        raise bad(f"architectures {d['architectures']} do not include {ARCHITECTURE}")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise bad(f"{key} = true: hpctrain's Llama has no biases")
    if d.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act {d['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if d.get("rope_scaling"):
        raise bad(f"rope_scaling {d['rope_scaling']} is not supported (plain rotary embeddings only)")
    rope = d.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or set(rope) - {"rope_type", "type", "rope_theta"}:
        raise bad(f"rope_parameters {rope} are not supported (plain rotary embeddings only: rope_type \"default\")")
    if d.get("quantization_config"):
        raise bad("quantized models are not supported")
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
                        init_std=float(d.get("initializer_range", 0.02)) or 0.02)
    except KeyError as exc:
        raise bad(f"missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise bad(f"malformed value: {exc}") from None
    if d.get("head_dim") not in (None, m.d_model // m.n_heads) or m.d_model % m.n_heads:
        raise bad(f"head_dim {d.get('head_dim')} != hidden_size / num_attention_heads = {m.d_model}/{m.n_heads}: "
                  f"not supported")
    cfg = Config(model=m)
    cfg.train.seq_len = min(cfg.train.seq_len, m.max_seq_len)
    try:
        validate(cfg)
    except ConfigError as exc:
        raise bad(f"not a model hpctrain can build: {exc}") from None
    return m


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isdir(directory):
        raise HFError(f"{directory}: no such Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFError(f"{directory}: no {CONFIG_FILE}: not a Hugging Face model directory") from None
    except (OSError, ValueError) as exc:
        raise HFError(f"{path}: unreadable: {exc}") from None


class HFModelDir:
    """A Llama model directory opened for reading global tensors by hpctrain name (whole or by slices).
    The names, shapes and dtype are checked when it opens: missing, unexpected (biases, ...) or
    misshaped tensors are an HFError naming them."""

    def __init__(self, directory: str):
        self.dir = directory
        self.config = read_config(directory)
        self.model = model_config_from_hf(self.config, os.path.join(directory, CONFIG_FILE))
        self._files: dict = {}
        self._where = self._weight_map()
        self.shapes = parameter_shapes(self.model)
        wanted = {hf_name(n): n for n in self.shapes}
        unexpected = sorted(k for k in self._where if k not in wanted and not k.endswith(_IGNORED_SUFFIXES)
                            and not (k == "lm_head.weight" and self.model.tie_embeddings))
        missing = sorted(k for k in wanted if k not in self._where)
        if unexpected or missing:
            raise HFError(f"{directory}: the weights do not match a Llama of this config.json: "
                          + "; ".join(filter(None, [f"missing {missing[:6]}" if missing else "",
                                                    f"unexpected {unexpected[:6]}" if unexpected else ""])))
        dtypes = set()
        for hf, name in wanted.items():
            sl = self._slice(hf)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != self.shapes[name]:
                raise HFError(f"{directory}: {hf} has shape {shape}, config.json implies {self.shapes[name]}")
            if dtype not in _SAFETENSORS_DTYPES:
                raise HFError(f"{directory}: {hf} has dtype {dtype}: only float32/64, bfloat16, float16 are supported")
            dtypes.add(_SAFETENSORS_DTYPES[dtype])
        # mixed dtypes: one that holds every value exactly
        self.dtype = dtypes.pop() if len(dtypes) == 1 else ("float64" if "float64" in dtypes else "float32")

    def _weight_map(self) -> dict:
        single, index = os.path.join(self.dir, WEIGHTS_FILE), os.path.join(self.dir, INDEX_FILE)
        try:
            from safetensors import safe_open  # noqa: F401
        except ImportError:
            raise HFError("reading Hugging Face weights needs the `safetensors` package (pip install safetensors, "
                          "or the hpctrain[hf] extra)") from None
        if os.path.exists(single):
            return {k: single for k in self._open(single).keys()}
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise HFError(f"{index}: unreadable index ({exc})") from None
            return {k: os.path.join(self.dir, v) for k, v in weight_map.items()}
        other = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                 if os.path.exists(os.path.join(self.dir, n))]
        raise HFError(f"{self.dir}: no {WEIGHTS_FILE} (nor {INDEX_FILE})" + (
            f"; found {other[0]}: only safetensors weights are read (convert with transformers' "
            f"save_pretrained(safe_serialization=True))" if other else ""))

    def _open(self, path: str):
        if path not in self._files:
            from safetensors import safe_open

            try:
                self._files[path] = safe_open(path, framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise HFError(f"{path}: not a readable safetensors file: {exc}") from None
        return self._files[path]

    def _slice(self, hf: str):
        return self._open(self._where[hf]).get_slice(hf)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The global tensor of hpctrain parameter ``name`` (or its ``index`` slab), in the file's dtype."""
        sl = self._slice(hf_name(name))
        return (sl[index] if index is not None else sl[:]).contiguous()

    def close(self) -> None:
        self._files.clear()


def tokenizer_eos(tokenizer_json: str) -> int | None:
    """The id of ``<|endoftext|>`` (what ``hpctrain data train-tokenizer`` adds) in a tokenizer.json, else None."""
    with open(tokenizer_json, encoding="utf-8") as f:
        tok = json.load(f)
    return next((t["id"] for t in tok.get("added_tokens", []) if t.get("content") == "<|endoftext|>"), None)


def write_hf(directory: str, m: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str,
             tokenizer_json: str | None = None) -> list[str]:
    """Write config.json, model.safetensors (HF names; a tied head is not stored, as transformers does) and,
    when given, the tokenizer (tokenizer.json + a tokenizer_config.json) into ``directory``. Returns the files."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise HFError("writing Hugging Face weights needs the `safetensors` package (pip install safetensors, "
                      "or the hpctrain[hf] extra)") from None
    eos = tokenizer_eos(tokenizer_json) if tokenizer_json else None
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(hf_config(m, dtype, eos), f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({hf_name(n): t.to(torch_dtype(dtype)).contiguous() for n, t in tensors.items()},
              os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    files = [CONFIG_FILE, WEIGHTS_FILE]
    if tokenizer_json:
        shutil.copyfile(tokenizer_json, os.path.join(directory, "tokenizer.json"))
        special = {"eos_token": "<|endoftext|>"} if eos is not None else {}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": m.max_seq_len, **special},
                      f, indent=2, sort_keys=True)
            f.write("\n")
        files += ["tokenizer.json", "tokenizer_config.json"]
    return files
