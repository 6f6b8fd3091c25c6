"""Which files a text source means: ``builtin`` (the stdlib's ``.py`` files), a folder (its text files) or
a file; one document each. Shared by the corpus loader (``corpus.py``) and ``hpctrain data prepare``
(``prepared.py``), with ``DataError``, the error of every data module.
"""
from __future__ import annotations

import os
import sysconfig

from hpctrain.errors import HpcTrainError

BUILTIN_SOURCE = "builtin"
BINARY_SNIFF_BYTES = 8192
SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})


class DataError(HpcTrainError, ValueError):
    """A corpus could not be loaded; the message names the path and the problem (a user error: exit 2)."""


def builtin_source_files() -> list[str]:
    """Sorted paths of the stdlib ``.py`` files (no site-packages/test/tests/idlelib)."""
    stdlib_root = sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(stdlib_root):
        raise DataError(f"builtin corpus: stdlib folder {stdlib_root!r} does not exist")
    paths: list[str] = []
    for folder, subfolders, names in os.walk(stdlib_root):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED_STDLIB_DIRS]
        paths.extend(os.path.join(folder, n) for n in names if n.endswith(".py"))
    return sorted(paths)


def _is_text_file(path: str) -> bool:
    """False for binary files (a NUL byte in the first 8 KiB) and unreadable ones."""
    try:
        with open(path, "rb") as handle:
            return b"\0" not in handle.read(BINARY_SNIFF_BYTES)
    except OSError:
        return False


def folder_text_files(folder: str) -> list[str]:
    """The text-like files under ``folder`` (recursive, sorted, hidden entries and binary files skipped)."""
    paths: list[str] = []
    for current, subfolders, names in os.walk(folder):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        paths.extend(os.path.join(current, n) for n in names if not n.startswith("."))
    text_paths = [p for p in sorted(paths) if os.path.isfile(p) and _is_text_file(p)]
    if not text_paths:
        raise DataError(f"data source {folder!r}: folder holds no text files "
                        "(binary files, with a NUL byte in the first 8 KiB, are skipped)")
    return text_paths


def text_documents(sources: list[str]) -> list[str]:
    """The files behind ``sources`` (``builtin``, folders, files), in order: one document each."""
    files = []
    for source in sources:
        if source == BUILTIN_SOURCE:
            files += builtin_source_files()
        elif os.path.isdir(source):
            files += folder_text_files(source)
        elif os.path.isfile(source):
            files.append(source)
        else:
            raise DataError(f"input {source!r} does not exist (give files, folders or 'builtin')")
    return files
