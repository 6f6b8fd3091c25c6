"""Directories a command creates, and the rule for replacing them: only what hpctrain itself wrote.

A command that writes a directory (``hpctrain export``, ``hpctrain import-hf``, ``loss_compare --out``)
puts a marker file ``.hpctrain-output`` in it (``mark``). Replacing an existing directory (``--force``,
a second comparison) is allowed only when it holds that marker, holds nothing, and neither holds nor
is or holds a source the command reads (``why_not_replaceable``). So a typo in ``--out`` can never
delete a training run, a checkpoint directory or the model being converted.
"""
from __future__ import annotations

import json
import os
import time

MARKER = ".hpctrain-output"


def mark(directory: str, tool: str) -> None:
    """Record in ``directory`` that ``tool`` wrote it (JSON: tool, time)."""
    with open(os.path.join(directory, MARKER), "w", encoding="utf-8") as f:
        json.dump({"tool": tool, "time": time.time()}, f)


def _contains(outer: str, inner: str) -> bool:
    """``inner`` is ``outer`` or lies inside it (symbolic links resolved)."""
    outer, inner = os.path.realpath(outer), os.path.realpath(inner)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def why_not_replaceable(directory: str, option: str, sources: tuple[str, ...] = ()) -> str | None:
    """Why the existing ``directory`` must not be replaced, or None. ``option`` names it in the message
    (e.g. "--out runs/x"); ``sources`` are the paths the command reads."""
    for source in sources:
        if source and _contains(directory, source):
            return f"{option}: is or holds the source {source}; choose another directory"
    if not os.path.isdir(directory) or not os.listdir(directory):
        return None
    if not os.path.isfile(os.path.join(directory, MARKER)):
        return (f"{option}: exists and was not written by hpctrain (no {MARKER} file); hpctrain replaces only "
                f"what it wrote. Remove it yourself or choose another directory")
    return None
