"""Mistral in and out (hpctrain/interop/hf_config.py): a sliding-window hpctrain model is transformers'
MistralForCausalLM. Logits (float64, 1e-10) and greedy continuations agree on sequences longer than the
window, import -> export is bitwise, unsupported Mistral fields are one-line errors naming them. One
process, no download: models are built locally from a MistralConfig."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_helpers import float64_exact_transformers, hf_logits, hpctrain_logits, random_mistral  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MistralForCausalLM  # noqa: E402

from hpctrain.checkpoint.weights import load_model, open_checkpoint  # noqa: E402
from hpctrain.cli import dispatch  # noqa: E402
from hpctrain.config import Config, ConfigError, ModelConfig, validate  # noqa: E402
from hpctrain.errors import HpcTrainError  # noqa: E402
from hpctrain.interop.hf import HFError, HFModelDir, parameter_shapes  # noqa: E402
from hpctrain.interop.sources import check_same_model  # noqa: E402
from hpctrain.interop.staging import write_weights_only  # noqa: E402
from hpctrain.tools.generate import generate_ids  # noqa: E402

WINDOW = 8
IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 tokens: 3 windows


def hpctrain(*argv):
    return dispatch([str(a) for a in argv])


def imported(tmp_path, hf_dir):
    """Import ``hf_dir`` into ``tmp_path/ckpt``; (config, one-process model) of the checkpoint."""
    hpctrain("import-hf", hf_dir, "--out", tmp_path / "ckpt")
    reader = open_checkpoint(str(tmp_path / "ckpt"))
    try:
        return load_model(reader)
    finally:
        reader.close()


def full_causal_logits(m, directory, ids):
    """hpctrain's logits of the same weights without the window (to show the window matters)."""
    source = HFModelDir(str(directory))
    tensors = {n: source.read(n) for n in source.shapes}
    source.close()
    return hpctrain_logits(ModelConfig(**{**m.__dict__, "attention_window": 0}), tensors, ids)


def test_an_imported_mistral_gives_transformers_logits_past_the_window(tmp_path):
    hf = random_mistral(tmp_path / "hf", window=WINDOW, kv_heads=2)
    cfg, model = imported(tmp_path, tmp_path / "hf")
    assert cfg.model.attention_window == WINDOW and cfg.model.n_kv_heads == 2 and cfg.train.seq_len >= WINDOW
    assert f"attention_window = {WINDOW}" in (tmp_path / "ckpt" / "model.toml").read_text()
    with float64_exact_transformers(), torch.no_grad():
        ours, theirs = model(IDS).permute(1, 0, 2), hf_logits(hf, IDS)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
        assert (full_causal_logits(cfg.model, tmp_path / "hf", IDS) - theirs).abs().max() > 1e-2


def test_the_greedy_continuation_past_the_window_is_transformers(tmp_path):
    """5 prompt tokens + 30 greedy ones (35 > 4 windows, < max_position_embeddings): hpctrain's
    generate_ids (no cache: the whole context each step) equals transformers' generate with and without
    its KV cache (a sliding-window cache when on); the same weights without the window continue otherwise."""
    hf = random_mistral(tmp_path / "hf", window=WINDOW, kv_heads=1, seed=3)
    cfg, model = imported(tmp_path, tmp_path / "hf")
    prompt = IDS[0, :5].tolist()
    with float64_exact_transformers():
        ours = generate_ids(model, prompt, 30, cfg.model.max_seq_len, temperature=0)
        for cache in (False, True):
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, use_cache=cache)
            assert theirs[0].tolist() == ours, f"use_cache={cache}"
        hf.config.sliding_window = None  # transformers' own full-causal model of these weights
        assert hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0].tolist() != ours
    assert len(ours) == 35


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_a_windowed_run_exports_to_mistral_with_the_same_logits(tmp_path, dtype, tol):
    m = ModelConfig(preset="custom", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                    max_seq_len=64, rope_theta=500.0, norm_eps=1e-5, attention_window=WINDOW)
    g = torch.Generator().manual_seed(0)
    tensors = {n: ((1 + 0.2 * torch.randn(s, generator=g, dtype=torch.float64)) if len(s) == 1 else
                   0.3 * torch.randn(s, generator=g, dtype=torch.float64)).to(getattr(torch, dtype))
               for n, s in parameter_shapes(m).items()}
    cfg = Config(model=m)
    cfg.train.dtype = dtype
    os.makedirs(tmp_path / "ckpt")
    write_weights_only(str(tmp_path / "ckpt"), cfg, tensors, dtype, "test")
    assert hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == WINDOW and "attention_bias" not in config
    torch_dtype = getattr(torch, dtype)
    with float64_exact_transformers():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch_dtype).eval()
        assert isinstance(hf, MistralForCausalLM) and hf.config.sliding_window == WINDOW
        ours, theirs = hpctrain_logits(m, tensors, IDS, torch_dtype), hf_logits(hf, IDS)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tol * theirs.abs().max().item())


@pytest.mark.parametrize("tied", [False, True])
def test_mistral_import_export_is_bitwise(tmp_path, tied):
    random_mistral(tmp_path / "hf", window=WINDOW, tied=tied)
    hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf1")
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf1" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    theirs, ours = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", tmp_path / "hf1"))
    same = ("model_type", "architectures", "sliding_window", "hidden_size", "num_key_value_heads", "head_dim",
            "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings")
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    hpctrain("import-hf", tmp_path / "hf1", "--out", tmp_path / "ckpt2")  # and again: byte-identical files
    hpctrain("export", tmp_path / "ckpt2", "--format", "hf", "--out", tmp_path / "hf2")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_a_mistral_without_a_window_is_a_llama(tmp_path):
    """sliding_window null -> model.attention_window 0 (full causal); it exports as the Llama it computes."""
    hf = random_mistral(tmp_path / "hf", window=None)
    cfg, model = imported(tmp_path, tmp_path / "hf")
    assert cfg.model.attention_window == 0
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"
    with float64_exact_transformers(), torch.no_grad():
        llama = LlamaForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64).eval()
        theirs = hf_logits(hf, IDS)
        torch.testing.assert_close(hf_logits(llama, IDS), theirs, rtol=0, atol=1e-10)
        torch.testing.assert_close(model(IDS).permute(1, 0, 2), theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("change,message", [
    ({"sliding_window": 0}, "sliding_window 0 is not supported: a positive number of tokens or null"),
    ({"sliding_window": "8"}, "sliding_window '8' is not supported"),
    ({"sliding_window": 65}, "sliding_window=65 > max_position_embeddings=64 is not supported"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types \['full_attention', 'sliding_attention"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"head_dim": 16}, "head_dim 16 != hidden_size / num_attention_heads = 32/4"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1 is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"architectures": ["LlamaForCausalLM"]}, "do not include MistralForCausalLM"),
    ({"model_type": "mixtral"}, r"architectures \['MistralForCausalLM'\] do not include MixtralForCausalLM"),
])
def test_unsupported_mistral_fields_are_one_line_errors_naming_them(tmp_path, change, message):
    random_mistral(tmp_path / "hf", window=WINDOW)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFError, match=message) as error:
        hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    assert "\n" not in str(error.value) and str(error.value).startswith(str(path))
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing half-written


def test_the_window_is_part_of_the_model(tmp_path):
    """init_from / a weights-only resume refuse another window (the same weights, another function); a
    window longer than train.seq_len is refused in one line that says how to keep it."""
    random_mistral(tmp_path / "hf", window=WINDOW)
    source = HFModelDir(str(tmp_path / "hf"))
    source.close()
    ours = ModelConfig(**{**source.model.__dict__, "attention_window": 0})
    with pytest.raises(HpcTrainError, match=f"model.attention_window is {WINDOW} there, 0 here"):
        check_same_model(source.model, ours, "hf")
    cfg = Config(model=ModelConfig(**{**source.model.__dict__, "attention_window": 48}))
    cfg.train.seq_len = 32
    with pytest.raises(ConfigError, match="attention_window=48 is larger than the sequence train.seq_len=32: set "
                                          "train.seq_len >= 48"):
        validate(cfg)
