"""LoRA on one process (no MPI): the adapter's function (PEFT's, and the merged weight W + alpha/r B A),
its names, initialisation and frozen base; the ``[lora]`` config's bad input; the start-up line's
arithmetic. Every layout against one process: tests/mpi/test_lora.py."""
import math

import pytest
import torch

from hpctrain.config import ConfigError, LoraConfig, ModelConfig, load_config, resolve_model
from hpctrain.config.arithmetic import adapter_parameters, count_parameters
from hpctrain.models.gpt import GPTStage
from hpctrain.models.lora import describe

ALL = ["q", "k", "v", "o", "gate", "up", "down"]
SMALL = dict(preset="custom", vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
             max_seq_len=16)


def stage_of(lora: LoraConfig | None, mlp="swiglu", seed=3):
    m = resolve_model(ModelConfig(**SMALL, mlp=mlp))
    return m, GPTStage(m, (0, m.n_layers), is_first=True, is_last=True, dtype=torch.float64, seed=seed, lora=lora)


def test_adapters_have_peft_names_global_shapes_and_only_they_train():
    m, stage = stage_of(LoraConfig(rank=4, targets=ALL))
    trainable = {n: tuple(p.shape) for n, p in stage.named_parameters() if p.requires_grad}
    assert trainable["layers.1.attn.wq.lora_A.weight"] == (4, 16)
    assert trainable["layers.1.attn.wk.lora_B.weight"] == (8, 4)  # kv: 2 heads of 4
    assert trainable["layers.0.mlp.down.lora_A.weight"] == (4, 24)
    assert len(trainable) == 2 * 7 * m.n_layers
    assert all(p.spec.name == n for n, p in stage.named_parameters())  # module path = checkpoint name
    assert sum(p.numel() for p in stage.parameters() if p.requires_grad) == adapter_parameters(m, 4, ALL)
    frozen = [n for n, p in stage.named_parameters() if not p.requires_grad]
    assert "embed.weight" in frozen and "layers.0.attn_norm.weight" in frozen and "head.weight" in frozen


def test_init_is_pefts_kaiming_uniform_a_and_zero_b_from_seed_and_name():
    _, stage = stage_of(LoraConfig(rank=4, targets=["q", "down"]))
    for linear, fan_in in ((stage.layers["0"].attn.wq, 16), (stage.layers["1"].mlp.down, 24)):
        a = linear.lora_A.weight
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) x sqrt(3 / fan_in)
        assert a.abs().max() <= bound and a.abs().max() > 0.7 * bound and a.std() > 0.3 * bound
        assert not linear.lora_B.weight.any()
    _, again = stage_of(LoraConfig(rank=4, targets=["q", "down"]))
    assert torch.equal(again.layers["0"].attn.wq.lora_A.weight, stage.layers["0"].attn.wq.lora_A.weight)
    assert not torch.equal(stage.layers["1"].attn.wq.lora_A.weight, stage.layers["0"].attn.wq.lora_A.weight)
    _, other_seed = stage_of(LoraConfig(rank=4, targets=["q", "down"]), seed=4)
    assert not torch.equal(other_seed.layers["0"].attn.wq.lora_A.weight, stage.layers["0"].attn.wq.lora_A.weight)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_the_adapter_equals_the_merged_weight(mlp):
    """With non-zero B the model computes W + alpha/r B A (PEFT's get_delta_weight) in every target."""
    targets = [t for t in ALL if mlp == "swiglu" or t != "gate"]
    lora = LoraConfig(rank=3, alpha=5.0, targets=targets)
    _, adapted = stage_of(lora, mlp)
    _, merged = stage_of(None, mlp)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.spec.name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
        params = dict(adapted.named_parameters())
        for name, w in merged.named_parameters():
            base = name[:-len(".weight")]
            if f"{base}.lora_A.weight" in params:
                w += (5.0 / 3) * params[f"{base}.lora_B.weight"] @ params[f"{base}.lora_A.weight"]
    ids = torch.randint(0, 64, (2, 8), generator=g)
    adapted.eval(), merged.eval()
    assert torch.allclose(adapted(ids), merged(ids), rtol=0, atol=1e-12)
    assert not torch.allclose(adapted(ids), stage_of(None, mlp)[1].eval()(ids), atol=1e-6)  # B matters


def test_dropout_acts_on_the_adapter_input_in_training_only():
    _, stage = stage_of(LoraConfig(rank=2, dropout=0.5, targets=["q"]))
    with torch.no_grad():
        stage.layers["0"].attn.wq.lora_B.weight.fill_(0.3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    stage.eval()
    assert torch.equal(stage(ids), stage(ids))
    stage.train()
    torch.manual_seed(0)
    assert not torch.equal(stage(ids), stage(ids))


def test_the_same_forward_as_peft_on_transformers():
    """hpctrain's LoRA model = transformers' Llama + peft's LoraModel with the same weights (float64)."""
    peft = pytest.importorskip("peft")
    from hf_helpers import float64_exact_transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpctrain.interop.hf import hf_name

    m = resolve_model(ModelConfig(**SMALL))
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=m.norm_eps,
                                      rope_theta=m.rope_theta, max_position_embeddings=16,
                                      tie_word_embeddings=False)).double().eval()
    hf_modules = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                  "down": "down_proj"}
    wrapped = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=7, target_modules=list(hf_modules.values()),
                                                      lora_dropout=0.0)).eval()
    _, ours = stage_of(LoraConfig(rank=4, alpha=7.0, targets=ALL))
    hf_params = dict(wrapped.named_parameters())

    def peft_name(name: str) -> str:  # ours -> peft's: base weights move to .base_layer, adapters gain .default
        if ".lora_" in name:
            base, factor = name.split(".lora_")
            return f"base_model.model.{hf_name(base + '.weight')[:-len('.weight')]}.lora_{factor[0]}.default.weight"
        wrapped_base = f"base_model.model.{hf_name(name)[:-len('.weight')]}.base_layer.weight"
        return wrapped_base if wrapped_base in hf_params else f"base_model.model.{hf_name(name)}"

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_B" in name:  # B is zero at the start: make it count
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
            hf_params[peft_name(name)].copy_(p[p.spec.valid_local()])  # without vocabulary padding rows
    ids = torch.randint(0, 64, (2, 8), generator=g)
    with float64_exact_transformers(), torch.no_grad():
        theirs = wrapped(ids).logits
        mine = ours.eval()(ids).permute(1, 0, 2)
    assert torch.allclose(mine, theirs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=4", "lora.targets=[q,qkv]"], "lora.targets: unknown target 'qkv'"),
    (["lora.rank=4", "model.mlp=gelu", "lora.targets=[gate]"], "lora.targets: unknown target 'gate'"),
    (["lora.rank=33", "lora.targets=[q,k]"], "lora.rank: 33 exceeds the dimensions of target 'k' (in 64, out 32)"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha: must be > 0"),
    (["lora.rank=4", "lora.targets=[]"], "lora.targets: must name at least one"),
    (["lora.rank=-1"], "lora.rank: must be >= 0"),
    (["lora.dropout=1"], "lora.dropout: must be < 1"),
])
def test_bad_lora_config_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
    if "unknown target" in message:
        assert "valid targets of this model" in str(err.value) and "q, k, v, o" in str(err.value)


def test_rank_zero_is_off_and_the_largest_rank_fits():
    assert load_config(None, ["lora.targets=[nonsense]"]).lora.rank == 0  # off: targets not looked at
    assert load_config(None, ["lora.rank=32", "lora.targets=[q,k]"]).lora.rank == 32  # tiny: kv out = 32


def test_startup_line_counts_trainable_and_frozen_and_the_optimizer_state_saved():
    m = resolve_model(ModelConfig(preset="small"))
    cfg = load_config(None, ["model.preset=small", "lora.rank=8"])
    line = describe(m, cfg.lora, "float32", cfg.optim)
    trainable = m.n_layers * 8 * ((256 + 256) + (256 + 128))  # q: 256 -> 256, v: 256 -> 128 (4 kv heads of 32)
    assert adapter_parameters(m, 8, ["q", "v"]) == trainable
    total = count_parameters(m)
    assert f"{trainable / 1e3:.2f}K trainable / {total / 1e6:.2f}M frozen parameters " \
           f"({trainable / (trainable + total):.2%} of all)" in line
    assert f"optimizer state {8 * trainable / 2**10:.1f} KiB instead of {8 * total / 2**20:.1f} MiB" in line
    assert "on q,v" in line
    half = describe(m, cfg.lora, "bfloat16", cfg.optim)  # float32 moments and masters
    assert f"optimizer state {12 * trainable / 2**10:.1f} KiB" in half
    m7 = resolve_model(ModelConfig(preset="llama-2-7b"))
    assert "4.19M trainable" in describe(m7, cfg.lora, "float32", cfg.optim)  # PEFT: 4,194,304 for r=8 on q, v


def test_mfu_counts_four_flops_per_frozen_parameter_and_six_per_adapter():
    from hpctrain.config.arithmetic import adapter_parameters, block_matmul_parameters, flops_per_token

    m = resolve_model(load_config(None, ["model.preset=llama-2-7b"]).model)
    matmul = m.n_layers * block_matmul_parameters(m) + m.vocab_size * m.d_model
    full, lora = flops_per_token(m, 4096), flops_per_token(m, 4096, 8, ["q", "v"])
    assert full - lora == 2.0 * matmul - 6.0 * adapter_parameters(m, 8, ["q", "v"]) > 0.3 * full
