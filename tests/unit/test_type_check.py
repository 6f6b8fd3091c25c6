"""The static type check: mypy over hpctrain/ (``[tool.mypy]`` in pyproject.toml, ``check_untyped_defs``)
reports nothing. It reads the code the CPU suite never runs (the NCCL backend, CUDA events and streams,
device staging): an attribute assigned outside ``__slots__`` or a None used as a value fails here, not
first on a GPU. Incremental: the cache in ``.mypy_cache`` makes a rerun take seconds."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_mypy() -> tuple[int, list[str], str]:
    """(exit status, the error lines, everything mypy printed) of ``python -m mypy`` at the repository root."""
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(REPO / ".mypy_cache")], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    return done.returncode, [line for line in done.stdout.splitlines() if ": error:" in line], \
        done.stdout + done.stderr


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (the test extra pins it: pip install -e '.[test]')")
def test_hpctrain_type_checks():
    status, errors, output = run_mypy()
    assert status == 0 and not errors, (
        f"mypy: {len(errors)} error(s) in hpctrain/ (fix them; a `# type: ignore[code]` needs its reason on the "
        f"same line):\n" + ("\n".join(errors) if errors else output[-4000:]))
