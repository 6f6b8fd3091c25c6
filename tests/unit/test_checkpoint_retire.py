"""Crash-safe pruning: a retired checkpoint leaves the step namespace atomically; leftovers are removed.
The manager runs on this process alone (MPI.COMM_SELF) through its public ``save_snapshot``."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint.format import COMPLETE_MARKER, FORMAT_NAME, FORMAT_VERSION, Box
from hpctrain.checkpoint.directory import list_checkpoints, read_latest, retire
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.reader import CheckpointReader
from hpctrain.checkpoint.transfer import Snapshot, WriteItem
from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import CheckpointConfig


@pytest.fixture(scope="module")
def solo_grid():
    """This process alone as a ProcessGrid (no mpiexec needed)."""
    from hpctrain.runtime.launcher import discover

    grid = ProcessGrid.build(discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=0)
    yield grid
    grid.close()


def tiny_snapshot(step):
    """One 4x3 float32 dataset; root attributes: the format's identity and the step."""
    data = np.arange(12, dtype=np.float32).reshape(4, 3) + step
    snap = Snapshot(step, {"model/w": ((4, 3), "<f4")}, [WriteItem("model/w", Box((0, 0), (4, 3)), data)])
    snap.attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step}
    return snap


def manager(directory, grid, **kwargs):
    cfg = CheckpointConfig(dir=str(directory), keep=2, async_=False, writer="shards")
    return CheckpointManager(cfg, grid, str(directory), **kwargs)


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


def test_the_first_save_removes_leftovers_of_crashes_and_keeps_checkpoints(tmp_path, solo_grid):
    make_step(tmp_path, 4)
    (tmp_path / ".retired-step-00000002" / "shards").mkdir(parents=True)  # a kill during pruning
    (tmp_path / ".tmp-step-00000006" / "shards").mkdir(parents=True)  # a kill during a save
    (tmp_path / "step-00000004.replaced").mkdir()
    (tmp_path / "notes.txt").write_text("the user's file")
    assert [r["step"] for r in list_checkpoints(str(tmp_path))] == [4]  # leftovers are never listed
    mgr = manager(tmp_path, solo_grid)
    try:
        mgr.save_snapshot(tiny_snapshot(6))
    finally:
        mgr.close()
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes.txt", "step-00000004", "step-00000006"]
    assert read_latest(str(tmp_path)) == "step-00000006" and mgr.saved_steps == [6]


def test_save_snapshot_publishes_and_prunes_and_reports_its_phases(tmp_path, solo_grid):
    """``save_snapshot`` (the save after the snapshot) publishes a verified checkpoint, keeps the last
    ``keep``, and records its phases; ``poll_sleep_s`` (the sleeping-wait hook) adds a watched barrier
    before each agreement and changes no result."""
    collectives = {}
    for poll_sleep_s in (0.0, 0.001):
        directory = tmp_path / f"poll-{poll_sleep_s}"
        mgr = manager(directory, solo_grid, poll_sleep_s=poll_sleep_s)
        try:
            for step in (1, 2, 3):
                mgr.save_snapshot(tiny_snapshot(step))
                assert not mgr.pending  # synchronous: nothing left in the background
        finally:
            mgr.close()
        collectives[poll_sleep_s] = mgr.comm.seq  # numbered calls on the manager's communicator
        assert [r["step"] for r in list_checkpoints(str(directory))] == [2, 3]  # keep=2
        with CheckpointReader(str(directory / "step-00000003")) as reader:
            assert reader.complete and reader.verify() == [] and reader.attrs["step"] == 3
            assert np.array_equal(reader.read("model/w", Box((0, 0), (4, 3))), tiny_snapshot(3).items[0].data)
        assert {"prepare", "write", "fsync", "verify", "publish", "agree"} <= set(mgr.last_phases), mgr.last_phases
        assert mgr.last_save_s > 0 and all(v >= 0 for v in mgr.last_phases.values())
    assert collectives[0.001] > collectives[0.0] > 0, collectives


def test_a_step_moved_aside_by_an_interrupted_save_is_put_back(tmp_path):
    from hpctrain.checkpoint.directory import list_checkpoints, recover_replaced

    (tmp_path / "step-00000004.replaced").mkdir()  # killed between the two renames of a re-save
    (tmp_path / "step-00000004.replaced" / "COMPLETE").write_text("{}")
    (tmp_path / "step-00000002.replaced").mkdir()  # its step directory exists: a leftover, not restored
    (tmp_path / "step-00000002").mkdir()
    assert recover_replaced(str(tmp_path)) == ["step-00000004"]
    assert [r["step"] for r in list_checkpoints(str(tmp_path)) if r["complete"]] == [4]
