"""Run configuration: dataclasses loaded from TOML, then ``section.key=value`` overrides.

    cfg = load_config("configs/tiny.toml", ["parallel.tp=2", "train.steps=10"])
    model = resolve_model(cfg.model)  # size fields left at 0 take the preset's value

The field ``CheckpointConfig.async_`` is spelled ``async`` in TOML, overrides and dicts.
"""
import copy
import dataclasses
import difflib
import math
import operator
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Iterable

from hpctrain.errors import HpcTrainError
from hpctrain.models.arithmetic import lora_target_shapes
from hpctrain.monitor.catalog import parse_labels
from hpctrain.models.presets import MODEL_DEFAULTS, PRESET_KEYS, PRESETS  # noqa: F401 (re-exported)
# the layout rules that need no world size
from hpctrain.parallel.rules import check_context, check_schedule, check_stages
from hpctrain.runtime.dtypes import DTYPE_NAMES


class ConfigError(HpcTrainError, ValueError):
    everywhere = True  # every rank reads and validates the same configuration

    """Invalid configuration; the message names the offending key."""


_COMPARISONS = {"min": (">=", operator.ge), "above": (">", operator.gt), "below": ("<", operator.lt),
                "max": ("<=", operator.le)}
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


# Upper bounds of the size keys, far beyond any model (they keep the arithmetic of a typo small); whether a
# model fits is checked against the memory of the ranks when a run starts (hpctrain/train/memory_check.py)
_SIZE_MAX = 1 << 24  # widths, vocabulary, sequence lengths, batch sizes
_COUNT_MAX = 1 << 14  # layers, heads, virtual stages


def _field(default: Any, **rule: Any) -> Any:
    """Dataclass field with a validation rule: choices=(...), min=x (>=), above=x (>), below=x (<), max=x (<=)."""
    return field(default=default, metadata=rule)


@dataclass
class ModelConfig:
    """Transformer model; keys left unset (0, "auto", not given) take the preset's value (see resolve_model)."""
    preset: str = _field("tiny", choices=(*PRESETS, "custom"))  # "custom": give every size explicitly
    vocab_size: int = _field(0, above=0, max=_SIZE_MAX)  # 0 = the preset's (custom: 256, byte-level tokens)
    vocab_multiple: int = _field(128, min=1, max=65536)  # embedding/LM head rows: vocab_size padded to a multiple of this x tp
    d_model: int = _field(0, above=0, max=_SIZE_MAX)
    n_layers: int = _field(0, above=0, max=_COUNT_MAX)
    n_heads: int = _field(0, above=0, max=_COUNT_MAX)
    n_kv_heads: int = _field(0, above=0, max=_COUNT_MAX)
    d_ff: int = _field(0, above=0, max=_SIZE_MAX)
    max_seq_len: int = _field(0, above=0, max=_SIZE_MAX)
    tie_embeddings: bool | None = None  # None = the preset's (custom: false)
    rope_theta: float = _field(0.0, above=0)  # 0 = the preset's (custom: 10000)
    mlp: str = _field("auto", choices=("auto", "swiglu", "gelu"))  # auto = the preset's (custom: swiglu)
    positions: str = _field("auto", choices=("auto", "rope", "learned"))  # auto = the preset's (custom: rope)
    norm_eps: float = _field(1e-5, above=0)
    init_std: float = _field(0.02, above=0)
    attention_window: int = _field(0, min=0)  # sliding-window attention: token t sees t-W+1..t; 0 = full causal
    init_from: str = ""  # HF Llama dir or hpctrain checkpoint: its weights at step 0 (not on resume); "" = random
    fused_head_loss: bool = True  # last stage: LM head + cross-entropy in loss chunks (false: full logits)
    loss_chunk_tokens: int = _field(0, min=0)  # tokens per loss chunk of the fused head + loss; 0 = automatic
    residual_dtype: str = _field("auto", choices=("auto", "float32"))  # float32: a half run's residual stream in float32


@dataclass
class ParallelConfig:
    """Process grid and communication settings."""
    dp: int = _field(0, min=0)  # 0 = world / (tp * pp * cp)
    tp: int = _field(1, min=1)
    pp: int = _field(1, min=1)
    cp: int = _field(1, min=1)  # context parallelism: ranks sharing each sequence (ring attention)
    schedule: str = _field("1f1b", choices=("gpipe", "1f1b", "interleaved"))
    virtual_stages: int = _field(1, min=1, max=_COUNT_MAX)  # virtual stages per pp rank (interleaved: >= 2)
    microbatches: int = _field(1, min=1, max=_SIZE_MAX)
    sequence_parallel: bool = False
    zero: int = _field(0, choices=(0, 1))
    bucket_mb: float = _field(25.0, above=0)
    stage_layers: list[int] = field(default_factory=list)  # layers per pp stage; empty = balanced
    strict_placement: bool = False
    backend: str = _field("auto", choices=("auto", "mpi", "cuda-mpi", "nccl"))


@dataclass
class CommConfig:
    """Communication watchdog and debugging ($HPCTRAIN_COMM_TIMEOUT, when set, overrides timeout_s)."""
    timeout_s: float = _field(600.0, min=0)  # a call older than this ends the job with a hang report; 0 = off
    check: bool = False  # debug: every collective's op, size and dtype compared across its group first
    # the dp group's CPU float sums through the node's shared-memory window (hpctrain/comm/intra_node.py)
    intra_node: str = _field("auto", choices=("auto", "shm", "mpi"))
    shm_progress: str = _field("call", choices=("call", "thread"))  # when a shm reduction runs (intra_node.py)


@dataclass
class CompressionConfig:
    """Gradient compression of the data-parallel reduction (docs/compression.md)."""
    method: str = _field("none", choices=("none", "fp16", "bf16", "int8", "topk", "randomk", "powersgd",
                                          "onebit", "zfp", "onebit-adam"))
    density: float = _field(0.01, above=0, max=1)  # topk/randomk: fraction of elements sent
    rank: int = _field(4, min=1)  # powersgd: rank of the low-rank approximation
    error_feedback: bool = True  # add what compression dropped to the next step's gradient
    warmup_steps: int = _field(0, min=0)  # dense steps before compression starts (onebit-adam: > 0)
    scope: str = _field("all", choices=("all", "inter-node"))  # inter-node: dense inside a node
    min_numel: int = _field(0, min=0)  # buckets (powersgd: matrices) with fewer elements go dense
    zfp_rate: float = _field(8.0, above=0, max=32)  # zfp: bits per value (fixed-rate mode)


@dataclass
class OptimConfig:
    """Optimizer hyperparameters (learning rate and schedule live in TrainConfig)."""
    name: str = _field("adamw", choices=("adamw", "sgd"))
    beta1: float = _field(0.9, min=0, below=1)
    beta2: float = _field(0.95, min=0, below=1)
    eps: float = _field(1e-8, above=0)
    weight_decay: float = _field(0.1, min=0)
    momentum: float = _field(0.0, min=0)
    grad_clip: float = _field(1.0, min=0)  # 0 = off


@dataclass
class DataConfig:
    """Corpus: "builtin" (embedded) or a path to a text file, folder, .npy or .h5."""
    source: str = "builtin"
    tokenizer: str = "bytes"  # or a tokenizer.json (hpctrain data train-tokenizer); needs a prepared corpus
    valid_fraction: float = _field(0.0, min=0, below=1)  # held out for validation (the corpus's last part)
    cache_dir: str = ""  # empty = default cache
    max_bytes: int = _field(0, min=0)  # 0 = no cap


@dataclass
class TrainConfig:
    """Training loop, precision, learning-rate schedule and logging."""
    steps: int = _field(50, min=0)
    seed: int = _field(1234, min=0)
    dtype: str = _field("float32", choices=DTYPE_NAMES)
    global_batch: int = _field(8, min=1, max=_SIZE_MAX)  # sequences per step
    micro_batch_size: int = _field(0, min=0, max=_SIZE_MAX)  # sequences per forward per replica; 0 = global_batch/dp/microbatches
    seq_len: int = _field(64, min=1, max=_SIZE_MAX)
    lr: float = _field(3e-3, above=0)
    min_lr: float = _field(3e-4, min=0)
    warmup_steps: int = _field(5, min=0)
    lr_schedule: str = _field("cosine", choices=("cosine", "constant", "linear"))
    recompute: bool = False
    # torch.compile of each block (hpctrain/models/compile.py); TOML true/false are read as "true"/"false"
    compile: str = _field("false", choices=("false", "true", "auto"))  # auto: on for CUDA devices
    log_interval: int = _field(1, min=1)
    peak_tflops: float = _field(0.0, min=0)  # device peak per rank for MFU; 0 = the GPU's preset, else unknown
    device: str = _field("auto", choices=("auto", "cpu", "cuda"))  # auto: this rank's GPU if any, else CPU
    allow_tf32: bool = True  # TF32 tensor cores for float32 matmuls on NVIDIA GPUs
    exit_signals: list[str] = field(default_factory=lambda: ["USR1", "TERM"])  # stop, save, requeue/exit 75
    time_limit_s: float = _field(0.0, min=0)  # stop (and save) before this many seconds; 0 = the scheduler's
    time_limit_margin_s: float = _field(60.0, above=0)  # time kept for the final save until one is measured
    requeue: str = _field("auto", choices=("auto", "never"))  # auto: scontrol requeue on a signal/time stop
    loss_scale: float = _field(65536.0, above=0)  # initial dynamic loss scale for float16
    nonfinite: str = _field("stop", choices=("stop", "skip"))  # a non-finite loss/grad norm: stop (exit 4, nothing saved) or skip the step
    max_skipped_steps: int = _field(20, min=1)  # consecutive skipped steps before the run stops (float16 overflow: at scale 1)
    run_dir: str = "runs/default"
    progress: bool = True
    eval_interval: int = _field(0, min=0)  # steps between validation losses (needs data.valid_fraction); 0 = off
    eval_steps: int = _field(4, min=1)  # global batches per validation (the same ones every time)
    trace: bool = False  # per-rank Chrome trace of phases and collectives in <run_dir>/trace/ (hpctrain trace)
    trace_steps: int = _field(5, min=1)  # steps traced, from the second step of the run on


@dataclass
class CheckpointConfig:
    """Checkpointing; the field ``async_`` is the key ``async``."""
    interval: int = _field(0, min=0)  # steps between saves; 0 = only at end / preemption
    keep: int = _field(3, min=1)
    async_: bool = True
    writer: str = _field("auto", choices=("auto", "mpio", "shards"))
    dir: str = ""  # empty = <run_dir>/checkpoints


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # attention q/k/v/o, the MLP's gate/up/down


@dataclass
class LoraConfig:
    """Low-rank adapters on a frozen model (LoRA, as Hugging Face PEFT; docs/models-and-data.md)."""
    rank: int = _field(0, min=0)  # adapter rank r; 0 = off (every weight trains)
    alpha: float = _field(8.0, above=0)  # PEFT's lora_alpha: the adapter's output is scaled by alpha / rank
    dropout: float = _field(0.0, min=0, below=1)  # dropout on the adapter's input (PEFT's lora_dropout)
    targets: list[str] = field(default_factory=lambda: ["q", "v"])  # linears that get adapters: LORA_TARGETS
    init: str = _field("peft", choices=("peft",))  # A Kaiming-uniform, B zero (PEFT's init_lora_weights=True)
    checkpoint_base: str = _field("reference", choices=("reference", "copy"))  # frozen base in checkpoints


@dataclass
class MonitorConfig:
    """Live monitoring: Prometheus metrics, TensorBoard, per-rank straggler gathering (docs/monitoring.md)."""
    prometheus_port: int = _field(0, min=0, max=65535)  # rank 0 serves /metrics there; 0 = no server
    prometheus_addr: str = "127.0.0.1"  # the address it binds (0.0.0.0: every interface)
    prometheus_textfile: str = ""  # a *.prom file for node_exporter's textfile collector; "" = none
    labels: list[str] = field(default_factory=list)  # extra constant labels, "name=value"
    tensorboard: bool = False  # event files under <run_dir>/tensorboard/ (rank 0)
    interval: int = _field(0, min=0)  # steps between per-rank gathers and textfile writes; 0 = train.log_interval


@dataclass
class Config:
    """The whole run configuration, one attribute per TOML section."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


def _error(where: str, detail: str) -> ConfigError:
    return ConfigError(f"config: {where}: {detail}")


def _key(f: dataclasses.Field) -> str:  # TOML/override spelling: async_ -> async
    return f.name.rstrip("_")


def _unknown(kind: str, name: str, valid: list[str], scope: str = "") -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}; valid {kind}s{scope}: {', '.join(valid)}"


def _section_class(section: str) -> type:
    classes = {f.name: f.type for f in dataclasses.fields(Config)}
    if section not in classes:
        raise ConfigError("config: " + _unknown("section", section, list(classes)))
    cls = classes[section]
    assert isinstance(cls, type)  # a class, not a string: this module does not postpone annotations
    return cls


def _section_field(section: str, key: str) -> dataclasses.Field:
    """The field behind ``section.key``; the Python spelling (``async_``) is accepted too."""
    fields = dataclasses.fields(_section_class(section))
    for f in fields:
        if key in (_key(f), f.name):
            return f
    raise _error(f"{section}.{key}", _unknown("key", key, [_key(f) for f in fields], f" of [{section}]"))


_OPTIONAL_BOOL = bool | None  # a bool whose None means "the preset's" (TOML and overrides give true/false)


def _type_name(ftype: Any) -> str:
    if ftype == _OPTIONAL_BOOL:
        return "bool"
    return str(ftype) if ftype in (list[int], list[str]) else ftype.__name__


def _checked_value(where: str, value: Any, ftype: Any) -> Any:
    """A value from TOML or a dict, type-checked against the field type (int is fine for float)."""
    if ftype == _OPTIONAL_BOOL:
        ftype = bool
        if value is None:  # a config.json of a run whose key was left to the preset
            return None
    if (ftype in (bool, str) and isinstance(value, ftype)) or (ftype is int and type(value) is int):
        return value
    if ftype is float and type(value) in (int, float):
        return float(value)
    if ftype == list[int] and isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
        return list(value)
    if ftype == list[str] and isinstance(value, (list, tuple)) and all(type(v) is str for v in value):
        return list(value)
    raise _error(where, f"expected {_type_name(ftype)}, got {value!r}")


def _bool_choice(value: Any, f: dataclasses.Field) -> Any:
    """A TOML boolean for a str key whose choices are "true"/"false"/... (``train.compile = true``) -> its word."""
    if type(value) is bool and f.type is str and "true" in f.metadata.get("choices", ()):
        return "true" if value else "false"
    return value


def _parsed_value(where: str, text: str, ftype: Any) -> Any:
    """A value parsed from override text by the field type."""
    s = text.strip()
    ftype = bool if ftype == _OPTIONAL_BOOL else ftype
    try:
        if ftype is bool and s.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[s.lower()]
        if ftype is int or ftype is float:
            return ftype(s)
        if ftype is str:
            return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s  # unquote
        if ftype in (list[int], list[str]):
            inner = s[1:-1] if s.startswith("[") and s.endswith("]") else s
            parts = [part.strip().strip("'\"") for part in inner.split(",")] if inner.strip() else []
            return [int(part) for part in parts] if ftype == list[int] else parts
    except ValueError:
        pass
    raise _error(where, f"expected {_type_name(ftype)}, got {text!r}")


def config_from_dict(d: dict) -> Config:
    """Build a Config from nested plain dicts; missing sections and keys keep their defaults."""
    sections = {}
    for section, table in d.items():
        section_cls = _section_class(section)
        if not isinstance(table, dict):
            raise _error(section, f"expected a table of keys, got {table!r}")
        kwargs = {}
        for key, value in table.items():
            f = _section_field(section, key)
            kwargs[f.name] = _checked_value(f"{section}.{key}", _bool_choice(value, f), f.type)
        sections[section] = section_cls(**kwargs)
    return Config(**sections)


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict of a Config (flat dict of a single section), with TOML key spelling."""
    if not isinstance(cfg, Config):
        return {_key(f): copy.copy(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(Config)}


def apply_overrides(cfg: Config, overrides: Iterable[str]) -> Config:
    """A copy of cfg with each ``section.key=value`` applied in order (a leading ``--`` is allowed)."""
    cfg = copy.deepcopy(cfg)
    for item in overrides or ():
        path, has_equals, text = item.partition("=")
        section, has_dot, key = path.strip().lstrip("-").partition(".")
        if not (has_equals and has_dot and section and key):
            raise ConfigError(f"config: malformed override {item!r}: expected section.key=value")
        f = _section_field(section, key)
        setattr(getattr(cfg, section), f.name, _parsed_value(f"{section}.{key}", text, f.type))
    return cfg


def load_config(path: str | None, overrides: Iterable[str] = ()) -> Config:
    """Defaults, then the TOML file at path (None: none), then overrides; validated."""
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as fh:
                cfg = config_from_dict(tomllib.load(fh))
        except OSError as exc:
            raise ConfigError(f"config: cannot read config file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:  # TOML is UTF-8 text
            raise ConfigError(f"config: cannot read config file {path}: not UTF-8 text (byte "
                              f"0x{exc.object[exc.start]:02x} at offset {exc.start}); TOML files are UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config: invalid TOML in {path}: {exc}") from None
        except ConfigError as exc:
            raise ConfigError(f"{exc} (in {path})") from None
    cfg = apply_overrides(cfg, overrides)
    if cfg.data.tokenizer != "bytes" and cfg.data.tokenizer and not os.path.isabs(cfg.data.tokenizer):
        # the run's config.json is read later from other directories (generate, export): keep it findable
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)
    validate(cfg)
    return cfg


# The keys that define the function a model computes (and its weights' shapes): two configs that agree on
# these hold interchangeable weights (init_std, init_from, preset and vocab_multiple, the padding of the true
# vocab_size, do not matter; max_seq_len only with learned positions: the rows of their table).
ARCHITECTURE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings",
                     "rope_theta", "norm_eps", "mlp", "positions", "attention_window")


def architecture(m: ModelConfig) -> dict[str, Any]:
    """{key: value} of m's architecture keys, resolved (+ max_seq_len with learned positions)."""
    r = resolve_model(m)
    keys = ARCHITECTURE_KEYS + (("max_seq_len",) if r.positions == "learned" else ())
    return {k: getattr(r, k) for k in keys}


def architecture_differences(theirs: ModelConfig | dict, ours: ModelConfig | dict) -> list[str]:
    """``model.KEY is X there, Y here`` for each architecture key on which two models differ (model configs,
    resolved here, or ``architecture`` dicts, e.g. a checkpoint's)."""
    a = theirs if isinstance(theirs, dict) else architecture(theirs)
    b = ours if isinstance(ours, dict) else architecture(ours)
    keys = list(b) + [k for k in a if k not in b]
    return [f"model.{k} is {a.get(k)!r} there, {b.get(k)!r} here" for k in keys if a.get(k) != b.get(k)]


def resolve_model(m: ModelConfig) -> ModelConfig:
    """A copy of m with every key left unset taken from its preset, else MODEL_DEFAULTS ("custom": sizes none)."""
    if m.preset not in PRESETS and m.preset != "custom":
        raise _error("model.preset", _unknown("preset", m.preset, [*PRESETS, "custom"]))
    given = {**MODEL_DEFAULTS, **PRESETS.get(m.preset, {})}
    filled = {k: v for k, v in given.items() if _unset(getattr(m, k))}
    return dataclasses.replace(m, **filled)


def _unset(value: Any) -> bool:
    """A model key left for the preset: 0 (sizes, rope_theta), "auto" (mlp, positions), None (tie_embeddings)."""
    return value is None or value == "auto" or (type(value) in (int, float) and value == 0)


def _require(ok: bool, where: str, detail: str) -> None:
    if not ok:
        raise _error(where, detail)


def _check_rules(section: str, obj: Any) -> None:
    """Apply each field's ``_field`` rule to its value in obj."""
    for f in dataclasses.fields(obj):
        value, rule, where = getattr(obj, f.name), f.metadata, f"{section}.{_key(f)}"
        if isinstance(value, float):  # inf and nan pass every comparison rule below (or none)
            _require(math.isfinite(value), where, f"must be a finite number, got {value}")
        if "choices" in rule:
            choices = ", ".join(map(str, rule["choices"]))
            _require(value in rule["choices"], where, f"expected one of {choices}, got {value!r}")
        for name, (symbol, holds) in _COMPARISONS.items():
            if name in rule:
                _require(holds(value, rule[name]), where, f"must be {symbol} {rule[name]}, got {value}")


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first bad value; cfg itself is not modified."""
    m = resolve_model(cfg.model)
    for f in dataclasses.fields(Config):
        _check_rules(f.name, m if f.name == "model" else getattr(cfg, f.name))
    _require(m.d_model % m.n_heads == 0, "model.n_heads", f"d_model={m.d_model} not divisible by n_heads={m.n_heads}")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"n_heads={m.n_heads} not divisible by n_kv_heads={m.n_kv_heads}")
    p, t = cfg.parallel, cfg.train
    try:
        if t.micro_batch_size == 0:  # else the micro-batches need dp: Layout.from_config checks the schedule
            check_schedule(m, p.schedule, p.pp, p.virtual_stages, p.microbatches)
        check_stages(m, p.pp, p.stage_layers, p.virtual_stages)
        check_context(m, t.seq_len, p.cp)
    except HpcTrainError as exc:
        raise ConfigError(f"config: {exc}") from None
    _require(t.seq_len <= m.max_seq_len, "train.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    _require(cfg.data.source != "", "data.source", 'must be "builtin" or a path, got ""')
    _require(t.run_dir != "", "train.run_dir", "must not be empty")
    _require(t.eval_interval == 0 or cfg.data.valid_fraction > 0, "train.eval_interval",
             f"{t.eval_interval} needs held-out data: set data.valid_fraction (e.g. 0.05)")
    if cfg.lora.rank:
        _check_lora(cfg.lora, m)
    _check_onebit_adam(cfg.compression, cfg.optim)
    _check_monitor(cfg.monitor)


def _check_onebit_adam(comp: CompressionConfig, optim: OptimConfig) -> None:
    """1-bit Adam compresses AdamW's momentum and freezes its variance after a dense warm-up."""
    if comp.method != "onebit-adam":
        return
    _require(optim.name == "adamw", "compression.method",
             f"'onebit-adam' compresses AdamW's momentum: it needs optim.name='adamw', got {optim.name!r}")
    _require(comp.warmup_steps > 0, "compression.warmup_steps",
             "must be > 0 with compression.method='onebit-adam' (its dense AdamW steps: with 0 the variance "
             "would freeze at its initial zeros)")


def _check_monitor(mon: MonitorConfig) -> None:
    """Label names Prometheus accepts (not hpctrain's own); a textfile node_exporter reads (``*.prom``)."""
    try:
        parse_labels(mon.labels)
    except ValueError as exc:
        raise _error("monitor.labels", str(exc).removeprefix("monitor.labels: ")) from None
    _require(not mon.prometheus_textfile or mon.prometheus_textfile.endswith(".prom"), "monitor.prometheus_textfile",
             f"{mon.prometheus_textfile!r} must end in .prom (node_exporter's textfile collector reads only *.prom)")


def _check_lora(lora: LoraConfig, m: ModelConfig) -> None:
    """lora.targets name linears of this model, once each; lora.rank fits every target's matrix."""
    shapes = lora_target_shapes(m)
    _require(bool(lora.targets), "lora.targets", f"must name at least one of {', '.join(shapes)} when lora.rank > 0")
    for name in lora.targets:
        _require(name in shapes, "lora.targets", _unknown("target", name, list(shapes), f" of this model "
                                                          f"(model.mlp={m.mlp})"))
    _require(len(set(lora.targets)) == len(lora.targets), "lora.targets", f"names a target twice: {lora.targets}")
    smallest = min(lora.targets, key=lambda name: min(shapes[name]))
    _require(lora.rank <= min(shapes[smallest]), "lora.rank",
             f"{lora.rank} exceeds the dimensions of target {smallest!r} (in {shapes[smallest][0]}, out "
             f"{shapes[smallest][1]}): at most {min(shapes[smallest])}")
