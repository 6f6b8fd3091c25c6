"""Unit tests for hpctrain.config: TOML loading, overrides, validation, presets, round trips."""
import contextlib
import json
import os
import pathlib
import tomllib

import pytest

from hpctrain.config import (PRESETS, CheckpointConfig, Config, ConfigError, ModelConfig, apply_overrides,
                             config_from_dict, config_to_dict, load_config, resolve_model, validate)
from hpctrain.errors import HpcTrainError

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def write_toml(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


@contextlib.contextmanager
def raises_naming(*fragments):
    """Expect a ConfigError whose message contains each fragment."""
    with pytest.raises(ConfigError) as info:
        yield info
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_defaults_validate():
    cfg = load_config(None)
    assert cfg == Config()
    validate(cfg)
    assert cfg.parallel.stage_layers == [] and cfg.checkpoint.async_ is True


def test_config_error_is_value_error_and_user_error():
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, HpcTrainError)


def test_default_lists_are_not_shared():
    a, b = Config(), Config()
    a.parallel.stage_layers.append(1)
    assert b.parallel.stage_layers == []


def test_toml_load(tmp_path):
    path = write_toml(tmp_path, """
[model]
preset = "small"
[parallel]
tp = 2
stage_layers = [4, 2]
pp = 2
[optim]
grad_clip = 2      # int accepted for a float field
[checkpoint]
async = false
""")
    cfg = load_config(path)
    assert cfg.model.preset == "small" and cfg.parallel.tp == 2 and cfg.parallel.stage_layers == [4, 2]
    assert cfg.optim.grad_clip == 2.0 and type(cfg.optim.grad_clip) is float
    assert cfg.checkpoint.async_ is False
    assert cfg.train == Config().train  # untouched sections keep defaults


def test_int_for_float_is_converted():
    cfg = config_from_dict({"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float


@pytest.mark.parametrize("name", ["tiny.toml", "small.toml"])
def test_shipped_configs_load_every_key_they_set(name):
    """Each key of the shipped file arrives with its value; every other key keeps its default."""
    path = CONFIGS / name
    cfg = load_config(str(path))
    validate(cfg)
    with open(path, "rb") as f:
        written = tomllib.load(f)
    loaded, defaults = config_to_dict(cfg), config_to_dict(Config())
    assert written and all(set(table) <= set(loaded[section]) for section, table in written.items())
    for section, table in loaded.items():
        for key, value in table.items():
            expected = written.get(section, {}).get(key, defaults[section][key])
            same_type = type(value) is type(expected) or isinstance(value, float)  # TOML ints for float keys
            assert value == expected and same_type, (section, key, value, expected)


def test_tiny_config_is_the_readme_demo():
    cfg = load_config(str(CONFIGS / "tiny.toml"))
    assert (cfg.model.preset, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == ("tiny", 2, 2, 0)
    assert (cfg.parallel.schedule, cfg.parallel.microbatches) == ("1f1b", 4)
    assert (cfg.train.steps, cfg.train.global_batch, cfg.train.seq_len, cfg.train.lr) == (100, 8, 64, 3e-3)
    assert cfg.train.run_dir == "runs/tiny"


def test_small_config_uses_small_preset():
    assert load_config(str(CONFIGS / "small.toml")).model.preset == "small"


@pytest.mark.parametrize("override, section, attr, expected", [
    ("parallel.tp=4", "parallel", "tp", 4),
    ("train.lr=1e-4", "train", "lr", 1e-4),
    ("optim.momentum=1", "optim", "momentum", 1.0),
    ("train.dtype=bfloat16", "train", "dtype", "bfloat16"),
    ("train.run_dir='runs/x y'", "train", "run_dir", "runs/x y"),
    ("data.source=", "data", "source", ""),
    ("train.recompute=true", "train", "recompute", True),
    ("train.recompute=YES", "train", "recompute", True),
    ("train.progress=0", "train", "progress", False),
    ("train.progress=no", "train", "progress", False),
    ("parallel.stage_layers=2,2", "parallel", "stage_layers", [2, 2]),
    ("parallel.stage_layers=[3, 1]", "parallel", "stage_layers", [3, 1]),
    ("parallel.stage_layers=[]", "parallel", "stage_layers", []),
    ("checkpoint.async=false", "checkpoint", "async_", False),
    ("checkpoint.async_=false", "checkpoint", "async_", False),
    ("--train.steps=7", "train", "steps", 7),
    (" train.steps = 7 ", "train", "steps", 7),
])
def test_override_each_type(override, section, attr, expected):
    base = Config()
    cfg = apply_overrides(base, [override])
    value = getattr(getattr(cfg, section), attr)
    assert value == expected and type(value) is type(expected)
    assert base == Config()  # the input is not modified


def test_overrides_apply_in_order_after_toml(tmp_path):
    path = write_toml(tmp_path, "[train]\nsteps = 3\n")
    cfg = load_config(path, ["train.steps=5", "train.steps=6", "model.preset=small"])
    assert cfg.train.steps == 6 and cfg.model.preset == "small"


def test_override_value_may_contain_equals():
    assert apply_overrides(Config(), ["data.source=a=b.txt"]).data.source == "a=b.txt"


@pytest.mark.parametrize("override, fragment", [
    ("parallel.tp=two", "parallel.tp"),
    ("parallel.tp=1.5", "parallel.tp"),
    ("train.lr=fast", "train.lr"),
    ("train.recompute=maybe", "train.recompute"),
    ("parallel.stage_layers=2,x", "parallel.stage_layers"),
    ("parallel.stage_layers=2,,2", "parallel.stage_layers"),
])
def test_override_bad_value(override, fragment):
    with raises_naming(fragment, "expected"):
        apply_overrides(Config(), [override])


@pytest.mark.parametrize("override", ["train.steps", "steps=5", ".steps=5", "train.=5", "=5"])
def test_malformed_override(override):
    with raises_naming("malformed override", repr(override)):
        apply_overrides(Config(), [override])


def test_unknown_section_override_suggests():
    with raises_naming("'trian'", "did you mean 'train'", "model, parallel"):
        apply_overrides(Config(), ["trian.steps=5"])


def test_unknown_key_override_lists_valid_keys():
    with raises_naming("train.stepz", "did you mean 'steps'", "global_batch"):
        apply_overrides(Config(), ["train.stepz=5"])


def test_unknown_section_in_toml(tmp_path):
    with raises_naming("'optimizer'", "valid sections"):
        load_config(write_toml(tmp_path, "[optimizer]\nname = 'sgd'\n"))


def test_unknown_key_in_toml(tmp_path):
    with raises_naming("model.dmodel", "did you mean 'd_model'", "n_layers"):
        load_config(write_toml(tmp_path, "[model]\ndmodel = 64\n"))


def test_checkpoint_valid_keys_spell_async():
    with raises_naming("checkpoint.asink", "'async'"):
        config_from_dict({"checkpoint": {"asink": True}})


@pytest.mark.parametrize("table, fragment", [
    ({"parallel": {"tp": "two"}}, "parallel.tp: expected int, got 'two'"),
    ({"parallel": {"tp": 2.0}}, "parallel.tp: expected int"),
    ({"parallel": {"tp": True}}, "parallel.tp: expected int"),
    ({"train": {"recompute": 1}}, "train.recompute: expected bool, got 1"),
    ({"train": {"recompute": "true"}}, "train.recompute: expected bool"),
    ({"train": {"lr": "0.1"}}, "train.lr: expected float"),
    ({"train": {"lr": False}}, "train.lr: expected float"),
    ({"train": {"run_dir": 5}}, "train.run_dir: expected str"),
    ({"parallel": {"stage_layers": 2}}, "parallel.stage_layers: expected list[int]"),
    ({"parallel": {"stage_layers": [2, 2.0]}}, "parallel.stage_layers: expected list[int]"),
    ({"checkpoint": {"async": "yes"}}, "checkpoint.async: expected bool"),
    ({"train": 5}, "train: expected a table"),
])
def test_wrong_type(table, fragment):
    with raises_naming(fragment):
        config_from_dict(table)


def test_wrong_type_in_toml_names_key_and_path(tmp_path):
    path = write_toml(tmp_path, '[parallel]\ntp = "two"\n')
    with raises_naming("config: parallel.tp: expected int, got 'two'", path):
        load_config(path)


def test_missing_file_names_path(tmp_path):
    path = str(tmp_path / "nope.toml")
    with raises_naming(path):
        load_config(path)


def test_invalid_toml_names_path_and_reason(tmp_path):
    path = write_toml(tmp_path, "[train\nsteps = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value) and "invalid TOML" in str(info.value)
    with pytest.raises(tomllib.TOMLDecodeError) as original:
        tomllib.loads("[train\nsteps = 1\n")
    assert str(original.value) in str(info.value)


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    path = tmp_path / "b.toml"
    path.write_bytes(b"\xff\xfe[train]\n")  # the file (a UTF-16 byte-order mark)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == (f"config: cannot read config file {path}: not UTF-8 text (byte 0xff at offset 0); "
                               f"TOML files are UTF-8"), str(info.value)
    assert info.value.everywhere


def test_every_unreadable_config_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    locked = tmp_path / "locked.toml"
    locked.write_text("[train]\nsteps = 1\n")
    locked.chmod(0)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[data]\nsource = "caf\u00e9.txt"\n'.encode("latin-1"))
    cases = [(tmp_path / "missing.toml", "No such file or directory"), (tmp_path / "dir.toml", "Is a directory"),
             (latin1, "not UTF-8 text (byte 0xe9 at offset 20)"), (write_toml(tmp_path, "[train\n"), "invalid TOML")]
    if os.geteuid() != 0:  # root reads a file of mode 000
        cases.append((locked, "Permission denied"))
    for path, reason in cases:
        with pytest.raises(ConfigError) as info:
            load_config(str(path))
        message = str(info.value)
        assert str(path) in message and reason in message and "\n" not in message, message


@pytest.mark.parametrize("override, fragment", [
    ("parallel.tp=0", "parallel.tp"),
    ("parallel.pp=0", "parallel.pp"),
    ("parallel.dp=-1", "parallel.dp"),
    ("parallel.microbatches=0", "parallel.microbatches"),
    ("parallel.schedule=zb", "parallel.schedule"),
    ("parallel.backend=gloo", "parallel.backend"),
    ("parallel.zero=4", "parallel.zero"),
    ("parallel.zero_prefetch=-1", "parallel.zero_prefetch"),
    ("parallel.bucket_mb=0", "parallel.bucket_mb"),
    ("parallel.pp=8", "parallel.pp"),
    ("parallel.stage_layers=2,2", "parallel.stage_layers"),  # pp=1 needs one entry
    ("model.preset=huge", "model.preset"),
    ("model.n_heads=3", "model.n_heads"),  # 64 % 3 != 0
    ("model.n_kv_heads=3", "model.n_kv_heads"),  # 4 % 3 != 0
    ("model.d_model=-8", "model.d_model"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("optim.name=lion", "optim.name"),
    ("optim.beta1=1", "optim.beta1"),
    ("optim.eps=0", "optim.eps"),
    ("optim.grad_clip=-1", "optim.grad_clip"),
    ("data.max_bytes=-1", "data.max_bytes"),
    ("train.steps=-1", "train.steps"),
    ("train.global_batch=0", "train.global_batch"),
    ("train.seq_len=0", "train.seq_len"),
    ("train.seq_len=512", "train.seq_len"),  # tiny max_seq_len is 256
    ("train.lr=0", "train.lr"),
    ("train.lr=nan", "train.lr"),
    ("train.dtype=int8", "train.dtype"),
    ("train.lr_schedule=step", "train.lr_schedule"),
    ("train.log_interval=0", "train.log_interval"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("checkpoint.writer=s3", "checkpoint.writer"),
])
def test_validate_rejects(override, fragment):
    with raises_naming(fragment):
        load_config(None, [override])


def test_validate_does_not_modify_config():
    cfg = Config()
    validate(cfg)
    assert cfg.model.d_model == 0


def test_valid_stage_layers_and_edge_values():
    cfg = load_config(None, ["parallel.pp=2", "parallel.stage_layers=3,1", "train.steps=0", "optim.grad_clip=0",
                             "parallel.zero=1", "parallel.schedule=gpipe", "parallel.backend=cuda-mpi"])
    p = cfg.parallel
    assert (p.pp, p.stage_layers, p.zero, p.schedule, p.backend) == (2, [3, 1], 1, "gpipe", "cuda-mpi")
    assert cfg.train.steps == 0 and cfg.optim.grad_clip == 0.0 and type(cfg.optim.grad_clip) is float
    assert cfg.model == Config().model and cfg.checkpoint == Config().checkpoint  # nothing else changed


def test_custom_preset_requires_every_size():
    with raises_naming("model.d_model", "> 0"):
        load_config(None, ["model.preset=custom"])
    sizes = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64)
    cfg = load_config(None, ["model.preset=custom"] + [f"model.{k}={v}" for k, v in sizes.items()])
    assert resolve_model(cfg.model).d_model == 32


def test_round_trip_dict():
    cfg = load_config(str(CONFIGS / "small.toml"), ["parallel.stage_layers=4,2", "checkpoint.async=false"])
    d = config_to_dict(cfg)
    assert set(d) == {"model", "parallel", "comm", "compression", "optim", "data", "train", "checkpoint", "lora",
                      "monitor", "moe"}
    assert "async" in d["checkpoint"] and "async_" not in d["checkpoint"] and d["checkpoint"]["async"] is False
    assert config_from_dict(d) == cfg
    d["parallel"]["stage_layers"].append(9)  # a plain copy, not shared with cfg
    assert cfg.parallel.stage_layers == [4, 2]


def test_to_dict_of_section_and_toml_round_trip(tmp_path):
    assert config_to_dict(CheckpointConfig(async_=False))["async"] is False
    lines = []
    for section, table in config_to_dict(Config()).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in table.items()
                  if v is not None]  # TOML has no null: a key left to the preset (tie_embeddings) is left out
    assert load_config(write_toml(tmp_path, "\n".join(lines).replace("'", '"'))) == Config()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_resolve_and_validate(preset):
    model = resolve_model(ModelConfig(preset=preset))
    for key, value in PRESETS[preset].items():  # the preset's vocabulary too: vocab_size defaults to 0
        assert getattr(model, key) == value
    assert model.mlp in ("swiglu", "gelu") and model.positions in ("rope", "learned")
    assert isinstance(model.tie_embeddings, bool) and model.rope_theta > 0
    validate(Config(model=ModelConfig(preset=preset)))


def test_preset_shapes():
    assert resolve_model(ModelConfig(preset="tiny")) == ModelConfig(
        preset="tiny", vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256, max_seq_len=256,
        tie_embeddings=False, rope_theta=10000.0, mlp="swiglu", positions="rope")
    small = resolve_model(ModelConfig(preset="small"))
    assert (small.d_model, small.n_layers, small.n_heads, small.n_kv_heads, small.d_ff, small.max_seq_len) == \
        (256, 6, 8, 4, 1024, 512)
    xl = resolve_model(ModelConfig(preset="gpt2-xl", vocab_size=0))
    assert (xl.d_model, xl.n_layers, xl.n_heads, xl.n_kv_heads, xl.d_ff, xl.max_seq_len, xl.vocab_size) == \
        (1600, 48, 25, 25, 6400, 1024, 50257)
    big = resolve_model(ModelConfig(preset="gpt3-175b"))
    assert (big.d_model, big.n_layers, big.n_heads, big.max_seq_len) == (12288, 96, 96, 2048)
    assert (big.vocab_size, big.d_ff, big.mlp, big.positions, big.tie_embeddings) == (50257, 49152, "gelu",
                                                                                      "learned", True)
    llama = resolve_model(load_config(None, ["model.preset=llama-3-8b"]).model)  # the real vocabulary, GQA, theta
    assert (llama.vocab_size, llama.n_kv_heads, llama.d_ff, llama.rope_theta, llama.mlp, llama.positions,
            llama.tie_embeddings) == (128256, 8, 14336, 500000.0, "swiglu", "rope", False)


def test_keys_given_win_over_the_preset():
    m = resolve_model(load_config(None, ["model.preset=gpt2-small", "model.tie_embeddings=false", "model.mlp=swiglu",
                                         "model.positions=rope", "model.vocab_size=256", "model.rope_theta=5e5"]).model)
    assert (m.tie_embeddings, m.mlp, m.positions, m.vocab_size, m.rope_theta, m.d_model) == (
        False, "swiglu", "rope", 256, 5e5, 768)
    tied = resolve_model(load_config(None, ["model.preset=llama-2-7b", "model.tie_embeddings=true"]).model)
    assert tied.tie_embeddings is True and tied.vocab_size == 32000


def test_custom_takes_the_defaults_of_the_non_size_keys():
    sizes = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64)
    m = resolve_model(load_config(None, ["model.preset=custom"] + [f"model.{k}={v}" for k, v in sizes.items()]).model)
    assert (m.vocab_size, m.tie_embeddings, m.rope_theta, m.mlp, m.positions) == (256, False, 10000.0, "swiglu",
                                                                                  "rope")


@pytest.mark.parametrize("override", ["model.mlp=relu", "model.positions=alibi"])
def test_unknown_mlp_or_positions_is_refused_by_name(override):
    with raises_naming(override.split("=")[0], "expected one of"):
        load_config(None, [override])


def test_a_run_config_json_with_tie_embeddings_left_to_the_preset_reads_back():
    cfg = load_config(None, ["model.preset=gpt2-small"])
    again = config_from_dict(json.loads(json.dumps(config_to_dict(cfg))))
    assert again == cfg and again.model.tie_embeddings is None


def test_resolve_keeps_explicit_sizes_and_copies():
    m = ModelConfig(preset="gpt2-small", n_layers=2)
    resolved = resolve_model(m)
    assert resolved.n_layers == 2 and resolved.d_model == 768 and m.d_model == 0


def test_resolve_unknown_preset():
    with raises_naming("model.preset", "'gpt4'"):
        resolve_model(ModelConfig(preset="gpt4"))


@pytest.mark.parametrize("override", ["train.lr=inf", "train.loss_scale=inf", "train.lr=nan", "optim.grad_clip=inf",
                                      "comm.timeout_s=inf"])
def test_non_finite_numbers_are_refused_by_name(override):
    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}.*finite"):
        validate(load_config(str(CONFIGS / "tiny.toml"), [override]))


def test_expert_parallelism_takes_every_zero_stage_and_refuses_compression():
    """ZeRO 0-3 with parallel.ep > 1: the experts' state (at ZeRO-3 their parameters too) sharded over their
    replicas; a compressed reduction still names both keys (the experts' gradients are summed uncompressed)."""
    moe = ["moe.num_experts=4", "parallel.ep=2"]
    for zero in (0, 1, 2, 3):
        assert load_config(None, moe + [f"parallel.zero={zero}"]).parallel.zero == zero  # validated
    with raises_naming("compression.method", "'topk' with parallel.ep=2", "compression.method='none'"):
        load_config(None, moe + ["compression.method=topk"])


@pytest.mark.parametrize("method", ["topk", "powersgd", "onebit-adam"])
def test_zero_two_and_three_refuse_compression_in_one_line(method):
    """Sharded gradients cannot be compressed: ZeRO 2/3 with a compression method names both keys."""
    for zero in (2, 3):
        with raises_naming("parallel.zero", f"compression.method={method!r}", "parallel.zero <= 1") as info:
            load_config(None, [f"parallel.zero={zero}", f"compression.method={method}"])
        assert "\n" not in str(info.value)
    load_config(None, ["parallel.zero=1", f"compression.method={method}", "compression.warmup_steps=2"])  # whole buckets
