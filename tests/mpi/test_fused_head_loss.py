"""The fused LM head + cross-entropy (``model.fused_head_loss``, the default) on real ranks trains like one
process running the plain head (logits, then the vocab-parallel cross-entropy): float64 losses and final
parameters within 1e-10 with chunks of 5 tokens (dividing no micro-batch), over tp with and without sequence
parallelism (a vocabulary of 257: a slab of 1 real row, at tp=4 one of none), pp, cp, LoRA and packed SFT
examples (loss masks); the CLI's start-up line names the head, and float32 training and validation losses
equal the plain head's. The one-process function against the plain one: tests/unit/test_head_loss.py."""
import json

from mpirun import ROOT, run_mpi

EXACT = ["--param-rtol", "1e-10", "--rtol", "1e-10", "--reference", "model.fused_head_loss=false",
         "model.loss_chunk_tokens=5"]


def fidelity(nprocs, layouts, variants, *extra, timeout=420):
    result = run_mpi(nprocs, "check_fidelity.py", "--layouts", layouts, "--variants", variants, *EXACT, *extra,
                     timeout=timeout)
    assert "FIDELITY OK" in result.stdout, result.output
    return result.stdout


def test_tp_with_and_without_sp_pp_and_cp_equal_the_plain_head():
    """tp=2 x pp=2 (1F1B, and SP with ZeRO-1); tp=4 (one slab empty) with SP; tp=2 x cp=2 with SP."""
    out = fidelity(4, "1,2,2;1,4,1;1,2,1,2", "1f1b/sp,zero1", "model.vocab_size=257", "model.tie_embeddings=true")
    assert out.count("OK dp=") == 6


def test_lora_on_packed_sft_examples_equals_the_plain_head(tmp_path):
    """LoRA adapters (the head frozen: no dW at all) on packed SFT examples, tp=2 with SP (the masked tokens
    of a packed row), and pp=2; the frozen weights stay bit-identical (checked by the script)."""
    data = tmp_path / "sft.h5"
    run_mpi(1, "hpctrain.cli", "data", "prepare", "--format", "sft-jsonl", str(ROOT / "examples" / "sft" / "tiny.jsonl"),
            "--out", str(data), module=True, timeout=60)
    out = fidelity(2, "1,2,1;1,1,2", "sp", f"data.source={data}", "train.seq_len=256", "train.global_batch=4",
                   "lora.rank=4", "lora.alpha=6", "lora.targets=[q,v,down]")
    assert out.count("OK dp=") == 2 and out.count("LORA OK") == 3


def test_the_cli_names_the_head_and_its_losses_and_validation_equal_the_plain_heads(tmp_path):
    """tp=2 with SP, float32: the start-up line names the fused head's chunks; the training and validation
    losses equal those of model.fused_head_loss=false to float32 rounding."""
    def run(name, *overrides):
        result = run_mpi(2, "hpctrain.cli", "train", "--config", "configs/tiny.toml", "parallel.tp=2", "parallel.pp=1",
                         "parallel.sequence_parallel=true", "train.steps=3", "train.progress=false",
                         "data.valid_fraction=0.1", "train.eval_interval=3", "train.eval_steps=1",
                         f"train.run_dir={tmp_path / name}", *overrides, module=True, timeout=120)
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return result.stdout, [(r["loss"], r.get("val_loss")) for r in records if "loss" in r]

    out, fused = run("fused", "model.loss_chunk_tokens=50")
    assert "head: fused chunked CE (chunks of 50 of 128 tokens)" in out, out
    out, plain = run("plain", "model.fused_head_loss=false")
    assert "head: logits + vocab-parallel CE (model.fused_head_loss=false)" in out, out
    assert len(fused) == len(plain) == 3 and fused[-1][1] is not None, fused
    for (a, va), (b, vb) in zip(fused, plain):
        assert abs(a - b) <= 1e-5 * b and (va is None) == (vb is None) and (va is None or abs(va - vb) <= 1e-5 * vb)
