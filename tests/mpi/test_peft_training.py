"""A PEFT adapter trained on in hpctrain and handed back (float64): a peft-saved adapter -> ``import-peft`` ->
``model.init_from`` of a tp=2 LoRA run (the adapter continues, the base stays bit-identical) -> ``export
--format peft`` that ``peft.PeftModel.from_pretrained`` loads with hpctrain's logits (1e-10), and ``--format
hf --merge-lora`` that transformers loads with the same logits; a run without adapters refuses it."""
import json

import pytest
import torch

from mpirun import run_mpi

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

IDS = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))


def test_an_imported_adapter_trains_on_tp2_and_exports_to_peft_and_merged_hf(tmp_path):
    from hf_helpers import float64_exact_transformers, hf_logits, random_llama
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from hpctrain.cli import dispatch
    from hpctrain.interop.hf import hf_name
    from hpctrain.interop.sources import load_run_model

    hf_dir, adapter = tmp_path / "hf", tmp_path / "adapter"
    random_llama(hf_dir, vocab=257, kv_heads=2)
    wrapped = peft.get_peft_model(LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float64),
                                  peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "o_proj", "up_proj"],
                                                  task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn_like(p))
    wrapped.save_pretrained(str(adapter))
    imported = load_file(adapter / "adapter_model.safetensors")
    assert dispatch(["import-peft", str(adapter), "--out", str(tmp_path / "ckpt")]) == 0
    toml = tmp_path / "ckpt" / "model.toml"
    common = ["--config", str(toml), "train.dtype=float64", "data.max_bytes=300000", "train.seq_len=32",
              "train.steps=2", "train.lr=1e-3", "parallel.microbatches=1", "checkpoint.async=false",
              f"model.init_from={tmp_path / 'ckpt'}"]
    refused = run_mpi(2, "hpctrain.cli", "train", *common, f"train.run_dir={tmp_path / 'plain'}", "lora.rank=0",
                      "parallel.tp=2", module=True, timeout=120, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert refused.returncode != 0 and len(errors) == 1 and "holds LoRA adapters" in errors[0], refused.stderr
    assert "--merge-lora" in errors[0] and "Traceback" not in refused.stderr

    run = tmp_path / "run"
    run_mpi(2, "hpctrain.cli", "train", *common, f"train.run_dir={run}", "parallel.tp=2", module=True, timeout=120)
    _, ours, _ = load_run_model(str(run))  # the base through the checkpoint's reference to tmp_path/ckpt
    hf = load_file(hf_dir / "model.safetensors")
    b = ours.layers["1"].attn.wo.lora_B.weight.detach()
    start = imported["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
    assert 0 < (b - start).abs().max() < 0.02  # continued from the imported adapter (a fresh B would be ~0)
    for name, p in ours.named_parameters():  # the frozen base: bit-identical to the Hugging Face model
        if ".lora_" not in name:
            assert torch.equal(p.detach()[p.spec.valid_local()], hf[hf_name(name)]), name  # no padding rows

    assert dispatch(["export", str(run), "--format", "peft", "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir) and config["r"] == 2
    assert load_file(tmp_path / "out" / "adapter_model.safetensors").keys() == imported.keys()
    assert dispatch(["export", str(run), "--format", "hf", "--merge-lora", "--out", str(tmp_path / "merged")]) == 0
    loaded = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float64),
                                            str(tmp_path / "out")).eval()
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64).eval()
    with float64_exact_transformers(), torch.no_grad():
        mine = ours(IDS).permute(1, 0, 2)
        torch.testing.assert_close(hf_logits(loaded, IDS), mine, rtol=0, atol=1e-10)
        torch.testing.assert_close(hf_logits(merged, IDS), mine, rtol=0, atol=1e-10)
        assert (hf_logits(wrapped.eval(), IDS) - mine).abs().max() > 1e-6  # training moved the adapters


def test_bench_lora_compares_lora_with_full_fine_tuning_and_peft(tmp_path):
    """benchmarks/bench_lora.py end to end on a tiny model: every mode's record; LoRA trains fewer parameters
    than full fine-tuning (the same count as peft) and its checkpoint, referring to the base, is smaller than
    the copy. (Timings are reported, never asserted.)"""
    import subprocess
    import sys

    from mpirun import ROOT, mpi_env

    out = tmp_path / "lora.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--d-model", "64", "--d-ff",
                             "128", "--layers", "2", "--heads", "4", "--vocab", "300", "--seq", "32", "--steps", "1",
                             "--warmup", "1", "--json", str(out)], env=mpi_env(), cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    records = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"hpctrain-full", "hpctrain-lora", "hpctrain-lora-all", "torch-full", "peft-lora"}
    assert records["hpctrain-lora"]["trainable_m"] == records["peft-lora"]["trainable_m"] \
        < records["hpctrain-lora-all"]["trainable_m"] < records["hpctrain-full"]["trainable_m"]
    assert records["hpctrain-full"]["trainable_m"] == records["torch-full"]["trainable_m"]
    assert records["hpctrain-lora"]["ckpt_mb"] < records["hpctrain-lora"]["ckpt_copy_mb"]
    assert all(r["step_s"] > 0 and r["above_base_mb"] > 0 for r in records.values())
