"""A diverged run never applies, saves or publishes a non-finite state (train.nonfinite, train.max_skipped_steps).

The issue's scenario (bfloat16, lr 1e30: the clip coefficient inf x 0 = NaN was applied, logged as
`loss nan`, exit 0, and `keep` pruned the last finite checkpoint), then a state poisoned with NaN on
one rank (HPCTRAIN_FAULT action nan) after a good checkpoint: with "stop" the run ends with exit 4
and keeps that checkpoint; with "skip" the poisoned state is never published (the writers' finite check).
"""
import json

from mpirun import ckpt, run_mpi

FAST = ["--config", "configs/tiny.toml", "parallel.tp=2", "parallel.pp=1", "data.max_bytes=200000",
        "train.progress=false", "--resume", "none"]


def train(run_dir, *extra, env=None):
    return run_mpi(2, "hpctrain.cli", "train", *FAST, f"train.run_dir={run_dir}", *extra, module=True,
                   timeout=180, env=env, check=False)


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_on_disk(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def test_lr_1e30_stops_with_exit_4_and_valid_json(tmp_path):
    out = train(tmp_path, "train.dtype=bfloat16", "train.lr=1e30", "checkpoint.interval=10", "checkpoint.keep=1",
                "train.steps=30")
    assert out.returncode == 4, out.output[-3000:]
    lines = [line for line in out.stdout.splitlines() if "the update was not applied" in line]
    assert len(lines) == 1 and "non-finite" in lines[0], out.stdout[-2000:]
    records = events(tmp_path)  # json.loads of every line: strict JSON, no bare NaN
    stop = records[-1]
    assert stop["event"] == "stop" and stop["reason"].startswith("non-finite") and stop["step"] < 10
    assert not (tmp_path / "checkpoints").exists()  # nothing saved after the bad step


def test_a_poisoned_state_stops_and_the_good_checkpoint_survives(tmp_path):
    fault = {"HPCTRAIN_FAULT": "rank=1,step=5,phase=optimizer,action=nan"}
    out = train(tmp_path, "checkpoint.interval=2", "checkpoint.keep=1", "train.steps=12", env=fault)
    assert out.returncode == 4, out.output[-3000:]
    assert "stopped at step 6: non-finite loss (loss = nan)" in out.stdout, out.stdout[-2000:]
    assert events(tmp_path)[-1]["reason"] == "non-finite loss"
    assert steps_on_disk(tmp_path) == ["step-00000004"]  # keep=1 pruned nothing for a bad state
    verify = ckpt("verify", str(tmp_path / "checkpoints" / "step-00000004"))
    assert verify.returncode == 0


def test_skip_mode_never_publishes_the_poisoned_state(tmp_path):
    fault = {"HPCTRAIN_FAULT": "rank=1,step=5,phase=optimizer,action=nan"}
    out = train(tmp_path, "checkpoint.interval=2", "checkpoint.keep=1", "train.steps=12", "train.nonfinite=skip",
                env=fault)
    assert out.returncode == 2, out.output[-3000:]
    assert "non-finite values (inf/NaN)" in out.output and "not published" in out.output, out.output[-3000:]
    assert steps_on_disk(tmp_path) == ["step-00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000004"
