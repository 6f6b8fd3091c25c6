"""A configuration key: a dataclass field with its help text and validation rule, and how keys are named.

    d_model: int = key(0, above=0, max=SIZE_MAX, help="Hidden size. 0 = the preset's.")

The rule (``choices=(...)``, ``min=x`` (>=), ``above=x`` (>), ``below=x`` (<), ``max=x`` (<=)) and the help
text sit in the field's metadata: ``validate`` applies the rule, ``python -m hpctrain.tools.config_doc``
prints both into docs/configuration.md.
"""
import dataclasses
import difflib
from typing import Any, Callable

from hpctrain.errors import HpcTrainError

# Upper bounds of the size keys, far beyond any model (they keep the arithmetic of a typo small); whether a
# model fits is checked against the memory of the ranks when a run starts (hpctrain/train/memory_check.py)
SIZE_MAX = 1 << 24  # widths, vocabulary, sequence lengths, batch sizes
COUNT_MAX = 1 << 14  # layers, heads, virtual stages

RULES = ("choices", "min", "above", "below", "max")


class ConfigError(HpcTrainError, ValueError):
    """Invalid configuration; the message names the offending key."""

    everywhere = True  # every rank reads and validates the same configuration


def key(default: Any = dataclasses.MISSING, *, help: str, factory: Callable[[], Any] | None = None,
        **rule: Any) -> Any:
    """Dataclass field of a config key: its default (or ``factory`` for a list), help text and rule."""
    assert set(rule) <= set(RULES), f"unknown rule {set(rule) - set(RULES)}"
    metadata = {"help": help, **rule}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def key_name(f: dataclasses.Field) -> str:
    """The TOML/override spelling of a field: ``async_`` -> ``async``."""
    return f.name.rstrip("_")


OPTIONAL_BOOL = bool | None  # a bool whose None means "the preset's" (TOML and overrides give true/false)


def type_name(ftype: Any) -> str:
    """A field type as errors and the reference name it: int, float, bool, str, list[int], list[str]."""
    if ftype == OPTIONAL_BOOL:
        return "bool"
    return str(ftype) if ftype in (list[int], list[str]) else ftype.__name__


def error(where: str, detail: str) -> ConfigError:
    return ConfigError(f"config: {where}: {detail}")


def unknown(kind: str, name: str, valid: list[str], scope: str = "") -> str:
    """``unknown KIND 'x' (did you mean 'y'?); valid KINDs: ...``."""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}; valid {kind}s{scope}: {', '.join(valid)}"
