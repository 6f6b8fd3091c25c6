"""The zero-bubble schedules (zb-h1, zb-v: issue #53): a run killed in a deferred W resumes bitwise with the same
schedule; a chain of resumes across schedules matches one process (``-m full_matrix``). Their fidelity against
one process in every layout family: tests/mpi/test_fidelity.py (its shared launches); bad values:
tests/mpi/test_bad_input.py; a rank stopped in a W: tests/mpi/test_hang_report.py."""
import json

import pytest

from mpirun import run_mpi

def test_killed_in_a_deferred_w_resumes_bitwise(tmp_path):
    """The schedule is not part of a checkpoint: zb-v (a tied embedding held twice on rank 0), rank 1 SIGKILLed
    in step 5's first W, resumed with zb-v from step 4, ends bitwise equal to the uninterrupted run; its validation
    loss comes from rank 0, which holds the last virtual stage."""
    import test_checkpoint as checkpoint_tests  # its helpers (train, losses, ckpt), not its tests

    common = [*checkpoint_tests.F32, "train.steps=6", "parallel.tp=1", "parallel.pp=2", "parallel.schedule=zb-v",
              "parallel.virtual_stages=2", "model.tie_embeddings=true", "model.n_layers=4", "checkpoint.interval=2",
              "checkpoint.async=false", "train.eval_interval=3", "data.valid_fraction=0.1"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    checkpoint_tests.train(2, whole, *common)
    killed = run_mpi(2, "hpctrain.cli", "train", f"train.run_dir={split}", *common, module=True, timeout=240,
                     check=False, env={"HPCTRAIN_FAULT": "rank=1,step=5,phase=weight,action=kill"})
    assert killed.returncode != 0 and "fault injection" in killed.stderr, killed.output[-3000:]
    out = checkpoint_tests.train(2, split, *common, "--resume", "auto")
    assert "resumed from" in out.stdout and "at step 4" in out.stdout, out.stdout
    assert checkpoint_tests.losses(split) == checkpoint_tests.losses(whole)
    records = [json.loads(line) for line in open(whole / "metrics.jsonl") if '"val_loss"' in line]
    assert len(records) == 2 and all(r["val_loss"] > 1 for r in records), records  # from rank 0's last stage
    checkpoint_tests.ckpt("diff", str(whole), str(split), "--atol", "0")


@pytest.mark.full_matrix
def test_a_chain_across_schedules_matches_one_process(tmp_path):
    """1f1b -> zb-v -> zb-h1, each 2 steps resuming the last, within 1e-10 of one process (float64)."""
    import test_checkpoint as checkpoint_tests  # its helpers (train, losses, ckpt, run_chain), not its tests

    reference = tmp_path / "reference"
    checkpoint_tests.train(1, reference, *checkpoint_tests.F64, "train.steps=6", "parallel.pp=1", "parallel.tp=1",
                           "parallel.microbatches=1")
    pp2 = ["parallel.tp=1", "parallel.pp=2"]
    chain = [(2, pp2), (2, pp2 + ["parallel.schedule=zb-v", "parallel.virtual_stages=2"]),
             (2, pp2 + ["parallel.schedule=zb-h1"])]
    checkpoint_tests.run_chain(tmp_path / "chain", reference, checkpoint_tests.losses(reference), chain,
                               "train.steps=6")
