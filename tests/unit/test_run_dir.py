"""What a training start does with a run directory that already holds a run (hpctrain/train/run_dir.py)."""
from pathlib import Path

from hpctrain.train.run_dir import SUPERSEDED, carry_out, decide_start, default_resume


def a_run(run_dir: Path, checkpoint_dir: Path, complete: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    step = checkpoint_dir / "step-00000005"
    step.mkdir(parents=True)
    if complete:
        (step / "COMPLETE").write_text("")
    (checkpoint_dir / "latest").write_text("step-00000005\n")


def test_no_resume_with_checkpoints_is_refused_and_touches_nothing(tmp_path):
    a_run(tmp_path, tmp_path / "checkpoints")
    decision = decide_start(str(tmp_path), str(tmp_path / "checkpoints"), None)
    assert decision.problem and "step 5" in decision.problem and "--resume auto" in decision.problem
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / SUPERSEDED).exists()


def test_resume_auto_keeps_the_run_and_resume_none_sets_it_aside(tmp_path):
    a_run(tmp_path, tmp_path / "checkpoints")
    assert decide_start(str(tmp_path), str(tmp_path / "checkpoints"), "auto").resume == "auto"
    assert (tmp_path / "metrics.jsonl").exists()
    decision = decide_start(str(tmp_path), str(tmp_path / "checkpoints"), "none")
    assert (tmp_path / "metrics.jsonl").exists() and decision.set_aside is None  # decided, nothing moved yet
    aside = Path(carry_out(decision, str(tmp_path), str(tmp_path / "checkpoints")))
    assert decision.set_aside == str(aside)
    assert decision.resume == "none" and decision.problem is None and aside.parent == tmp_path / SUPERSEDED
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (aside / "checkpoints" / "step-00000005" / "COMPLETE").exists()
    assert not (tmp_path / "metrics.jsonl").exists() and list((tmp_path / "checkpoints").iterdir()) == []


def test_a_run_without_complete_checkpoints_starts_fresh_without_appending(tmp_path):
    a_run(tmp_path, tmp_path / "checkpoints", complete=False)
    for resume in (None, "auto"):
        decision = decide_start(str(tmp_path), str(tmp_path / "checkpoints"), resume)
        assert decision.problem is None and decision.resume == "none"
        carry_out(decision, str(tmp_path), str(tmp_path / "checkpoints"))
        assert not (tmp_path / "metrics.jsonl").exists()
        (tmp_path / "metrics.jsonl").write_text("x\n")  # the next start finds an earlier log again
    assert len(list((tmp_path / SUPERSEDED).iterdir())) == 2  # two fresh starts, two folders, nothing lost


def test_an_outside_checkpoint_dir_is_set_aside_in_place(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpts"
    a_run(run_dir, ckpt)
    decision = decide_start(str(run_dir), str(ckpt), "none")
    stamp = Path(carry_out(decision, str(run_dir), str(ckpt))).name
    assert (ckpt / SUPERSEDED / stamp / "step-00000005" / "COMPLETE").exists()
    assert (run_dir / SUPERSEDED / stamp / "metrics.jsonl").exists()


def test_a_path_resumes_and_an_empty_directory_is_a_plain_fresh_start(tmp_path):
    assert decide_start(str(tmp_path), str(tmp_path / "checkpoints"), "/some/step-00000007").resume == "/some/step-00000007"
    decision = decide_start(str(tmp_path / "new"), str(tmp_path / "new" / "checkpoints"), None)
    assert decision.earlier == [] and carry_out(decision, str(tmp_path / "new"), "") is None


def test_inside_a_batch_job_a_missing_resume_means_auto():
    assert default_resume({"SLURM_JOB_ID": "7"}) == "auto" and default_resume({}) is None


def test_pieces_in_a_local_tier_count_as_checkpoints(tmp_path):
    from hpctrain.train.run_dir import decide_start

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    assert decide_start(str(run), str(run / "checkpoints"), "auto", local_step=4).resume == "auto"
    refused = decide_start(str(run), str(run / "checkpoints"), None, local_step=4)
    assert refused.problem and "local checkpoints up to step 4 in checkpoint.local_dir" in refused.problem
    assert decide_start(str(run), str(run / "checkpoints"), "auto").resume == "none"  # nothing anywhere
