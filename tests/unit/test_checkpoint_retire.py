"""Crash-safe pruning: a retired checkpoint leaves the step namespace atomically; leftovers are removed."""
import os
from types import SimpleNamespace

from hpctrain.checkpoint.format import COMPLETE_MARKER
from hpctrain.checkpoint.manager import CheckpointManager, list_checkpoints, retire


def make_step(directory, step, complete=True):
    path = directory / f"step-{step:08d}"
    (path / "shards").mkdir(parents=True)
    (path / "shards" / "rank-0.h5").write_bytes(b"x" * 1000)
    if complete:
        (path / COMPLETE_MARKER).write_text("{}")
    return path


def test_retire_removes_a_checkpoint_from_the_listing_first(tmp_path):
    make_step(tmp_path, 1)
    make_step(tmp_path, 2)
    retire(str(tmp_path / "step-00000001"))
    assert [r["step"] for r in list_checkpoints(str(tmp_path))] == [2]
    assert sorted(os.listdir(tmp_path)) == ["step-00000002"]


def test_leftovers_of_crashes_are_removed_and_checkpoints_kept(tmp_path):
    make_step(tmp_path, 4)
    (tmp_path / ".retired-step-00000002" / "shards").mkdir(parents=True)  # a kill during pruning
    (tmp_path / ".tmp-step-00000006" / "shards").mkdir(parents=True)  # a kill during a save
    (tmp_path / "step-00000004.replaced").mkdir()
    (tmp_path / "notes.txt").write_text("the user's file")
    assert [r["step"] for r in list_checkpoints(str(tmp_path))] == [4]  # leftovers are never listed
    manager = SimpleNamespace(dir=str(tmp_path), _cleaned=False)
    CheckpointManager._remove_leftovers(manager)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step-00000004"]
