"""Hugging Face Llama / Mistral / Mixtral <-> hpctrain: parameter names and shapes, and reading and writing an HF
model directory (``config.json`` + ``model.safetensors``, or the sharded
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``).

hpctrain's GPT (hpctrain/models/gpt.py) with model.mlp=swiglu and model.positions=rope (the only models
export and import accept: ``require_llama``) is the Llama architecture: RMSNorm, rotary embeddings, GQA,
SwiGLU, no biases, optional tied embeddings. Weights map one to one, with the same ``[out, in]`` layout.
Rotary convention: ``rotary()`` rotates channel ``i`` of a head with channel ``i + head_dim/2`` (the two
halves) at frequency ``theta^(-2i/head_dim)``, which is exactly HF's ``rotate_half``; so q_proj/k_proj rows
need NO permutation (the permutation in HF's convert_llama_weights_to_hf.py is for Meta's original
interleaved-pair checkpoints). The logits tests (tests/unit/test_hf_interop.py) prove it to 1e-10 in float64.
Mistral has Llama's parameter names and adds a sliding window: the config.json translation is in hf_config.py.
Mixtral (a ``[moe]`` model, every block routed, no shared experts) is Mistral with the MLP replaced by
``block_sparse_moe``: the router ``gate.weight`` [E, D] is ``moe.router.weight``, and expert j's ``w1``, ``w3``,
``w2`` [F, D], [F, D], [D, F] are row j of hpctrain's stacked ``moe.experts.gate``, ``up`` [E, F, D] and
``down`` [E, D, F]. Those per-expert names are what the Hub's Mixtral files hold and what transformers 5's
``save_pretrained`` writes (its conversion mapping fuses them into ``mlp.experts.gate_up_proj`` [E, 2F, D],
gate rows first, and ``down_proj`` on load and splits them back on save); export writes them, and import reads
them or the fused module names (a ``save_file(model.state_dict())``).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

import torch

from hpctrain.config import ModelConfig, architecture, resolve_model
from hpctrain.config.moe_keys import MoeConfig, resolve_moe
from hpctrain.interop.hf_config import (CONFIG_FILE, HFError, hf_config, hf_model_configs,  # noqa: F401
                                        hf_model_type, model_config_from_hf, require_llama)
from hpctrain.runtime.dtypes import torch_dtype

WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default shard size ("5GB")
_SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64", "BF16": "bfloat16", "F16": "float16"}
_TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
_ROUTER = "moe.router"  # -> block_sparse_moe.gate
_EXPERTS = {"moe.experts.gate": "w1", "moe.experts.up": "w3", "moe.experts.down": "w2"}  # stacked over experts
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older HF checkpoints stored; recomputed, not weights


def hf_name(name: str) -> str:
    """The HF Llama name of an hpctrain parameter, e.g. ``layers.3.attn.wq.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``."""
    base = name.removesuffix(".weight")
    if base in _TOP:
        return f"{_TOP[base]}.weight"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] == _ROUTER:
        return f"model.layers.{parts[1]}.block_sparse_moe.gate.weight"
    raise HFError(f"no Hugging Face Llama name for the parameter {name!r}")


class Stored(NamedTuple):
    """Where an hpctrain parameter is in an HF file: ``keys`` (one, or one per expert, stacked along dim 0 in
    hpctrain), each of shape ``shape``; ``offset``: rows of dim 1 before it (``up`` in a fused gate_up_proj)."""
    keys: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int = 0


def stored(name: str, shape: tuple[int, ...], fused: bool = False) -> Stored:
    """The HF tensor(s) of hpctrain parameter ``name`` of global ``shape``: Mixtral's per-expert names (the
    Hub's, what export writes), or with ``fused`` transformers 5's module names (``mlp.gate``,
    ``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    layer, _, part = name.removeprefix("layers.").partition(".")
    if part not in _EXPERTS:
        key = hf_name(name)
        return Stored((key.replace(".block_sparse_moe.", ".mlp.") if fused else key,), shape)
    if not fused:
        return Stored(tuple(f"model.layers.{layer}.block_sparse_moe.experts.{j}.{_EXPERTS[part]}.weight"
                            for j in range(shape[0])), shape[1:])
    if part == "moe.experts.down":
        return Stored((f"model.layers.{layer}.mlp.experts.down_proj",), shape)
    e, f, d = shape
    return Stored((f"model.layers.{layer}.mlp.experts.gate_up_proj",), (e, 2 * f, d),
                  f if part == "moe.experts.up" else 0)


def parameter_shapes(m: ModelConfig, moe: MoeConfig | None = None) -> dict[str, tuple[int, ...]]:
    """Every global parameter of the model ``m`` (with ``moe``, a resolved ``[moe]`` section: its blocks'
    router, stacked experts and shared experts instead of the MLP), hpctrain name -> shape, in model order."""
    m = resolve_model(m)
    d, hd = m.d_model, m.d_model // m.n_heads
    kv = m.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (m.vocab_size, d)}
    if m.positions == "learned":
        shapes["pos_embed.weight"] = (m.max_seq_len, d)
    gate = (("mlp.gate.weight", (m.d_ff, d)),) if m.mlp == "swiglu" else ()
    dense = (*gate, ("mlp.up.weight", (m.d_ff, d)), ("mlp.down.weight", (d, m.d_ff)))
    routed: tuple = ()
    if moe is not None:
        e, f, shared = moe.num_experts, moe.d_ff_expert, moe.shared_experts * moe.d_ff_expert
        routed = (("moe.router.weight", (e, d)), ("moe.experts.gate", (e, f, d)), ("moe.experts.up", (e, f, d)),
                  ("moe.experts.down", (e, d, f)))
        if shared:
            routed += (("moe.shared.gate.weight", (shared, d)), ("moe.shared.up.weight", (shared, d)),
                       ("moe.shared.down.weight", (d, shared)))
    for i in range(m.n_layers):
        for key, shape in (("attn_norm.weight", (d,)), ("attn.wq.weight", (d, d)), ("attn.wk.weight", (kv, d)),
                           ("attn.wv.weight", (kv, d)), ("attn.wo.weight", (d, d)), ("mlp_norm.weight", (d,)),
                           *(routed if moe is not None and i in moe.layers else dense)):
            shapes[f"layers.{i}.{key}"] = shape
    shapes["norm.weight"] = (d,)
    if not m.tie_embeddings:
        shapes["head.weight"] = (m.vocab_size, d)
    return shapes


def supported_tp(m: ModelConfig, moe: MoeConfig | None = None) -> list[int]:
    """The tensor-parallel sizes (up to 64) that can split this model (heads, KV heads, d_ff, each expert's
    d_ff_expert; any vocabulary: it is padded, ``model.vocab_multiple``)."""
    widths = (m.n_heads, m.n_kv_heads, m.d_ff) + ((moe.d_ff_expert,) if moe is not None else ())
    return [t for t in range(1, 65) if not any(w % t for w in widths)]


def read_dir_json(directory: str, name: str, kind: str, error=None):
    """The JSON file ``name`` of the ``kind`` directory (e.g. "Hugging Face model"); ``error`` (default HFError)
    names a missing directory, a missing file or an unreadable one."""
    error = error or HFError
    path = os.path.join(directory, name)
    if not os.path.isdir(directory):
        raise error(f"{directory}: no such {kind} directory")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise error(f"{directory}: no {name}: not a {kind} directory") from None
    except (OSError, ValueError) as exc:
        raise error(f"{path}: unreadable: {exc}") from None


def read_config(directory: str) -> dict:
    return read_dir_json(directory, CONFIG_FILE, "Hugging Face model")


class HFModelDir:
    """A Llama, Mistral or Mixtral model directory opened for reading global tensors by hpctrain name (whole
    or by slices). ``model``: its ModelConfig, ``moe_section``: its ``[moe]`` (num_experts 0 but for a Mixtral),
    ``moe``: that resolved (None for a dense model).
    The names, shapes and dtype are checked when it opens: missing, unexpected (biases, ...) or misshaped
    tensors are an HFError naming them."""

    def __init__(self, directory: str):
        self.dir = directory
        self.config = read_config(directory)
        self.model, self.moe_section = hf_model_configs(self.config, os.path.join(directory, CONFIG_FILE))
        self.moe = resolve_moe(self.moe_section, self.model)
        self.architecture = architecture(self.model, self.moe_section)  # what init_from compares
        self._files: dict = {}
        self._where = self._weight_map()
        self.shapes = parameter_shapes(self.model, self.moe)
        fused = any(".mlp.experts." in k for k in self._where)  # transformers 5's module names
        self._stored = {n: stored(n, s, fused) for n, s in self.shapes.items()}
        wanted = {k: st.shape for st in self._stored.values() for k in st.keys}
        unexpected = sorted(k for k in self._where if k not in wanted and not k.endswith(_IGNORED_SUFFIXES)
                            and not (k == "lm_head.weight" and self.model.tie_embeddings))
        missing = sorted(k for k in wanted if k not in self._where)
        if unexpected or missing:
            raise HFError(f"{directory}: the weights do not match the model of this config.json: "
                          + "; ".join(filter(None, [f"missing {missing[:6]}" if missing else "",
                                                    f"unexpected {unexpected[:6]}" if unexpected else ""])))
        dtypes = set()
        for hf, implied in wanted.items():
            sl = self._slice(hf)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != implied:
                raise HFError(f"{directory}: {hf} has shape {shape}, config.json implies {implied}")
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
        if name not in self._stored:
            raise HFError(f"{self.dir}: the model of this config.json has no parameter {name!r}")
        where, shape = self._stored[name], self.shapes[name]
        index = tuple(index) if index is not None else tuple(slice(None) for _ in shape)
        if len(where.shape) < len(shape):  # one tensor per expert: the index's experts, stacked
            return torch.stack([self._slice(k)[index[1:]] for k in where.keys[index[0]]]).contiguous()
        if where.offset:  # up: the second half of dim 1 of gate_up_proj
            start, stop, _ = index[1].indices(shape[1])
            index = (index[0], slice(start + where.offset, stop + where.offset), *index[2:])
        elif where.shape != shape:  # gate: the first half
            index = (index[0], slice(*index[1].indices(shape[1])[:2]), *index[2:])
        return self._slice(where.keys[0])[index].contiguous()

    def close(self) -> None:
        self._files.clear()


def tokenizer_eos(tokenizer_json: str) -> int | None:
    """The id of ``<|endoftext|>`` (what ``hpctrain data train-tokenizer`` adds) in a tokenizer.json, else None."""
    with open(tokenizer_json, encoding="utf-8") as f:
        tok = json.load(f)
    return next((t["id"] for t in tok.get("added_tokens", []) if t.get("content") == "<|endoftext|>"), None)


def hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """hpctrain name -> global tensor as HF name -> tensor (Mixtral's experts one tensor each, the Hub's names)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return {key: tensors[name] if j is None else tensors[name][j] for key, _, name, j in hf_entries(shapes)}


def hf_entries(shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...], str, int | None]]:
    """(HF name, its shape, the hpctrain parameter it comes from, its expert index or None) for the global
    ``shapes`` of hpctrain parameters, in their order (an expert tensor gives one HF tensor per expert)."""
    entries = []
    for name, shape in shapes.items():
        where = stored(name, tuple(shape))
        split = len(where.shape) < len(shape)
        entries += [(key, tuple(where.shape), name, j if split else None) for j, key in enumerate(where.keys)]
    return entries


def write_hf(directory: str, m: ModelConfig, shapes: dict[str, tuple[int, ...]], read, dtype: str,
             tokenizer_json: str | None = None, moe: MoeConfig | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write config.json (a Mixtral with ``moe``, the resolved ``[moe]``), the weights (HF names; a tied head is
    not stored, as transformers does) and, when given, the tokenizer (tokenizer.json + a tokenizer_config.json)
    into ``directory``. ``shapes``: hpctrain parameter -> global shape; ``read(name)``: its global tensor, asked
    for one parameter at a time (the weights stream into safetensors files of at most ``max_shard_bytes``:
    ``safetensors_stream.py``), so no more than one parameter is held. Returns the files."""
    from hpctrain.interop.safetensors_stream import write_streamed

    eos = tokenizer_eos(tokenizer_json) if tokenizer_json else None
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(hf_config(m, dtype, eos, moe), f, indent=2, sort_keys=True)
        f.write("\n")
    entries = hf_entries(shapes)
    source = {key: (name, j) for key, _, name, j in entries}
    held: dict[str, torch.Tensor] = {}  # the one hpctrain parameter being written (its experts one by one)

    def produce(key: str) -> torch.Tensor:
        name, j = source[key]
        if name not in held:
            held.clear()
            held[name] = read(name)
        return held[name] if j is None else held[name][j]

    weights = write_streamed(directory, [(key, shape) for key, shape, _, _ in entries], produce, torch_dtype(dtype),
                             max_shard_bytes)
    held.clear()
    files = [CONFIG_FILE] + weights
    if tokenizer_json:
        shutil.copyfile(tokenizer_json, os.path.join(directory, "tokenizer.json"))
        special = {"eos_token": "<|endoftext|>"} if eos is not None else {}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": m.max_seq_len, **special},
                      f, indent=2, sort_keys=True)
            f.write("\n")
        files += ["tokenizer.json", "tokenizer_config.json"]
    return files
