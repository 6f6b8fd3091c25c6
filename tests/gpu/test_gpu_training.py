"""Training on the GPU equals training on the CPU; GPU checkpoints resume on the CPU; NCCL on one GPU.

Every test here needs CUDA and skips with the reason where torch sees no GPU (as on the project's
CPU-only CI). Ranks that share one GPU talk through MPI with host staging (NCCL refuses two ranks
on one GPU), so the multi-rank layouts run on a single-GPU machine too; NCCL itself is exercised
by a one-rank job here and by tests/gpu/test_nccl_backend.py on machines with one GPU per rank.
"""
import json

import pytest
import torch

from hpctrain.comm.backends import nccl as nccl_backend
from mpirun import run_mpi

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device is visible to torch")
NCCL_OK, NCCL_REASON = nccl_backend.nccl_available() if torch.cuda.is_available() else (False, "no CUDA")
FAST = ["data.max_bytes=300000", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2",
        "train.lr=3e-3", "model.n_layers=2", "train.progress=false", "parallel.tp=1", "parallel.pp=1"]


def train(nprocs, run_dir, *overrides, check=True):
    return run_mpi(nprocs, "hpctrain.cli", "train", "--config", "configs/tiny.toml", *FAST,
                   f"train.run_dir={run_dir}", *overrides, module=True, timeout=300, check=check)


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "event" not in r]


def ckpt_diff(a, b, atol):
    return run_mpi(1, "hpctrain.cli", "ckpt", "diff", str(a), str(b), "--atol", str(atol), module=True,
                   check=False, timeout=120)


@pytest.mark.parametrize("nprocs,layout", [(1, []), (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                                           (2, ["parallel.pp=2", "parallel.tp=1", "parallel.microbatches=2"]),
                                           (2, ["parallel.tp=1", "parallel.zero=1"]),
                                           (2, ["parallel.tp=1", "parallel.zero=2", "parallel.microbatches=2"]),
                                           (2, ["parallel.tp=1", "parallel.zero=3", "parallel.microbatches=2"]),
                                           # experts split over 2 ranks: the rows' Alltoallv on CUDA tensors
                                           (2, ["parallel.tp=1", "moe.num_experts=4", "parallel.ep=2",
                                                "moe.capacity_factor=1.0", "moe.z_loss_coef=0.01"]),
                                           (2, ["parallel.tp=2", "moe.num_experts=4", "moe.shared_experts=1"])])
def test_gpu_run_equals_cpu_run_in_float64(tmp_path, nprocs, layout):
    common = ["train.steps=4", "train.dtype=float64", *layout]
    train(nprocs, tmp_path / "gpu", "train.device=cuda", *common)
    train(nprocs, tmp_path / "cpu", "train.device=cpu", *common)
    gpu, cpu = losses(tmp_path / "gpu"), losses(tmp_path / "cpu")
    assert len(gpu) == 4 and max(abs(a - b) for a, b in zip(gpu, cpu)) < 1e-10, (gpu, cpu)
    result = ckpt_diff(tmp_path / "gpu", tmp_path / "cpu", 1e-10)
    assert result.returncode == 0, result.output


def test_gpu_float32_close_to_cpu(tmp_path):
    common = ["train.steps=4", "train.dtype=float32", "train.allow_tf32=false"]
    train(1, tmp_path / "gpu", "train.device=cuda", *common)
    train(1, tmp_path / "cpu", "train.device=cpu", *common)
    gpu, cpu = losses(tmp_path / "gpu"), losses(tmp_path / "cpu")
    assert max(abs(a - b) for a, b in zip(gpu, cpu)) < 1e-4, (gpu, cpu)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_gpu_learns_and_reports_mfu(tmp_path, dtype):
    train(1, tmp_path, "train.steps=20", f"train.dtype={dtype}", "train.device=cuda")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "event" not in r]
    values = [r["loss"] for r in records]
    assert all(v == v and abs(v) != float("inf") for v in values)
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3 - 0.3, values
    name = torch.cuda.get_device_name(0)
    if any(k in name for k in ("H100", "H200", "A100")):
        assert records[-1]["mfu"] is not None and records[-1]["mfu"] > 0  # peak from the device preset


def test_gpu_checkpoint_resumes_on_cpu_and_back(tmp_path):
    common = ["train.steps=6", "train.dtype=float64", "checkpoint.interval=0"]
    train(1, tmp_path / "whole", "train.device=cpu", *common)
    train(1, tmp_path / "chain", "train.device=cuda", *common, "--max-steps", "2")
    train(1, tmp_path / "chain", "train.device=cpu", *common, "--max-steps", "2", "--resume", "auto")
    train(1, tmp_path / "chain", "train.device=cuda", *common, "--resume", "auto")
    assert abs(losses(tmp_path / "chain")[-1] - losses(tmp_path / "whole")[-1]) < 1e-10
    result = ckpt_diff(tmp_path / "chain", tmp_path / "whole", 1e-10)
    assert result.returncode == 0, result.output


@pytest.mark.skipif(not NCCL_OK, reason=f"NCCL backend unavailable: {NCCL_REASON}")
def test_nccl_on_one_rank_trains_and_exchanges(tmp_path):
    result = train(1, tmp_path, "train.steps=3", "train.device=cuda", "parallel.backend=nccl")
    assert "backend nccl" in result.stdout


def test_gpu_local_tier_resumes_a_killed_run_like_an_uninterrupted_cpu_run(tmp_path):
    """checkpoint.local_dir on CUDA: the background thread copies device tensors into pinned memory while the
    next step runs; a rank killed mid-run resumes from those pieces and ends where the CPU run ends."""
    common = ["train.steps=8", "train.dtype=float64", "checkpoint.interval=0", "parallel.tp=1"]
    tier = [f"checkpoint.local_dir={tmp_path}/local", "checkpoint.local_interval=2"]
    train(2, tmp_path / "whole", "train.device=cpu", *common)
    killed = run_mpi(2, "hpctrain.cli", "train", "--config", "configs/tiny.toml", *FAST, *common, *tier,
                     f"train.run_dir={tmp_path / 'chain'}", "train.device=cuda", module=True, timeout=300,
                     check=False, env={"HPCTRAIN_FAULT": "rank=1,step=6,phase=forward,action=kill"})
    assert killed.returncode != 0
    out = train(2, tmp_path / "chain", "train.device=cuda", *common, *tier, "--resume", "auto")
    assert "resumed from the local tier" in out.stdout, out.output
    assert abs(losses(tmp_path / "chain")[-1] - losses(tmp_path / "whole")[-1]) < 1e-10
