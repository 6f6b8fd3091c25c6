"""PEFT LoRA adapters in and out (hpctrain/interop/peft.py, commands/peft.py): export -> peft.PeftModel logits,
a peft-saved adapter -> import-peft -> hpctrain logits, merged export -> transformers logits, greedy
generation = transformers + peft, bad input. One process, float64, models built locally by transformers."""
import json
import os

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from hf_helpers import float64_exact_transformers, hf_logits, random_llama  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from hpctrain.checkpoint.weights import load_model, open_checkpoint  # noqa: E402
from hpctrain.cli import dispatch  # noqa: E402
from hpctrain.config import Config, LoraConfig  # noqa: E402
from hpctrain.errors import HpcTrainError  # noqa: E402
from hpctrain.interop.sources import CheckpointSource, check_adapters, open_source  # noqa: E402

HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def hpctrain(*argv):
    return dispatch([str(a) for a in argv])


def visible(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def peft_adapter(base_dir, out, *, r=4, alpha=7, targets=("q_proj", "v_proj", "down_proj"), seed=5):
    """A peft LoRA adapter on the model in ``base_dir``, with random (non-zero) A and B, saved to ``out``;
    returns the PeftModel (eval, float64)."""
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.save_pretrained(str(out))
    return model.eval()


def hpctrain_model(path):
    reader = open_checkpoint(str(path))
    try:
        return load_model(reader)
    finally:
        reader.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random Llama of 256 tokens (byte-level ids), no bos/eos (generate never stops early)."""
    directory = tmp_path_factory.mktemp("peft") / "hf"
    model = random_llama(directory, vocab=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return directory, model


def test_a_peft_adapter_imports_and_gives_pefts_logits(base, tmp_path):
    hf_dir, plain = base
    theirs = peft_adapter(hf_dir, tmp_path / "adapter", targets=HF_MODULES)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(hf_dir)
    assert hpctrain("import-peft", tmp_path / "adapter", "--out", tmp_path / "ckpt") == 0  # base from the config
    cfg, ours = hpctrain_model(tmp_path / "ckpt")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (4, 7.0, ["q", "k", "v", "o", "gate", "up", "down"])
    toml = (tmp_path / "ckpt" / "model.toml").read_text()
    assert "[lora]\nrank = 4\nalpha = 7.0" in toml and '"gate", "up", "down"]' in toml
    with float64_exact_transformers(), torch.no_grad():
        expected = hf_logits(theirs, IDS)
        torch.testing.assert_close(ours(IDS).permute(1, 0, 2), expected, rtol=0, atol=1e-10)
        assert (expected - hf_logits(plain, IDS)).abs().max() > 1e-2  # the adapters count


def test_export_peft_loads_in_peft_and_merged_export_in_transformers(base, tmp_path):
    hf_dir, _ = base
    reference = peft_adapter(hf_dir, tmp_path / "saved_by_peft", r=3, alpha=5, targets=("k_proj", "o_proj", "up_proj"))
    hpctrain("import-peft", tmp_path / "saved_by_peft", "--base", hf_dir, "--out", tmp_path / "ckpt")
    _, ours = hpctrain_model(tmp_path / "ckpt")
    assert hpctrain("export", tmp_path / "ckpt", "--format", "peft", "--out", tmp_path / "exported") == 0
    assert visible(tmp_path / "exported") == ["adapter_config.json", "adapter_model.safetensors"]
    mine, peft_saved = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("exported", "saved_by_peft"))
    assert mine.keys() == peft_saved.keys() and all(torch.equal(mine[k], peft_saved[k]) for k in mine)
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight" in mine
    config = json.loads((tmp_path / "exported" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir) and config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (3, 5.0, ["k_proj", "o_proj", "up_proj"])
    loaded = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float64),
                                            str(tmp_path / "exported")).eval()
    hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--merge-lora", "--out", tmp_path / "merged")
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64).eval()
    with float64_exact_transformers(), torch.no_grad():
        expected = hf_logits(reference, IDS)
        torch.testing.assert_close(hf_logits(loaded, IDS), expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(ours(IDS).permute(1, 0, 2), expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(hf_logits(merged, IDS), expected, rtol=0, atol=1e-10)
    with pytest.raises(HpcTrainError, match="pass --merge-lora .* or use --format peft") as err:
        hpctrain("export", tmp_path / "ckpt", "--format", "hf", "--out", tmp_path / "unmerged")
    assert "\n" not in str(err.value) and not (tmp_path / "unmerged").exists()
    with pytest.raises(HpcTrainError, match="exists and is not empty; use --force"):
        hpctrain("export", tmp_path / "ckpt", "--format", "peft", "--out", tmp_path / "exported")
    assert hpctrain("export", tmp_path / "ckpt", "--format", "peft", "--out", tmp_path / "exported", "--force") == 0


def test_generate_on_a_lora_checkpoint_equals_transformers_and_peft(base, tmp_path, capsys):
    from hpctrain.data.tokenizer import load_tokenizer
    from hpctrain.tools.generate import generate_ids

    hf_dir, plain = base
    theirs = peft_adapter(hf_dir, tmp_path / "adapter", targets=("q_proj", "v_proj", "gate_proj"), seed=8)
    hpctrain("import-peft", tmp_path / "adapter", "--out", tmp_path / "ckpt")
    _, ours = hpctrain_model(tmp_path / "ckpt")
    prompt = list(b"LoRA says")
    with float64_exact_transformers(), torch.no_grad():
        expected = theirs.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0].tolist()
        base_only = plain.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10,
                                                     do_sample=False)[0].tolist()
        assert generate_ids(ours, prompt, 10, 64, temperature=0) == expected
        capsys.readouterr()
        hpctrain("generate", tmp_path / "ckpt", "--prompt", "LoRA says", "--max-new-tokens", 10, "--temperature", 0)
    assert expected != base_only  # the adapters change the greedy text
    printed = capsys.readouterr()
    assert printed.out == "LoRA says" + load_tokenizer("bytes").decode(expected[len(prompt):]) + "\n"
    assert "LoRA r=4 on q,v,gate, 10 new tokens, stopped at max_new_tokens]" in printed.err
    text = load_tokenizer("bytes").decode(expected[len(prompt):])
    stop = text[4:6]  # --stop cuts the text before its first occurrence and ends generation there
    hpctrain("generate", tmp_path / "ckpt", "--prompt", "LoRA says", "--max-new-tokens", 10, "--temperature", 0,
             "--stop", stop, "--stop", "never printed")
    printed = capsys.readouterr()
    assert printed.out == "LoRA says" + text[:text.index(stop)] + "\n" and f"stopped at {stop}]" in printed.err


def test_init_from_a_lora_checkpoint_needs_adapters_in_the_run(base, tmp_path):
    hf_dir, _ = base
    peft_adapter(hf_dir, tmp_path / "adapter", r=2, alpha=4, targets=("q_proj",))
    hpctrain("import-peft", tmp_path / "adapter", "--base", hf_dir, "--out", tmp_path / "ckpt")
    source = CheckpointSource(str(tmp_path / "ckpt"))
    try:
        assert source.read("layers.0.attn.wq.lora_A.weight").shape == (2, 32)
        with pytest.raises(HpcTrainError, match="holds LoRA adapters .* --merge-lora") as err:
            check_adapters(source, Config().lora, "CKPT")
        assert "\n" not in str(err.value)
        assert check_adapters(source, LoraConfig(rank=2, alpha=4, targets=["q"]), "CKPT")  # continues them
        assert not check_adapters(source, LoraConfig(rank=8, alpha=4, targets=["q"]), "CKPT")  # base only
        with pytest.raises(HpcTrainError, match="lora.alpha=4, this run has lora.alpha=8"):
            check_adapters(source, LoraConfig(rank=2, alpha=8, targets=["q"]), "CKPT")
    finally:
        source.close()
    with pytest.raises(HpcTrainError, match="is a PEFT adapter directory, .*`hpctrain import-peft "):
        open_source(str(tmp_path / "adapter"))


def test_bad_adapters_are_one_line_and_write_nothing(base, tmp_path):
    hf_dir, _ = base
    peft_adapter(hf_dir, tmp_path / "good", r=2, targets=("q_proj", "v_proj"))
    config = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
    weights = load_file(tmp_path / "good" / "adapter_model.safetensors")

    def bad(name, change_config=None, change_weights=None):
        directory = tmp_path / name
        directory.mkdir()
        raw = dict(config)
        (change_config or (lambda c: None))(raw)
        (directory / "adapter_config.json").write_text(json.dumps(raw))
        tensors = dict(weights)
        (change_weights or (lambda t: None))(tensors)
        save_file(tensors, directory / "adapter_model.safetensors")
        with pytest.raises(HpcTrainError) as err:
            hpctrain("import-peft", directory, "--base", hf_dir, "--out", tmp_path / f"out-{name}")
        assert "\n" not in str(err.value) and not (tmp_path / f"out-{name}").exists()
        return str(err.value)

    assert "peft_type is 'IA3': only LoRA" in bad("ia3", lambda c: c.update(peft_type="IA3"))
    assert "use_dora is True" in bad("dora", lambda c: c.update(use_dora=True))
    assert "target_modules is ['qkv']" in bad("qkv", lambda c: c.update(target_modules=["qkv"]))
    assert "lora.rank: 40 exceeds the dimensions of target 'v'" in bad("rank", lambda c: c.update(r=40))
    assert "has shape (2, 32), r=3 on this base model implies (3, 32)" in bad("r", lambda c: c.update(r=3))
    missing = bad("missing", change_weights=lambda t: t.pop(next(k for k in t if "v_proj.lora_B" in k)))
    assert "missing ['base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight']" in missing
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert "q_proj.lora_A.weight has shape (2, 16)" in bad("shape", change_weights=lambda t: t.update(
        {key: torch.zeros(2, 16, dtype=torch.float64)}))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out-")]  # staging removed
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/x"}))
    with pytest.raises(HpcTrainError, match="names no local base model .*'org/x'.* --base"):
        hpctrain("import-peft", tmp_path / "hub", "--out", tmp_path / "nobase")
    assert not (tmp_path / "nobase").exists()
    hpctrain("import-hf", hf_dir, "--out", tmp_path / "plain")
    with pytest.raises(HpcTrainError, match="has no LoRA adapters .* --format hf") as err:
        hpctrain("export", tmp_path / "plain", "--format", "peft", "--out", tmp_path / "none")
    assert "\n" not in str(err.value) and not (tmp_path / "none").exists()
