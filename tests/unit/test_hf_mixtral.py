"""Mixtral in and out (hpctrain/interop/hf.py, hf_config.py): an hpctrain model with ``[moe]`` experts in every
block is transformers' MixtralForCausalLM. Logits (float64, 1e-10) and greedy continuations agree, import ->
export is bitwise both ways, transformers 5's fused expert names read too, unsupported fields are one-line
errors (exit 2) naming them. One process, no download: models are built locally from a MixtralConfig."""
import json
import os
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_helpers import (EAGER_EXPERTS, float64_exact_transformers, hf_logits, hpctrain_logits,  # noqa: E402
                        random_mixtral)
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, MixtralForCausalLM  # noqa: E402

from hpctrain.checkpoint.weights import load_model, open_checkpoint  # noqa: E402
from hpctrain.cli import dispatch  # noqa: E402
from hpctrain.config import Config, ModelConfig, architecture  # noqa: E402
from hpctrain.config.moe_keys import MoeConfig, resolve_moe  # noqa: E402
from hpctrain.errors import HpcTrainError  # noqa: E402
from hpctrain.interop.hf import HFError, HFModelDir, hf_tensors, parameter_shapes, stored, supported_tp  # noqa: E402
from hpctrain.interop.sources import check_same_model, open_source  # noqa: E402
from hpctrain.interop.staging import write_weights_only  # noqa: E402
from hpctrain.models.gpt import GPTStage  # noqa: E402
from hpctrain.runtime.errors_exit import run_and_exit  # noqa: E402
from hpctrain.tools.generate import generate_ids  # noqa: E402

IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
DTYPES = {"float64": (torch.float64, 1e-10), "float32": (torch.float32, 1e-5)}


def hpctrain(*argv):
    return dispatch([str(a) for a in argv])


def model_cfg(tied=False, window=0):
    return ModelConfig(preset="custom", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                       max_seq_len=64, tie_embeddings=tied, rope_theta=500.0, norm_eps=1e-5, attention_window=window)


def moe_cfg(**kw):
    return MoeConfig(**{"num_experts": 4, "top_k": 2, **kw})


def random_checkpoint(directory, m, moe, dtype="float64", seed=0):
    """A one-process hpctrain checkpoint (weights only) of random global weights of ``m`` with ``[moe]``
    ``moe``; returns the weights."""
    g = torch.Generator().manual_seed(seed)
    shapes = parameter_shapes(m, resolve_moe(moe, m))
    tensors = {n: ((1 + 0.2 * torch.randn(s, generator=g, dtype=torch.float64)) if len(s) == 1 else
                   0.3 * torch.randn(s, generator=g, dtype=torch.float64)).to(getattr(torch, dtype))
               for n, s in shapes.items()}
    cfg = Config(model=m, moe=moe)
    cfg.train.dtype = dtype
    os.makedirs(directory)
    write_weights_only(str(directory), cfg, tensors, dtype, "test")
    return tensors


def imported(tmp_path, hf_dir, out="ckpt"):
    """Import ``hf_dir`` into ``tmp_path/out``; (config, one-process model) of the checkpoint."""
    hpctrain("import-hf", hf_dir, "--out", tmp_path / out)
    reader = open_checkpoint(str(tmp_path / out))
    try:
        return load_model(reader)
    finally:
        reader.close()


def checkpoint_tensors(path) -> dict:
    reader = open_checkpoint(str(path))
    try:
        return {n.removeprefix("model/"): torch.from_numpy(reader.file[n][()]) for n in reader.datasets("model")}
    finally:
        reader.close()


def test_names_and_shapes_match_the_model_and_transformers(tmp_path):
    """parameter_shapes = GPTStage's parameters; the HF names are what save_pretrained writes (per expert:
    the Hub's), and with ``fused`` transformers 5's module names (gate_up_proj [E, 2F, D], gate rows first)."""
    m, moe = model_cfg(), resolve_moe(moe_cfg(), model_cfg())
    stage = GPTStage(m, (0, 2), is_first=True, is_last=True, moe=moe)
    shapes = parameter_shapes(m, moe)
    assert {p.spec.name: p.spec.global_shape for p in stage.parameters()} == shapes
    assert shapes["layers.1.moe.experts.gate"] == (4, 48, 64) and shapes["layers.1.moe.experts.down"] == (4, 64, 48)
    assert not any(".mlp." in n for n in shapes) and shapes["layers.0.mlp_norm.weight"] == (64,)
    hf = random_mixtral(tmp_path / "hf")
    on_disk = load_file(tmp_path / "hf" / "model.safetensors")
    ours = hf_tensors({n: torch.zeros(s) for n, s in shapes.items()})
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in on_disk.items()}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in on_disk
    fused = {k for n, s in shapes.items() for k in stored(n, s, fused=True).keys}
    assert fused == set(hf.state_dict())
    assert stored("layers.0.moe.experts.up", (4, 48, 64), fused=True).offset == 48
    six_heads = ModelConfig(**{**m.__dict__, "n_heads": 6, "n_kv_heads": 3, "d_model": 48})  # d_ff 48
    assert supported_tp(m, moe) == [1, 2] and 3 in supported_tp(six_heads, resolve_moe(moe_cfg(), six_heads))
    assert 3 not in supported_tp(six_heads, resolve_moe(moe_cfg(d_ff_expert=40), six_heads))  # the experts' width


@pytest.mark.parametrize("window,kv,top_k", [(None, 2, 2), (8, 1, 2), (None, 4, 1)])
def test_an_imported_mixtral_gives_transformers_logits(tmp_path, window, kv, top_k):
    hf = random_mixtral(tmp_path / "hf", window=window, kv_heads=kv, top_k=top_k)
    cfg, model = imported(tmp_path, tmp_path / "hf")
    assert cfg.train.dtype == "float64" and cfg.model.attention_window == (window or 0)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.d_ff_expert, cfg.moe.layers) == (4, top_k, 48, [])
    assert cfg.moe.capacity_factor == 0 and cfg.moe.aux_loss_coef == hf.config.router_aux_loss_coef
    toml = (tmp_path / "ckpt" / "model.toml").read_text()
    assert "[moe]\nnum_experts = 4\n" in toml and f"top_k = {top_k}\n" in toml
    with float64_exact_transformers(), torch.no_grad():
        ours, theirs = model(IDS).permute(1, 0, 2), hf_logits(hf, IDS)
        assert theirs.abs().max() > 1
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_a_wrong_expert_mapping_would_be_noticed(tmp_path):
    """The logits test above sees a swapped w1/w3 (gate/up), a permuted expert order or unrenormalised
    top-k weights: each changes the logits far beyond 1e-10."""
    hf = random_mixtral(tmp_path / "hf")
    source = HFModelDir(str(tmp_path / "hf"))
    tensors = {n: source.read(n) for n in source.shapes}
    source.close()
    m, moe = source.model, source.moe
    swapped = {**tensors, "layers.0.moe.experts.gate": tensors["layers.0.moe.experts.up"],
               "layers.0.moe.experts.up": tensors["layers.0.moe.experts.gate"]}
    permuted = {n: t[[1, 0, 2, 3]] if n.startswith("layers.1.moe.experts.") else t for n, t in tensors.items()}
    with float64_exact_transformers():
        theirs = hf_logits(hf, IDS)
        assert (hpctrain_logits(m, tensors, IDS, moe=moe) - theirs).abs().max() < 1e-10
        for wrong in (swapped, permuted):
            assert (hpctrain_logits(m, wrong, IDS, moe=moe) - theirs).abs().max() > 1e-3


def test_the_greedy_continuation_is_transformers(tmp_path):
    """5 prompt tokens + 30 greedy ones past an 8-token window: hpctrain's generate_ids equals transformers'
    generate with and without its KV cache."""
    hf = random_mixtral(tmp_path / "hf", window=8, seed=3)
    cfg, model = imported(tmp_path, tmp_path / "hf")
    prompt = IDS[0, :5].tolist()
    with float64_exact_transformers():
        ours = generate_ids(model, prompt, 30, cfg.model.max_seq_len, temperature=0)
        for cache in (False, True):
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, use_cache=cache)
            assert theirs[0].tolist() == ours, f"use_cache={cache}"
    assert len(ours) == 35 and len(set(ours[5:])) > 3


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tied,window", [(False, 0), (True, 8)])
def test_an_exported_moe_run_loads_in_transformers_with_the_same_logits(tmp_path, dtype, tied, window):
    """float32 with transformers' default experts kernel (grouped_mm); float64 with its eager loop."""
    torch_dtype, tol = DTYPES[dtype]
    m, moe = model_cfg(tied, window), moe_cfg(aux_loss_coef=0.02)
    tensors = random_checkpoint(tmp_path / "ckpt", m, moe, dtype)
    assert hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 48)
    assert config["router_aux_loss_coef"] == 0.02 and config["sliding_window"] == (window or None)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    kw = EAGER_EXPERTS if dtype == "float64" else {}
    with float64_exact_transformers():
        hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch_dtype,
                                                        output_loading_info=True, **kw)
        assert isinstance(hf, MixtralForCausalLM) and not any(info.values()), info  # nothing missing/unexpected
        hf.eval()
        ours, theirs = hpctrain_logits(m, tensors, IDS, torch_dtype, resolve_moe(moe, m)), hf_logits(hf, IDS)
    assert theirs.dtype == torch_dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tol * theirs.abs().max().item())


def test_hpctrain_to_hf_to_hpctrain_is_bitwise(tmp_path):
    m, moe = model_cfg(), moe_cfg()
    tensors = random_checkpoint(tmp_path / "ckpt", m, moe)
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf")
    cfg, _ = imported(tmp_path, tmp_path / "hf", "back")
    assert architecture(cfg.model, cfg.moe) == architecture(m, moe)
    back = checkpoint_tensors(tmp_path / "back")
    assert back.keys() == tensors.keys() and all(torch.equal(back[n], tensors[n]) for n in tensors)


def test_mixtral_import_export_is_bitwise(tmp_path):
    random_mixtral(tmp_path / "hf", window=8, tied=True)
    hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf1")
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf1" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    theirs, ours = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", tmp_path / "hf1"))
    same = ("model_type", "architectures", "sliding_window", "hidden_size", "num_key_value_heads", "intermediate_size",
            "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings")
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    hpctrain("import-hf", tmp_path / "hf1", "--out", tmp_path / "ckpt2")  # and again: byte-identical files
    hpctrain("export", tmp_path / "ckpt2", "--format", "hf", "--out", tmp_path / "hf2")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_fused_expert_names_and_slabs_read_the_same(tmp_path):
    """A file of transformers 5's module names (save_file(model.state_dict()): gate_up_proj, down_proj,
    mlp.gate) and a sharded one import to the same tensors; any slab (ep: some experts, tp: some rows) of
    each, or of the imported checkpoint, is that slab of the whole tensor."""
    hf = random_mixtral(tmp_path / "hf")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) > 20
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "fused" / "model.safetensors",
              metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    sources = [open_source(str(tmp_path / d)) for d in ("hf", "fused", "sharded", "ckpt")]
    try:
        assert [type(s).__name__ for s in sources] == ["HFModelDir"] * 3 + ["CheckpointSource"]
        assert all(s.moe == sources[0].moe and s.shapes == sources[0].shapes for s in sources)
        for name in sources[0].shapes:
            whole = sources[0].read(name)
            assert all(torch.equal(s.read(name), whole) for s in sources[1:]), name
        for name, index in (("layers.1.moe.experts.gate", (slice(1, 3), slice(24, 48), slice(None))),
                            ("layers.1.moe.experts.up", (slice(2, 3), slice(0, 24), slice(None))),
                            ("layers.0.moe.experts.down", (slice(0, 2), slice(None), slice(8, 32))),
                            ("layers.0.moe.router.weight", (slice(None), slice(None)))):
            whole = sources[0].read(name)
            assert all(torch.equal(s.read(name, index), whole[index]) for s in sources), name
        with pytest.raises(HFError, match="has no parameter 'layers.0.mlp.gate.weight'"):
            sources[0].read("layers.0.mlp.gate.weight")
    finally:
        for s in sources:
            s.close()


def _edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("change,message", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1 is not supported"),
    ({"shared_expert_intermediate_size": 96}, "shared_expert_intermediate_size = 96 is not supported"),
    ({"norm_topk_prob": False}, "norm_topk_prob = false is not supported"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported"),
    ({"architectures": ["MistralForCausalLM"]}, "do not include MixtralForCausalLM"),
    ({"num_experts_per_tok": 5}, "moe.top_k.*5 exceeds moe.num_experts=4"),
    ({"num_local_experts": 0}, "num_local_experts = 0: a Mixtral needs at least one expert"),
    ({"num_local_experts": 3}, r"unexpected \[.model.layers.0.block_sparse_moe.experts.3.w1.weight"),
    ({"num_local_experts": 5}, r"missing \[.model.layers.0.block_sparse_moe.experts.4.w1.weight"),
    ({"intermediate_size": 40}, r"experts.0.w1.weight has shape \(48, 64\), config.json implies \(40, 64\)"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}}, "rope_parameters"),
])
def test_unsupported_mixtral_fields_are_one_line_errors_naming_them(tmp_path, capsys, change, message):
    random_mixtral(tmp_path / "hf")
    _edit_config(tmp_path / "hf", **change)
    with pytest.raises(HFError, match=message) as error:
        hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    assert "\n" not in str(error.value) and str(error.value).startswith(str(tmp_path / "hf"))
    assert str(error.value).count(str(tmp_path)) == 1 and "malformed" not in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing half-written
    capsys.readouterr()
    assert run_and_exit(dispatch, ["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpctrain: error: ")


def test_output_router_logits_is_fine(tmp_path):
    hf = random_mixtral(tmp_path / "hf", output_router_logits=True, router_aux_loss_coef=0.05)
    cfg, model = imported(tmp_path, tmp_path / "hf")
    assert cfg.moe.aux_loss_coef == 0.05
    with float64_exact_transformers(), torch.no_grad():
        torch.testing.assert_close(model(IDS).permute(1, 0, 2), hf_logits(hf, IDS), rtol=0, atol=1e-10)


@pytest.mark.parametrize("moe,named", [
    (dict(layers=[1]), "moe.layers=[1]: a Hugging Face Mixtral routes every block"),
    (dict(shared_experts=1), "moe.shared_experts=1: a Hugging Face Mixtral has no shared experts"),
])
def test_a_moe_model_that_is_no_mixtral_is_refused_by_export(tmp_path, moe, named):
    random_checkpoint(tmp_path / "ckpt", model_cfg(), moe_cfg(**moe))
    with pytest.raises(HFError, match=re.escape(named)) as error:
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf")
    assert "\n" not in str(error.value) and not (tmp_path / "hf").exists()


def test_the_experts_are_part_of_the_model(tmp_path):
    """init_from refuses a Mixtral for a dense run or one with other experts, naming the [moe] keys."""
    random_mixtral(tmp_path / "hf")
    source = open_source(str(tmp_path / "hf"))
    source.close()
    m = source.model
    check_same_model(source.architecture, architecture(m, moe_cfg(d_ff_expert=48)), "hf")
    with pytest.raises(HpcTrainError, match="moe.num_experts is 4 there, None here"):
        check_same_model(source.architecture, architecture(m), "hf")
    with pytest.raises(HpcTrainError, match="moe.top_k is 2 there, 1 here"):
        check_same_model(source.architecture, architecture(m, moe_cfg(top_k=1)), "hf")
