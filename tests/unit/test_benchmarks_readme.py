"""benchmarks/README.md names every benchmark script: each benchmarks/*.py and benchmarks/*.sh appears in it
as a whole file name (``table.py`` inside ``gpu_session_table.py`` would not count). No MPI, no imports of the
scripts: a new script without a line in the README fails here, by name."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def scripts() -> list[str]:
    return sorted(p.name for pattern in ("*.py", "*.sh") for p in BENCHMARKS.glob(pattern) if p.is_file())


def mentioned(name: str, text: str) -> bool:
    """``name`` as a whole file name: not preceded or followed by another character of a file name."""
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text) is not None


def test_every_benchmark_script_is_in_the_readme():
    text = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    found = scripts()
    assert len(found) >= 10 and "bench_comm.py" in found, found  # the glob found the folder
    missing = [name for name in found if not mentioned(name, text)]
    assert not missing, f"benchmarks/README.md does not mention {', '.join(missing)}: add a row to its table"


def test_a_mention_must_be_the_whole_name():
    text = "| `gpu_session_table.py` | ... |  see also benchmarks/bench_zero.py."
    assert mentioned("gpu_session_table.py", text) and mentioned("bench_zero.py", text)
    assert not mentioned("table.py", text) and not mentioned("zero.py", text)
    assert not mentioned("gpu_session.sh", "gpu_session.shx")
