"""Hugging Face Llama export/import (hpctrain/interop): logits equal transformers', round trips are bitwise,
bad inputs are clear errors. One process, no download: models are built locally from a LlamaConfig."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_helpers import float64_exact_transformers, hf_logits, hpctrain_logits, random_llama  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from hpctrain.checkpoint.weights import load_model, open_checkpoint  # noqa: E402
from hpctrain.cli import dispatch  # noqa: E402
from hpctrain.config import Config, ModelConfig  # noqa: E402
from hpctrain.errors import HpcTrainError  # noqa: E402
from hpctrain.interop.hf import HFError, HFModelDir, hf_name, parameter_shapes, supported_tp  # noqa: E402
from hpctrain.interop.staging import write_weights_only  # noqa: E402
from hpctrain.models.gpt import GPTStage  # noqa: E402
from hpctrain.config.layout import Layout  # noqa: E402

DTYPES = {"float64": (torch.float64, 1e-10), "float32": (torch.float32, 1e-5)}
IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def model_cfg(tied=False, kv=2, vocab=96):
    return ModelConfig(preset="custom", vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv, d_ff=48,
                       max_seq_len=64, tie_embeddings=tied, rope_theta=500.0, norm_eps=1e-5)


def random_checkpoint(directory, m, dtype="float64", seed=0, tokenizer="bytes"):
    """A one-process hpctrain checkpoint (weights only) of random global weights; returns the weights."""
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (1 + 0.2 * torch.randn(s, generator=g, dtype=torch.float64)) if len(s) == 1 else
               0.3 * torch.randn(s, generator=g, dtype=torch.float64) for n, s in parameter_shapes(m).items()}
    tensors = {n: t.to(getattr(torch, dtype)) for n, t in tensors.items()}
    cfg = Config(model=m)
    cfg.train.dtype, cfg.data.tokenizer = dtype, str(tokenizer)
    os.makedirs(directory)
    write_weights_only(str(directory), cfg, tensors, dtype, "test")
    return tensors


def hpctrain(*argv):
    return dispatch([str(a) for a in argv])


def test_names_and_shapes_match_the_model_and_transformers():
    for tied in (False, True):
        m = model_cfg(tied)
        stage = GPTStage(m, (0, 2), is_first=True, is_last=True)
        assert {p.spec.name: p.spec.global_shape for p in stage.parameters()} == parameter_shapes(m)
        hf = random_llama(None, tied=tied)
        hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
        assert {hf_name(n): s for n, s in parameter_shapes(m).items()} == hf_shapes
    assert supported_tp(model_cfg()) == [1, 2]  # 2 KV heads
    with pytest.raises(HFError, match="no Hugging Face Llama name"):
        hf_name("layers.0.attn.bias")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tied,kv", [(False, 2), (True, 1), (True, 4)])
def test_exported_weights_give_transformers_the_same_logits(tmp_path, dtype, tied, kv):
    torch_dtype, tol = DTYPES[dtype]
    m = model_cfg(tied, kv)
    tensors = random_checkpoint(tmp_path / "ckpt", m, dtype)
    assert hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf") == 0
    assert visible(tmp_path / "hf") == ["config.json", "model.safetensors"]  # byte-level: no tokenizer
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == dtype
    assert config["num_key_value_heads"] == kv and config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in load_file(tmp_path / "hf" / "model.safetensors")) is not tied
    with float64_exact_transformers():
        hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch_dtype).eval()
        ours, theirs = hpctrain_logits(m, tensors, IDS, torch_dtype), hf_logits(hf, IDS)
    assert theirs.dtype == torch_dtype and theirs.abs().max() > 1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=tol * theirs.abs().max().item())


def test_the_rotary_halves_need_no_permutation(tmp_path):
    """The test above would notice a wrong rotary convention: permuting q/k rows to interleaved pairs
    (Meta's layout) changes the logits."""
    hf = random_llama(tmp_path / "hf")
    source = HFModelDir(str(tmp_path / "hf"))
    tensors = {n: source.read(n) for n in source.shapes}
    perm = torch.arange(8).view(2, 4).t().reshape(-1)  # halves -> interleaved pairs, per head
    for n in [n for n in tensors if n.endswith(("wq.weight", "wk.weight"))]:
        heads = tensors[n].shape[0] // 8
        tensors[n] = tensors[n].view(heads, 8, -1)[:, perm].reshape(heads * 8, -1)
    with float64_exact_transformers():
        assert (hpctrain_logits(source.model, tensors, IDS) - hf_logits(hf, IDS)).abs().max() > 1e-3


@pytest.mark.parametrize("dtype,tied", [("float64", False), ("bfloat16", True), ("float32", True)])
def test_export_import_export_is_bitwise(tmp_path, dtype, tied):
    random_checkpoint(tmp_path / "ckpt", model_cfg(tied), "float32" if dtype == "bfloat16" else dtype)
    export = ["--format", "hf"] + (["--dtype", dtype] if dtype == "bfloat16" else [])
    hpctrain("export", tmp_path / "ckpt", *export, "--out", tmp_path / "hf1")
    hpctrain("import-hf", tmp_path / "hf1", "--out", tmp_path / "imported")
    reader = open_checkpoint(str(tmp_path / "imported"))
    assert reader.attrs["step"] == 0 and reader.attrs["weights_only"] and reader.attrs["model_dtype"] == dtype
    assert reader.complete and not reader.verify() and not reader.datasets("optim")
    reader.close()
    hpctrain("export", tmp_path / "imported", "--format", "hf", "--out", tmp_path / "hf2")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_a_sharded_export_streams_one_parameter_at_a_time_and_loads_like_one_file(tmp_path, monkeypatch):
    """--max-shard-gb cuts the weights into model-0000i-of-0000n.safetensors + the index, as save_pretrained
    does; every tensor equals the one-file export's and transformers gives the same logits. The export reads
    each parameter when its turn comes and holds one at a time (hpctrain/interop/safetensors_stream.py)."""
    from hpctrain.interop import sources

    m = model_cfg(tied=False)
    tensors = random_checkpoint(tmp_path / "ckpt", m, "float64")
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "one")
    reads = []
    real_read = sources.CheckpointSource.read

    def counted(self, name, *args, **kwargs):
        reads.append(name)
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(sources.CheckpointSource, "read", counted)
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "many", "--max-shard-gb", "0.00002")
    assert sorted(reads) == sorted(set(reads)) == sorted(tensors)  # each parameter read once
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert visible(tmp_path / "many") == sorted(["config.json", "model.safetensors.index.json", *files])
    one = load_file(tmp_path / "one" / "model.safetensors")
    many = {k: v for f in files for k, v in load_file(tmp_path / "many" / f).items()}
    assert one.keys() == many.keys() == index["weight_map"].keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in one.values())
    with float64_exact_transformers():
        hf = LlamaForCausalLM.from_pretrained(tmp_path / "many", dtype=torch.float64).eval()
        torch.testing.assert_close(hf_logits(hf, IDS), hpctrain_logits(m, tensors, IDS, torch.float64), rtol=0,
                                   atol=1e-10 * hf_logits(hf, IDS).abs().max().item())
    with pytest.raises(HpcTrainError, match="--max-shard-gb 0.0: must be > 0"):
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "none", "--max-shard-gb", "0")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("tied,kv,shard", [(False, 2, False), (True, 1, True)])
def test_an_imported_hf_model_gives_the_same_logits_in_hpctrain(tmp_path, tied, kv, shard):
    hf = random_llama(tmp_path / "hf", tied=tied, kv_heads=kv)
    if shard:
        hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
        assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    hpctrain("import-hf", tmp_path / ("sharded" if shard else "hf"), "--out", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.toml").read_text().count("\n") > 10
    reader = open_checkpoint(str(tmp_path / "ckpt"))
    cfg, model = load_model(reader)
    reader.close()
    assert cfg.model.n_kv_heads == kv and cfg.model.tie_embeddings is tied and cfg.train.dtype == "float64"
    with float64_exact_transformers(), torch.no_grad():
        torch.testing.assert_close(model(IDS).permute(1, 0, 2), hf_logits(hf, IDS), rtol=0, atol=1e-10)
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "back")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_the_tokenizer_travels_with_the_export(tmp_path):
    from transformers import AutoTokenizer

    from hpctrain.data.tokenizer import train_bpe

    tok = train_bpe(iter(["def f(x):\n    return x + 1\n", "héllo wörld\n"] * 30), 280, str(tmp_path / "tok.json"))
    m = model_cfg(vocab=288)
    random_checkpoint(tmp_path / "ckpt", m, tokenizer=tok)  # the run's data.tokenizer: exported by default
    random_checkpoint(tmp_path / "moved", m, tokenizer=tmp_path / "gone.json")
    with pytest.raises(HpcTrainError, match="the run's data.tokenizer.*--tokenizer none"):
        hpctrain("export", tmp_path / "moved", "--format", "hf", "--out", tmp_path / "x")
    with pytest.raises(HpcTrainError, match="no such tokenizer.json"):
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "x", "--tokenizer", tmp_path / "no")
    assert not os.path.exists(tmp_path / "x")
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "hf"))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert loaded.decode(loaded("def f(x): héllo")["input_ids"]) == "def f(x): héllo"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == loaded.eos_token_id


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma"}, "model_type .gemma. is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}}, "rope_parameters"),
    ({"attention_bias": True}, "no biases"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"intermediate_size": 64}, r"gate_proj.weight has shape \(48, 32\), config.json implies \(64, 32\)"),
    ({"num_key_value_heads": 3}, "not a model hpctrain can build"),
])
def test_unsupported_or_mismatched_hf_models_are_clear_errors(tmp_path, change, message):
    random_llama(tmp_path / "hf")
    _edit_config(tmp_path / "hf", **change)
    with pytest.raises(HFError, match=message):
        hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing half-written, no temporary directory left


def test_missing_files_and_extra_tensors_are_clear_errors(tmp_path):
    with pytest.raises(HFError, match="no such Hugging Face model directory"):
        hpctrain("import-hf", tmp_path / "nothing", "--out", tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFError, match="no config.json"):
        hpctrain("import-hf", tmp_path / "empty", "--out", tmp_path / "ckpt")
    hf = random_llama(tmp_path / "hf")
    os.rename(tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(HFError, match="only safetensors"):
        hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32, dtype=torch.float64)},
              tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="unexpected.*q_proj.bias"):
        hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="missing.*model.norm.weight"):
        hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    with pytest.raises(HpcTrainError, match="neither a checkpoint nor"):
        hpctrain("export", tmp_path / "empty", "--format", "hf", "--out", tmp_path / "out")
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "ckpt")


def visible(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def test_out_is_replaced_only_with_force_and_only_when_hpctrain_wrote_it(tmp_path):
    random_checkpoint(tmp_path / "ckpt", model_cfg())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(HpcTrainError, match="not written by hpctrain"):  # --force or not: not ours
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf", "--force")
    assert os.listdir(tmp_path / "hf") == ["keep.txt"]
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "new")
    with pytest.raises(HpcTrainError, match="not empty; use --force"):
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "new")
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "new", "--force")
    assert visible(tmp_path / "new") == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf", "new"]
    for out in (tmp_path / "ckpt", tmp_path):  # the source itself, or a directory holding it
        with pytest.raises(HpcTrainError, match="holds the source"):
            hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", out, "--force")
        assert (tmp_path / "ckpt").is_dir()


def test_an_odd_vocabulary_splits_over_any_tp_and_round_trips_exactly(tmp_path, capsys):
    """97 tokens: padded to 128 rows at tp=1, 256 at tp=2 in memory; the checkpoint and the export hold 97;
    logits equal transformers' and export(import(hf)) is bitwise the original."""
    hf = random_llama(tmp_path / "hf", vocab=97, kv_heads=2)
    source = HFModelDir(str(tmp_path / "hf"))
    assert supported_tp(source.model) == [1, 2]  # heads and KV heads decide, not the vocabulary
    cfg = Config(model=source.model)
    cfg.parallel.tp = 2
    assert Layout.from_config(cfg, 2).tp_size == 2
    source.close()
    hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    assert "tensor-parallel sizes that split it: 1, 2" in capsys.readouterr().out
    reader = open_checkpoint(str(tmp_path / "ckpt"))
    assert reader.shape("model/embed.weight") == (97, 32) and reader.shape("model/head.weight") == (97, 32)
    _, model = load_model(reader)
    reader.close()
    assert model.embed.weight.shape == (128, 32) and not model.head.weight[97:].any()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    with float64_exact_transformers(), torch.no_grad():
        ours = model(ids).permute(1, 0, 2)
        assert ours.shape == (2, 24, 97)
        torch.testing.assert_close(ours, hf_logits(hf, ids), rtol=0, atol=1e-10)
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["vocab_size"] == 97
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)


def test_sources_read_slabs_of_either_format_and_refuse_another_model(tmp_path):
    """What model.init_from reads on each rank: a slab of a global tensor, from an HF directory or an
    hpctrain checkpoint, the same values; another model (same shapes, other rope_theta) is refused."""
    from hpctrain.interop.sources import check_same_model, open_source

    random_llama(tmp_path / "hf")
    hpctrain("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt")
    (tmp_path / "run").mkdir()  # a run directory: hpctrain's config.json beside checkpoints/
    os.rename(tmp_path / "ckpt", tmp_path / "run" / "checkpoints")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": {"preset": "tiny"}}))
    hf_source, ckpt_source = open_source(str(tmp_path / "hf")), open_source(str(tmp_path / "run"))
    assert type(hf_source).__name__ == "HFModelDir" and type(ckpt_source).__name__ == "CheckpointSource"
    assert hf_source.model == ckpt_source.model and hf_source.dtype == ckpt_source.dtype == "float64"
    for name, index in (("layers.1.attn.wk.weight", (slice(8, 16), slice(None))), ("norm.weight", None),
                        ("head.weight", (slice(48, 96), slice(None)))):
        whole = hf_source.read(name)
        assert torch.equal(hf_source.read(name, index), whole[index] if index else whole)
        assert torch.equal(ckpt_source.read(name, index), whole[index] if index else whole)
    hf_source.close()
    ckpt_source.close()
    check_same_model(hf_source.model, hf_source.model, "x")
    other = ModelConfig(**{**hf_source.model.__dict__, "rope_theta": 10000.0, "max_seq_len": 256})
    with pytest.raises(HpcTrainError, match="model.rope_theta is 500.0 there, 10000.0 here"):
        check_same_model(hf_source.model, other, str(tmp_path / "hf"))
    with pytest.raises(HpcTrainError, match="no such Hugging Face model directory or hpctrain checkpoint"):
        open_source(str(tmp_path / "nothing"))


@pytest.mark.parametrize("mlp,positions,named", [("gelu", "learned", "model.mlp=gelu, model.positions=learned"),
                                                 ("swiglu", "learned", "model.positions=learned"),
                                                 ("gelu", "rope", "model.mlp=gelu")])
def test_a_gpt_architecture_is_refused_by_export_and_init_from_naming_the_keys(tmp_path, mlp, positions, named):
    from hpctrain.interop.sources import check_same_model, open_source

    m = ModelConfig(**{**model_cfg(tied=True).__dict__, "mlp": mlp, "positions": positions})
    random_checkpoint(tmp_path / "ckpt", m)
    with pytest.raises(HFError, match=f"{named}: Hugging Face interop is the Llama architecture only"):
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    source = open_source(str(tmp_path / "ckpt"))  # our own checkpoint of it reads back: init_from works
    assert set(source.shapes) == set(parameter_shapes(m)) and ("pos_embed.weight" in source.shapes) == (
        positions == "learned")
    source.close()
    random_llama(tmp_path / "llama")
    llama = open_source(str(tmp_path / "llama"))
    llama.close()
    with pytest.raises(HpcTrainError, match=f"model.{'mlp' if mlp == 'gelu' else 'positions'} is "):
        check_same_model(llama.model, ModelConfig(**{**llama.model.__dict__, "mlp": mlp, "positions": positions}),
                         "llama")
