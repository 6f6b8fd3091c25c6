"""The zero-bubble schedules (zb-h1, zb-v: issue #53) train like one process in every layout family (float64:
1e-10), and a run killed in a deferred W resumes bitwise with the same schedule. One launch per family group keeps the cost small (each
layout/variant is another run inside a launch; check_fidelity.py). The chain across schedules runs with
``-m full_matrix``. Bad values: tests/mpi/test_bad_input.py."""
import json

import pytest

from mpirun import run_mpi

F64 = ["--param-rtol", "1e-10", "--rtol", "1e-10"]


def fidelity(nprocs, layouts, variants, *extra, timeout=400):
    result = run_mpi(nprocs, "check_fidelity.py", "--layouts", layouts, "--variants", variants, *extra,
                     timeout=timeout)
    assert "FIDELITY OK" in result.stdout
    return result.stdout


def test_dp_tp_sp_cp_ep_and_every_zero_stage_by_pp():
    """dp x pp with ZeRO-1/2/3, tp x pp with SP, cp x pp, ep x pp; an MoE model (blocks 0 and 3: the experts'
    batched weights get their gradients in B, the dense blocks' linears in W), tied embeddings (zb-v holds both
    copies on rank 0) and 4 micro-batches (zb-h1 defers rank 1's Ws by one backward; ZeRO-3 releases a unit
    once its B has passed it). Every freed storage is NaN first (check_fidelity.py): a read after a free shows."""
    out = fidelity(4, "2,1,2|zbh1,zero1/zbv,zero2/zbh1,zero3/zbv,zero3;1,2,2|zbh1,sp/zbv,sp,zero1;1,1,2,2|zbv;"
                   "2,1,2,1,2|zbh1,zero1", "zbh1", *F64, "model.tie_embeddings=true", "parallel.microbatches=4",
                   "moe.num_experts=4", "moe.layers=[0,3]", "moe.z_loss_coef=0.01")
    assert out.count("OK dp=") == 8 and out.count("zb-v2") == 4 and out.count("zero=3") == 2 and "ep=2" in out


def test_lora_by_pp():
    """LoRA: the frozen base has no W (the adapters' gradients are kept from B), bit-identical after training."""
    out = fidelity(2, "1,1,2", "zbh1/zbv", *F64, "lora.rank=4")
    assert out.count("OK dp=") == 2 and out.count("LORA OK") == 3


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
