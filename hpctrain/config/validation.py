"""Validation of a configuration: ``resolve_model`` fills the keys left to the preset, ``validate`` checks each
key's rule (``keys.key``) and the rules between keys; ``architecture`` names what a model's weights depend on.

    model = resolve_model(cfg.model)  # size fields left at 0 take the preset's value
"""
import dataclasses
import functools
import math
import operator
import signal
from typing import Any

from hpctrain.config.arithmetic import lora_target_shapes
from hpctrain.config.keys import ConfigError, error, key_name, unknown
from hpctrain.config.metric_names import parse_labels
from hpctrain.config.model_keys import LoraConfig, ModelConfig
from hpctrain.config.moe_keys import MoeConfig, moe_architecture, resolve_moe
from hpctrain.config.parallel_keys import CompressionConfig
from hpctrain.config.presets import MODEL_DEFAULTS, PRESETS
# the layout rules that need no world size
from hpctrain.config.rules import check_context, check_schedule, check_stages
from hpctrain.config.train_keys import MonitorConfig, OptimConfig
from hpctrain.config.tree import Config
from hpctrain.errors import HpcTrainError

_COMPARISONS = {"min": (">=", operator.ge), "above": (">", operator.gt), "below": ("<", operator.lt),
                "max": ("<=", operator.le)}


# The keys that define the function a model computes (and its weights' shapes): two configs that agree on
# these hold interchangeable weights (init_std, init_from, preset and vocab_multiple, the padding of the true
# vocab_size, do not matter; max_seq_len only with learned positions: the rows of their table).
ARCHITECTURE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings",
                     "rope_theta", "norm_eps", "mlp", "positions", "attention_window")


def architecture(m: ModelConfig, moe: MoeConfig | None = None) -> dict[str, Any]:
    """{key: value} of m's architecture keys, resolved (+ max_seq_len with learned positions; + the ``[moe]``
    section's ``moe.*`` architecture keys of a model with experts)."""
    r = resolve_model(m)
    keys = ARCHITECTURE_KEYS + (("max_seq_len",) if r.positions == "learned" else ())
    return {**{k: getattr(r, k) for k in keys}, **moe_architecture(resolve_moe(moe, r))}


def architecture_differences(theirs: ModelConfig | dict, ours: ModelConfig | dict) -> list[str]:  # dicts: with moe
    """``model.KEY is X there, Y here`` for each architecture key on which two models differ (model configs,
    resolved here, or ``architecture`` dicts, e.g. a checkpoint's)."""
    a = theirs if isinstance(theirs, dict) else architecture(theirs)
    b = ours if isinstance(ours, dict) else architecture(ours)
    keys = list(b) + [k for k in a if k not in b]
    return [f"{'' if k.startswith('moe.') else 'model.'}{k} is {a.get(k)!r} there, {b.get(k)!r} here"
            for k in keys if a.get(k) != b.get(k)]


def resolve_model(m: ModelConfig) -> ModelConfig:
    """A copy of m with every key left unset taken from its preset, else MODEL_DEFAULTS ("custom": sizes none)."""
    if m.preset not in PRESETS and m.preset != "custom":
        raise error("model.preset", unknown("preset", m.preset, [*PRESETS, "custom"]))
    given = {**MODEL_DEFAULTS, **PRESETS.get(m.preset, {})}
    filled = {k: v for k, v in given.items() if _unset(getattr(m, k))}
    return dataclasses.replace(m, **filled)


def _unset(value: Any) -> bool:
    """A model key left for the preset: 0 (sizes, rope_theta), "auto" (mlp, positions), None (tie_embeddings)."""
    return value is None or value == "auto" or (type(value) in (int, float) and value == 0)


def _require(ok: bool, where: str, detail: str) -> None:
    if not ok:
        raise error(where, detail)


def _rule_problems(section: str, obj: Any) -> list[ConfigError]:
    """Each field of obj whose value breaks its ``key`` rule, one error per field."""
    found = []
    for attr, name, choices, comparisons in _rules_of(type(obj)):  # type: ignore[arg-type]  # a class is hashable
        value = getattr(obj, attr)
        try:
            _check_rule(f"{section}.{name}", value, choices, comparisons)
        except ConfigError as exc:
            found.append(exc)
    return found


@functools.cache
def _rules_of(cls: Any) -> tuple:
    """(attribute, key name, choices or None, ((symbol, holds, bound), ...)) per field of a config section
    (its ``key`` rule read once: ``hpctrain plan`` checks thousands of candidate runs)."""
    return tuple((f.name, key_name(f), f.metadata.get("choices"),
                  tuple((symbol, holds, f.metadata[name]) for name, (symbol, holds) in _COMPARISONS.items()
                        if name in f.metadata))
                 for f in dataclasses.fields(cls))


def _check_rule(where: str, value: Any, choices: Any, comparisons: tuple) -> None:
    if isinstance(value, float) and not math.isfinite(value):  # inf and nan pass every comparison rule below
        raise error(where, f"must be a finite number, got {value}")
    if choices is not None and value not in choices:
        raise error(where, f"expected one of {', '.join(map(str, choices))}, got {value!r}")
    for symbol, holds, bound in comparisons:
        if not holds(value, bound):
            raise error(where, f"must be {symbol} {bound}, got {value}")


def key_problems(cfg: Config) -> list[ConfigError]:
    """Each key of cfg (the model's resolved from its preset) that breaks its own rule: the first phase of
    ``problems``; when it finds none, every value is in range for the rules between keys."""
    try:
        m = resolve_model(cfg.model)
    except ConfigError as exc:
        return [exc]
    return [e for f in dataclasses.fields(Config) for e in _rule_problems(f.name, m if f.name == "model"
                                                                          else getattr(cfg, f.name))]


def problems(cfg: Config) -> list[ConfigError]:
    """Every broken rule of cfg, in the order ``validate`` checks them (cfg itself is not modified): first each
    key against its own rule; only when every key is valid alone, the rules between keys, each group reported
    once (a group stops at its first broken rule: its later rules may depend on it). ``hpctrain check`` lists
    them all; ``validate`` (a run's start) raises the first."""
    found = key_problems(cfg)
    if found:
        return found
    m = resolve_model(cfg.model)
    p, t = cfg.parallel, cfg.train
    groups = (lambda: _check_heads(m), lambda: _check_pipeline(m, p, t),
              lambda: _require(t.seq_len <= m.max_seq_len, "train.seq_len",
                               f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}"),
              lambda: _check_run(cfg), lambda: _check_lora(cfg.lora, m) if cfg.lora.rank else None,
              lambda: _check_zero_compression(p.zero, cfg.compression.method),
              lambda: _check_moe(cfg.moe, m, p.ep), lambda: _check_experts_parallel(cfg.moe, m, p.ep,
                                                                                    cfg.compression.method),
              lambda: _check_onebit_adam(cfg.compression, cfg.optim), lambda: _check_local_tier(cfg.checkpoint),
              lambda: _check_monitor(cfg.monitor), lambda: _check_fp8(t), lambda: _check_update(cfg.optim, t))
    for group in groups:
        try:
            group()
        except ConfigError as exc:
            found.append(exc)
    return found


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first bad value (``problems`` lists them all); cfg itself is not modified."""
    found = problems(cfg)
    if found:
        raise found[0]


def _check_heads(m: ModelConfig) -> None:
    _require(m.d_model % m.n_heads == 0, "model.n_heads", f"d_model={m.d_model} not divisible by n_heads={m.n_heads}")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"n_heads={m.n_heads} not divisible by n_kv_heads={m.n_kv_heads}")


def _check_pipeline(m: ModelConfig, p, t) -> None:
    """The layout rules that need no world size (``rules.py``)."""
    try:
        if t.micro_batch_size == 0:  # else the micro-batches need dp: Layout.from_config checks the schedule
            check_schedule(m, p.schedule, p.pp, p.virtual_stages, p.microbatches)
        check_stages(m, p.pp, p.stage_layers, p.virtual_stages)
        check_context(m, t.seq_len, p.cp)
    except HpcTrainError as exc:
        raise ConfigError(f"config: {exc}") from None


def _check_run(cfg: Config) -> None:
    t = cfg.train
    _require(cfg.data.source != "", "data.source", 'must be "builtin" or a path, got ""')
    _require(t.run_dir != "", "train.run_dir", "must not be empty")
    _require(t.eval_interval == 0 or cfg.data.valid_fraction > 0, "train.eval_interval",
             f"{t.eval_interval} needs held-out data: set data.valid_fraction (e.g. 0.05)")
    for name in t.exit_signals:  # checked here, before anything is written, not when the handlers are installed
        _require(isinstance(getattr(signal, "SIG" + str(name).upper().removeprefix("SIG"), None), signal.Signals),
                 "train.exit_signals", f"unknown signal {name!r} (e.g. USR1, USR2, TERM, INT)")


def _check_zero_compression(zero: int, method: str) -> None:
    _require(zero <= 1 or method == "none", "parallel.zero",
             f"{zero} keeps only this rank's slice of each gradient, which compression.method="
             f"{method!r} cannot compress (it needs the whole bucket): use parallel.zero <= 1 "
             f"or compression.method='none'")


def _check_moe(moe: MoeConfig, m: ModelConfig, ep: int) -> None:
    """[moe] keys only with experts; top_k, layers and parallel.ep that fit them."""
    r = resolve_moe(moe, m)
    if r is None:
        given = [f"moe.{f.name}" for f in dataclasses.fields(MoeConfig)
                 if getattr(moe, f.name) != getattr(MoeConfig(), f.name)]
        _require(not given, given[0] if given else "moe.num_experts",
                 f"is set but moe.num_experts is 0 (a dense model): set moe.num_experts (> 0) to use experts")
        _require(ep == 1, "parallel.ep", f"{ep} splits experts, but the model has none: set moe.num_experts")
        return
    _require(r.top_k <= r.num_experts, "moe.top_k", f"{r.top_k} exceeds moe.num_experts={r.num_experts}")
    bad = [i for i in r.layers if not 0 <= i < m.n_layers]
    _require(not bad, "moe.layers", f"{bad} are not blocks of this model (0..{m.n_layers - 1})")
    _require(len(set(r.layers)) == len(r.layers), "moe.layers", f"names a block twice: {moe.layers}")
    _require(r.num_experts % ep == 0, "parallel.ep",
             f"{ep} does not divide moe.num_experts={r.num_experts} (each ep rank holds num_experts / ep experts)")


def _check_experts_parallel(moe: MoeConfig, m: ModelConfig, ep: int, method: str) -> None:
    """What expert parallelism composes with: every ZeRO stage (the experts' state sharded over the replicas
    holding the same experts), no gradient compression."""
    if resolve_moe(moe, m) is None:
        return
    _require(ep == 1 or method == "none", "compression.method",
             f"{method!r} with parallel.ep={ep} is not implemented (the experts' gradients are summed over their own "
             f"group, uncompressed): use compression.method='none' or parallel.ep=1")


def _check_onebit_adam(comp: CompressionConfig, optim: OptimConfig) -> None:
    """1-bit Adam compresses AdamW's momentum and freezes its variance after a dense warm-up."""
    if comp.method != "onebit-adam":
        return
    _require(optim.name == "adamw", "compression.method",
             f"'onebit-adam' compresses AdamW's momentum: it needs optim.name='adamw', got {optim.name!r}")
    _require(comp.warmup_steps > 0, "compression.warmup_steps",
             "must be > 0 with compression.method='onebit-adam' (its dense AdamW steps: with 0 the variance "
             "would freeze at its initial zeros)")


def _check_update(optim: OptimConfig, t) -> None:
    _require(optim.update != "compiled" or optim.name == "adamw", "optim.update",
             f"'compiled' is AdamW's one-pass update: it needs optim.name='adamw', got {optim.name!r}")
    _require(optim.update != "compiled" or t.dtype != "float64", "optim.update",
             "'compiled' updates float32 masters: train.dtype='float64' keeps float64 ones (use 'auto' or 'fused')")


def _check_local_tier(ckpt) -> None:
    """The node-local tier's keys come together: a directory and an interval; replicas only with both."""
    _require(not ckpt.local_dir or ckpt.local_interval > 0, "checkpoint.local_interval",
             f"must be > 0 when checkpoint.local_dir is set ({ckpt.local_dir!r}): how many steps between local saves")
    _require(ckpt.local_interval == 0 or bool(ckpt.local_dir), "checkpoint.local_dir",
             f"is empty but checkpoint.local_interval={ckpt.local_interval}: name a node-local path (/dev/shm, $TMPDIR)")
    _require(ckpt.replicas == 0 or bool(ckpt.local_dir), "checkpoint.replicas",
             f"{ckpt.replicas} needs checkpoint.local_dir (the replicas live in the partners' local tier)")


def _check_monitor(mon: MonitorConfig) -> None:
    """Label names Prometheus accepts (not hpctrain's own); a textfile node_exporter reads (``*.prom``)."""
    try:
        parse_labels(mon.labels)
    except ValueError as exc:
        raise error("monitor.labels", str(exc).removeprefix("monitor.labels: ")) from None
    _require(not mon.prometheus_textfile or mon.prometheus_textfile.endswith(".prom"), "monitor.prometheus_textfile",
             f"{mon.prometheus_textfile!r} must end in .prom (node_exporter's textfile collector reads only *.prom)")


def _check_fp8(t) -> None:
    """train.fp8 runs on bfloat16 training (its float32 masters stay); the emulation on float32 and float64 too
    (references: every layout compared with one process)."""
    if t.fp8 == "none":
        return
    allowed = ("bfloat16", "float32", "float64") if t.fp8_emulate else ("bfloat16",)
    _require(t.dtype in allowed, "train.fp8",
             f"{t.fp8!r} needs train.dtype=bfloat16 (float32 or float64 too with train.fp8_emulate=true: references), "
             f"got {t.dtype!r}")


def _check_lora(lora: LoraConfig, m: ModelConfig) -> None:
    """lora.targets name linears of this model, once each; lora.rank fits every target's matrix."""
    shapes = lora_target_shapes(m)
    _require(bool(lora.targets), "lora.targets", f"must name at least one of {', '.join(shapes)} when lora.rank > 0")
    for name in lora.targets:
        _require(name in shapes, "lora.targets", unknown("target", name, list(shapes), f" of this model "
                                                         f"(model.mlp={m.mlp})"))
    _require(len(set(lora.targets)) == len(lora.targets), "lora.targets", f"names a target twice: {lora.targets}")
    smallest = min(lora.targets, key=lambda name: min(shapes[name]))
    _require(lora.rank <= min(shapes[smallest]), "lora.rank",
             f"{lora.rank} exceeds the dimensions of target {smallest!r} (in {shapes[smallest][0]}, out "
             f"{shapes[smallest][1]}): at most {min(shapes[smallest])}")
