"""The fused LM head + cross-entropy (``model.fused_head_loss``, the default) on real ranks trains like one
process running the plain head (logits, then the vocab-parallel cross-entropy): float64 losses and final
parameters within 1e-10 with chunks of 5 tokens (dividing no micro-batch), over tp with and without sequence
parallelism (a vocabulary of 257: a slab of 1 real row, at tp=4 one of none), pp, cp, LoRA and packed SFT
examples (loss masks). The one-process function against the plain one: tests/unit/test_head_loss.py."""
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
