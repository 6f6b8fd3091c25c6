"""Bad values of the recently added keys (parallel.cp, parallel.virtual_stages, model.vocab_multiple, model.mlp,
model.positions, lora.*, monitor.*, compression.*, train.micro_batch_size): each is refused in ONE line that
names the key, as an error every rank raises alike (printed once, exit 2), at load time or, for the rules
that need the world size, by ``Layout.from_config``. End to end on 2 ranks: tests/mpi/test_bad_input.py."""
import pytest

from hpctrain.config import load_config
from hpctrain.errors import HpcTrainError
from hpctrain.config.layout import Layout

TINY = ["model.n_layers=4"]  # the defaults: tiny preset, seq_len 64, global_batch 8

CASES = [  # (overrides, world size or None for load-time, the key the line must name, a fragment)
    (["parallel.cp=0"], None, "parallel.cp", "must be >= 1"),
    (["parallel.cp=-2"], None, "parallel.cp", "must be >= 1"),
    (["parallel.cp=two"], None, "parallel.cp", "expected int"),
    (["parallel.cp=1.5"], None, "parallel.cp", "expected int"),
    (["parallel.cp=3"], None, "parallel.cp", "divisible"),  # seq_len 64 not a multiple of 2 x 3
    (["parallel.cp=64"], None, "parallel.cp", "divisible"),
    (["parallel.cp=2"], 3, "parallel.cp", "not divisible"),  # world 3
    (["parallel.cp=2", "model.attention_window=100"], None, "model.attention_window", "seq_len"),
    (["parallel.virtual_stages=0"], None, "parallel.virtual_stages", "must be >= 1"),
    (["parallel.virtual_stages=2"], None, "parallel.virtual_stages", "interleaved"),
    (["parallel.virtual_stages=99999"], None, "parallel.virtual_stages", "must be <= 16384"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=1", "parallel.pp=2"], None,
     "parallel.virtual_stages", ">= 2"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.pp=1"], None, "parallel.pp", ">= 2"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=4", "parallel.pp=2"], None,
     "parallel.virtual_stages", "model.n_layers=4"),
    (["parallel.virtual_stages=x"], None, "parallel.virtual_stages", "expected int"),
    (["model.vocab_multiple=0"], None, "model.vocab_multiple", "must be >= 1"),
    (["model.vocab_multiple=-128"], None, "model.vocab_multiple", "must be >= 1"),
    (["model.vocab_multiple=1000000000"], None, "model.vocab_multiple", "must be <= 65536"),
    (["model.vocab_multiple=12.5"], None, "model.vocab_multiple", "expected int"),
    (["model.vocab_size=100000000"], None, "model.vocab_size", "must be <= 16777216"),
    (["model.d_model=99999999999"], None, "model.d_model", "must be <= 16777216"),
    (["model.n_layers=100000"], None, "model.n_layers", "must be <= 16384"),
    (["model.n_heads=100000", "model.n_kv_heads=100000"], None, "model.n_heads", "must be <= 16384"),
    (["model.d_ff=1000000000"], None, "model.d_ff", "must be <= 16777216"),
    (["model.max_seq_len=1000000000"], None, "model.max_seq_len", "must be <= 16777216"),
    (["model.mlp=relu"], None, "model.mlp", "expected one of auto, swiglu, gelu"),
    (["model.mlp="], None, "model.mlp", "expected one of"),
    (["model.mlp=SwiGLU"], None, "model.mlp", "expected one of"),
    (["model.positions=alibi"], None, "model.positions", "expected one of auto, rope, learned"),
    (["model.positions="], None, "model.positions", "expected one of"),
    (["model.residual_dtype=bfloat16"], None, "model.residual_dtype", "expected one of auto, float32"),
    (["lora.rank=-1"], None, "lora.rank", "must be >= 0"),
    (["lora.rank=100000"], None, "lora.rank", "exceeds the dimensions"),
    (["lora.rank=r"], None, "lora.rank", "expected int"),
    (["lora.rank=4", "lora.alpha=0"], None, "lora.alpha", "must be > 0"),
    (["lora.rank=4", "lora.alpha=-8"], None, "lora.alpha", "must be > 0"),
    (["lora.rank=4", "lora.alpha=nan"], None, "lora.alpha", "finite"),
    (["lora.rank=4", "lora.alpha=inf"], None, "lora.alpha", "finite"),
    (["lora.dropout=1"], None, "lora.dropout", "must be < 1"),
    (["lora.dropout=-0.1"], None, "lora.dropout", "must be >= 0"),
    (["lora.rank=4", "lora.targets=[]"], None, "lora.targets", "at least one"),
    (["lora.rank=4", "lora.targets=[q,q]"], None, "lora.targets", "twice"),
    (["lora.rank=4", "lora.targets=[qkv]"], None, "lora.targets", "unknown target"),
    (["lora.rank=4", "model.mlp=gelu", "lora.targets=[gate]"], None, "lora.targets", "unknown target 'gate'"),
    (["lora.init=kaiming"], None, "lora.init", "expected one of peft"),
    (["lora.checkpoint_base=none"], None, "lora.checkpoint_base", "expected one of reference, copy"),
    (["lora.ranks=4"], None, "lora.ranks", "did you mean 'rank'"),
    (["monitor.prometheus_port=-1"], None, "monitor.prometheus_port", "must be >= 0"),
    (["monitor.prometheus_port=65536"], None, "monitor.prometheus_port", "must be <= 65535"),
    (["monitor.prometheus_port=http"], None, "monitor.prometheus_port", "expected int"),
    (["monitor.labels=[cluster]"], None, "monitor.labels", "NAME=VALUE"),
    (["monitor.labels=[1x=y]"], None, "monitor.labels", "NAME=VALUE"),
    (["monitor.labels=[__x=y]"], None, "monitor.labels", "NAME=VALUE"),
    (["monitor.labels=[a=b,a=c]"], None, "monitor.labels", "set twice"),
    (["monitor.labels=[rank=3]"], None, "monitor.labels", "hpctrain own"),
    (["monitor.prometheus_textfile=metrics.txt"], None, "monitor.prometheus_textfile", ".prom"),
    (["monitor.interval=-1"], None, "monitor.interval", "must be >= 0"),
    (["monitor.tensorboard=maybe"], None, "monitor.tensorboard", "expected bool"),
    (["compression.method=lz4"], None, "compression.method", "expected one of"),
    (["compression.density=0"], None, "compression.density", "must be > 0"),
    (["compression.density=1.5"], None, "compression.density", "must be <= 1"),
    (["compression.density=nan"], None, "compression.density", "finite"),
    (["compression.rank=0"], None, "compression.rank", "must be >= 1"),
    (["compression.warmup_steps=-1"], None, "compression.warmup_steps", "must be >= 0"),
    (["compression.scope=node"], None, "compression.scope", "expected one of all, inter-node"),
    (["compression.min_numel=-5"], None, "compression.min_numel", "must be >= 0"),
    (["compression.zfp_rate=0"], None, "compression.zfp_rate", "must be > 0"),
    (["compression.zfp_rate=33"], None, "compression.zfp_rate", "must be <= 32"),
    (["compression.error_feedback=sometimes"], None, "compression.error_feedback", "expected bool"),
    (["compression.method=onebit-adam"], None, "compression.warmup_steps", "must be > 0"),
    (["compression.method=onebit-adam", "compression.warmup_steps=5", "optim.name=sgd"], None,
     "compression.method", "optim.name='adamw'"),
    (["train.micro_batch_size=-1"], None, "train.micro_batch_size", "must be >= 0"),
    (["train.micro_batch_size=one"], None, "train.micro_batch_size", "expected int"),
    (["train.micro_batch_size=100000000"], None, "train.micro_batch_size", "must be <= 16777216"),
    (["train.micro_batch_size=3"], 2, "train.micro_batch_size", "not divisible"),  # 8 / (2 x 3)
    (["train.micro_batch_size=16"], 2, "train.micro_batch_size", "not divisible"),  # more than the batch
    (["train.micro_batch_size=2", "parallel.microbatches=4"], 2, "parallel.microbatches", "micro_batch_size"),
    (["train.seq_len=100000000"], None, "train.seq_len", "must be <= 16777216"),
    (["train.global_batch=100000000"], None, "train.global_batch", "must be <= 16777216"),
]


@pytest.mark.parametrize("overrides, world, key, fragment", CASES, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_a_bad_value_is_one_line_naming_the_key_raised_alike_everywhere(overrides, world, key, fragment):
    with pytest.raises(HpcTrainError) as info:
        cfg = load_config(None, TINY + overrides)
        assert world is not None, f"{overrides} was accepted at load time"
        Layout.from_config(cfg, world)
    message = str(info.value)
    assert "\n" not in message and key in message and fragment in message, (key, fragment, message)
    assert info.value.everywhere, message  # the same on every rank: printed once, exit 2
