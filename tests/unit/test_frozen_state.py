"""An asynchronous save takes its snapshot on its own thread while the next step runs: ``FrozenState`` keeps
what that step changes before its update (RNG, sampler position, the reducer's error feedback), and the
update waits for the snapshot (``TrainState.before_next_update``). The snapshot must equal one taken at once."""
import numpy as np
import torch
from mpi4py import MPI

from hpctrain.checkpoint.frozen_state import FrozenState
from hpctrain.checkpoint.transfer import snapshot
from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import load_config
from hpctrain.data.corpus import load_tokens_collective
from hpctrain.runtime.launcher import discover
from hpctrain.train.trainer import Trainer

BASE = ["train.global_batch=4", "train.seq_len=16", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "train.dtype=float64", "train.warmup_steps=1"]


def as_arrays(snap) -> dict:
    return {(item.dataset, item.box.offset): item.data.copy() for item in snap.items}


def test_a_snapshot_taken_during_the_next_step_equals_one_taken_at_once():
    cfg = load_config(None, BASE)
    grid = ProcessGrid.from_config(cfg, discover(MPI.COMM_SELF), mpi_world=MPI.COMM_SELF, timeout_s=60)
    try:
        trainer = Trainer(cfg, grid, tokens=load_tokens_collective(None, "builtin", None, 60000))
        trainer.train_step()
        now = snapshot(trainer.state)
        frozen = FrozenState(trainer.state)
        seen = {}
        trainer.state.before_next_update(lambda: seen.update(snap=snapshot(frozen)))  # at the last moment
        torch.rand(3)  # anything drawing from the generator meanwhile
        trainer.train_step()  # draws a batch, and error feedback, before its update
        later = seen["snap"]
        assert later.attrs["step"] == now.attrs["step"] == 1 and later.attrs["sampler"] == now.attrs["sampler"]
        a, b = as_arrays(now), as_arrays(later)
        assert a.keys() == b.keys() and any(k[0].startswith("rng/") for k in a)
        assert all(np.array_equal(a[k], b[k]) for k in a), [k for k in a if not np.array_equal(a[k], b[k])]
        assert not np.array_equal(as_arrays(snapshot(trainer.state))[("rng/torch_cpu", (0, 0))], a[("rng/torch_cpu", (0, 0))])
    finally:
        grid.close()


class Residuals:
    """A reducer whose error feedback the next backward overwrites in place (as the dp reducer's does)."""

    def __init__(self):
        self.residual = torch.ones(4)

    def state_dict(self):
        return {"residual": self.residual}

    def signature(self):
        return {"method": "topk"}


def test_the_reducer_state_is_copied_when_taken():
    live = Residuals()
    frozen = FrozenState.__new__(FrozenState)  # only its reducer part here
    from hpctrain.checkpoint.frozen_state import _ReducerAsTaken

    frozen.reducer = _ReducerAsTaken(live)
    live.residual.mul_(7)
    assert torch.equal(frozen.reducer.state_dict()["residual"], torch.ones(4))
    assert frozen.reducer.signature() == {"method": "topk"}
