"""Steps of a checkpoints directory that other runs refer to as their LoRA base (``lora.checkpoint_base =
"reference"``, interop/base_ref.py), kept by that directory's pruning (``checkpoint.keep``).

A referring run's rank 0 writes ``<dir>/references/<id>.json`` = ``{"step": "step-00000012", "by": its own
checkpoints directory}`` beside the step it refers to (``mark``); pruning skips every step a marker names
(``referenced``). A marker stays until it is deleted by hand (when the referring run is gone). Pure file
system functions, no MPI.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

from hpctrain.checkpoint.format import MASTER_FILE, STEP_PREFIX

REFERENCES_DIR = "references"


def step_directory(path: str) -> tuple[str, str] | None:
    """(checkpoints directory, step name) when ``path`` is a step directory of an hpctrain checkpoints directory;
    None otherwise (a Hugging Face directory, say)."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    if name.startswith(STEP_PREFIX) and os.path.isfile(os.path.join(path, MASTER_FILE)):
        return os.path.dirname(path), name
    return None


def mark(base: str, by: str) -> tuple[str, bool] | None:
    """Record that the run whose checkpoints are in ``by`` refers to the step directory ``base``: (the marker's
    path, whether it is new), or None when ``base`` is no step directory. OSError when it cannot be written."""
    found = step_directory(base)
    if found is None:
        return None
    directory, step = found
    record = {"step": step, "by": os.path.abspath(by)}
    key = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(directory, REFERENCES_DIR, f"{key}.json")
    if os.path.isfile(path):
        return path, False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path, True


def referenced(directory: str) -> dict[str, list[tuple[str, str]]]:
    """{step name: [(marker path, referring checkpoints directory)]} of ``directory``'s markers (an unreadable
    marker is skipped)."""
    found: dict[str, list[tuple[str, str]]] = {}
    where = os.path.join(directory, REFERENCES_DIR)
    names = sorted(n for n in os.listdir(where) if n.endswith(".json")) if os.path.isdir(where) else []
    for name in names:
        path = os.path.join(where, name)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
            found.setdefault(str(record["step"]), []).append((path, str(record.get("by", "?"))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def kept_note(path: str, keep: int, marker: str, by: str) -> str:
    """What pruning says (once) when it keeps the step directory ``path`` for the run of ``by``."""
    return (f"hpctrain: keeping {path} beyond checkpoint.keep={keep}: the run of {by} refers to it as its LoRA "
            f"base ({marker}: delete that file once that run is gone)")


def protect(base: str, by: str) -> None:
    """Rank 0 of a run whose checkpoints (in ``by``) refer to the LoRA base ``base``: when that is a step of a
    checkpoints directory (whose run prunes beyond its checkpoint.keep), ``mark`` it and say so once; warn
    when the marker cannot be written."""
    try:
        marked = mark(base, by)
    except OSError as exc:
        print(f"hpctrain: WARNING: the LoRA base {base} lies in a checkpoints directory whose run deletes "
              f"checkpoints beyond its checkpoint.keep, and it cannot be marked as referenced ({exc}): if it "
              f"is pruned this run cannot resume; copy it and set model.init_from there, or set "
              f"lora.checkpoint_base=copy", file=sys.stderr, flush=True)
        return
    if marked is not None and marked[1]:
        print(f"hpctrain train: the LoRA base {base} lies in a checkpoints directory that prunes "
              f"(checkpoint.keep): {marked[0]} keeps it for this run (delete that file once this run is gone)",
              flush=True)
