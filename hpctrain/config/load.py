"""Reading a run configuration: TOML, then ``section.key=value`` overrides, then ``validate``.

    cfg = load_config("configs/tiny.toml", ["parallel.tp=2", "train.steps=10"])

The field ``CheckpointConfig.async_`` is spelled ``async`` in TOML, overrides and dicts.
"""
import copy
import dataclasses
import os
import tomllib
from typing import Any, Iterable

from hpctrain.config.keys import OPTIONAL_BOOL, ConfigError, error, key_name, type_name, unknown
from hpctrain.config.tree import Config
from hpctrain.config.validation import validate

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _section_class(section: str) -> type:
    classes = {f.name: f.type for f in dataclasses.fields(Config)}
    if section not in classes:
        raise ConfigError("config: " + unknown("section", section, list(classes)))
    cls = classes[section]
    assert isinstance(cls, type)  # a class, not a string: this module does not postpone annotations
    return cls


def _section_field(section: str, key: str) -> dataclasses.Field:
    """The field behind ``section.key``; the Python spelling (``async_``) is accepted too."""
    fields = dataclasses.fields(_section_class(section))
    for f in fields:
        if key in (key_name(f), f.name):
            return f
    raise error(f"{section}.{key}", unknown("key", key, [key_name(f) for f in fields], f" of [{section}]"))


def _checked_value(where: str, value: Any, ftype: Any) -> Any:
    """A value from TOML or a dict, type-checked against the field type (int is fine for float)."""
    if ftype == OPTIONAL_BOOL:
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
    raise error(where, f"expected {type_name(ftype)}, got {value!r}")


def _bool_choice(value: Any, f: dataclasses.Field) -> Any:
    """A TOML boolean for a str key whose choices are "true"/"false"/... (``train.compile = true``) -> its word."""
    if type(value) is bool and f.type is str and "true" in f.metadata.get("choices", ()):
        return "true" if value else "false"
    return value


def _parsed_value(where: str, text: str, ftype: Any) -> Any:
    """A value parsed from override text by the field type."""
    s = text.strip()
    ftype = bool if ftype == OPTIONAL_BOOL else ftype
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
    raise error(where, f"expected {type_name(ftype)}, got {text!r}")


def config_from_dict(d: dict) -> Config:
    """Build a Config from nested plain dicts; missing sections and keys keep their defaults."""
    sections = {}
    for section, table in d.items():
        section_cls = _section_class(section)
        if not isinstance(table, dict):
            raise error(section, f"expected a table of keys, got {table!r}")
        kwargs = {}
        for key, value in table.items():
            f = _section_field(section, key)
            kwargs[f.name] = _checked_value(f"{section}.{key}", _bool_choice(value, f), f.type)
        sections[section] = section_cls(**kwargs)
    return Config(**sections)


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict of a Config (flat dict of a single section), with TOML key spelling."""
    if not isinstance(cfg, Config):
        return {key_name(f): copy.copy(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
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
    cfg = read_config(path, overrides)
    validate(cfg)
    return cfg


def read_config(path: str | None, overrides: Iterable[str] = ()) -> Config:
    """``load_config`` without the rules between keys: a file that parses and keys that exist, with values of
    their type (``validation.problems`` lists what else is wrong; ``hpctrain check``)."""
    cfg = Config()
    given_moe: list[str] = []  # the [moe] keys the file or an override sets, whatever their value
    if path is not None:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
            given_moe += list(raw.get("moe", {})) if isinstance(raw.get("moe"), dict) else []
            cfg = config_from_dict(raw)
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
    given_moe += [o.partition("=")[0].strip().lstrip("-").partition(".")[2] for o in overrides or ()
                  if o.strip().lstrip("-").startswith("moe.")]
    dense_but_set = [k for k in given_moe if k != "num_experts"]
    if dense_but_set and "num_experts" not in given_moe and not cfg.moe.num_experts:  # at its default too
        # (a [moe] key without moe.num_experts asked for experts; a whole dump that says num_experts = 0 is dense)
        raise ConfigError(f"config: moe.{dense_but_set[0]}: is set but moe.num_experts is 0 (a dense model): set "
                          f"moe.num_experts (> 0) to use experts, or leave the [moe] keys out")
    if cfg.data.tokenizer != "bytes" and cfg.data.tokenizer and not os.path.isabs(cfg.data.tokenizer):
        # the run's config.json is read later from other directories (generate, export): keep it findable
        cfg.data.tokenizer = os.path.abspath(cfg.data.tokenizer)
    return cfg
