"""Replacing an output directory: only what hpctrain wrote, never a source (hpctrain/runtime/outputs.py)."""
from hpctrain.runtime.outputs import MARKER, mark, why_not_replaceable


def test_only_a_marked_or_empty_directory_may_be_replaced(tmp_path):
    out = tmp_path / "out"
    assert why_not_replaceable(str(out), "--out out") is None  # does not exist
    out.mkdir()
    assert why_not_replaceable(str(out), "--out out") is None  # empty
    (out / "metrics.jsonl").write_text("{}\n")  # somebody's run
    problem = why_not_replaceable(str(out), "--out out")
    assert problem and "not written by hpctrain" in problem and MARKER in problem
    mark(str(out), "hpctrain export")
    assert why_not_replaceable(str(out), "--out out") is None


def test_a_source_is_never_replaced(tmp_path):
    run = tmp_path / "runs" / "tiny"
    (run / "checkpoints").mkdir(parents=True)
    mark(str(run), "hpctrain export")  # even a marked directory
    for out in (run, tmp_path / "runs"):
        assert "source" in why_not_replaceable(str(out), "--out x", (str(run / "checkpoints"),))
    assert why_not_replaceable(str(run / "hf"), "--out x", (str(run),)) is None  # a new folder inside is fine
