"""train.fp8 on real ranks (emulated on the CPU): every layout computes what one process computes in fp8, a
wrong amax group breaks it, and a killed fp8 run resumes bit for bit (no fp8 state in checkpoints)."""
import json
import re

from mpirun import ckpt, run_mpi

MOE = ["moe.num_experts=4", "moe.layers=[1]"]  # block 0 dense (attention + MLP), block 1 routed over 4 experts


def test_every_layout_equals_one_process_and_a_wrong_amax_group_breaks_it():
    """float64 training (the emulation's matmuls are float32, as torchao's), 5 steps, one launch: pp=2, dp=2 x
    ZeRO-3 and ep=2 take the very scales one process takes (identical up to float64 sums); cp=2 too (the
    activations' amaxes over tokens max-reduced over cp; its weight gradients' float32 halves summed: 2e-10);
    tp=2 with SP too, its row-parallel partial sums (float32 matmuls over in/tp) rounding apart, amplified by
    routing flips: within 1e-3 (measured 7.7e-5). Reducing the amaxes over dp (size 1: each tp slab scaled
    alone) instead of tp is the failure of Megatron PR #442: measured 4.4e-3 after 5 steps."""
    layouts = "1,1,2;2,1,1|zero3;2,1,1,1,2;1,1,1,2;1,2,1|sp;1,2,1|sp,amax=dp"
    out = run_mpi(2, "check_fp8.py", "--layouts", layouts, "--steps", "5", "--rtol", "1e-3", "--wrong", "1e-3",
                  "train.dtype=float64", *MOE, timeout=240).stdout
    assert "FP8 OK" in out, out
    err = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+ \S+) tensorwise float64: loss rel err (\S+)", out, re.M)}
    assert err["OK 1,1,2"] < 1e-12 and err["OK 2,1,1|zero3"] < 1e-12 and err["OK 2,1,1,1,2"] < 1e-12, err
    assert err["OK 1,1,1,2"] < 1e-8, err
    assert err["OK 1,2,1|sp"] < 1e-3 < err["BREAKS 1,2,1|sp,amax=dp"], err
    assert "fp8_amax_max" in out and "'fp8_overflows': 0" in out


STEPS = ["train.steps=4", "checkpoint.interval=2", "checkpoint.keep=2", "checkpoint.async=false"]
FP8 = ["--config", "configs/tiny.toml", "data.max_bytes=200000", "train.seq_len=32", "train.global_batch=4",
       "model.n_layers=2", "train.progress=false", "train.dtype=bfloat16", "train.fp8=rowwise",
       "train.fp8_emulate=true", "parallel.tp=2", "parallel.pp=1", "parallel.microbatches=1", "train.log_interval=2",
       *STEPS]


def train(run_dir, *extra, env=None, check=True):
    return run_mpi(2, "hpctrain.cli", "train", *FP8, f"train.run_dir={run_dir}", *extra, module=True,
                   timeout=180, env=env, check=check)


def test_a_killed_fp8_run_resumes_bitwise(tmp_path):
    """tp=2, bfloat16 with float32 masters, rowwise: rank 1 SIGKILLed in step 3's forward; the run resumed
    from step 2 ends bit for bit equal to an uninterrupted one (the scales are recomputed from the weights every
    step: nothing float8 is saved)."""
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    out = train(whole).stdout
    assert "float8 rowwise (torchao" in out and "on 14 linears of 2 blocks" in out, out
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    fp8 = {r["step"]: r for r in records if "fp8_amax_max" in r}  # every train.log_interval steps
    assert sorted(fp8) == [2, 4] and all(r["fp8_overflows"] == 0 for r in fp8.values()), records
    assert all(0 < r["fp8_amax_max"] and 0 < r["fp8_scale_min"] <= r["fp8_scale_max"] for r in fp8.values())
    killed = train(run_dir, env={"HPCTRAIN_FAULT": "rank=1,step=3,phase=forward,action=kill"}, check=False)
    assert killed.returncode != 0 and "fault injection" in killed.stderr, killed.output[-3000:]
    resumed = train(run_dir, "--resume", "auto")
    assert "step-00000002 at step 2" in resumed.stdout, resumed.stdout
    diff = ckpt("diff", str(run_dir), str(whole), "--atol", "0", check=False)
    assert diff.returncode == 0, diff.output
