"""docs/configuration.md cannot drift from the config dataclasses: its generated tables are checked."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpctrain.tools.config_doc", "--check", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_configuration_doc_matches_the_config():
    result = check(ROOT / "docs" / "configuration.md")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_fails_on_a_drifted_doc(tmp_path):
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert "| `microbatches`" in text  # the row this test edits
    drifted = tmp_path / "configuration.md"
    drifted.write_text(text.replace("| `microbatches`", "| `micro_batches`", 1), encoding="utf-8")
    assert check(drifted).returncode == 1


def test_the_introduction_names_every_section():
    import dataclasses

    from hpctrain.config import Config

    intro = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").split("## Overrides")[0]
    named = [s for s in (f.name for f in dataclasses.fields(Config)) if f"`[{s}]`" in intro]
    assert named == [f.name for f in dataclasses.fields(Config)], named
