"""``python -m hpctrain.tools.loss_compare``: two real training runs, one step-by-step loss comparison."""
import json
import shlex
import subprocess
import sys

import mpirun

FAST = ("data.max_bytes=300000 train.seq_len=16 train.global_batch=4 model.n_layers=2 parallel.pp=1 "
        "parallel.microbatches=1 train.dtype=float64")


def loss_compare(*args, timeout=240):
    cmd = [sys.executable, "-m", "hpctrain.tools.loss_compare", "--launcher", shlex.join(mpirun.mpiexec()),
           "--timeout", "120", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=mpirun.mpi_env({"COLUMNS": "160"}),
                          cwd=str(mpirun.ROOT),
                          stdin=subprocess.DEVNULL, timeout=timeout)


def test_dp_and_tp_losses_agree_in_float64(tmp_path):
    result = loss_compare("--a", "2:parallel.dp=2", "--b", "2:parallel.tp=2", "--overrides", FAST,
                          "--steps", "4", "--rtol", "1e-9", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MATCH: all 4 steps agree" in result.stdout
    for side in ("a", "b"):  # --out keeps both runs
        lines = (tmp_path / side / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines if '"event"' not in line] == [1, 2, 3, 4]


def test_different_learning_rates_fail_and_name_the_step():
    result = loss_compare("--a", "1:", "--b", "1:train.lr=1e-2", "--overrides", FAST, "--steps", "3",
                          "--rtol", "1e-9")
    assert result.returncode == 1, result.stdout + result.stderr
    # step 1's loss is computed before the first update, so the runs first differ at step 2
    assert "first at step 2:" in result.stdout, result.stdout


def _write(path, losses):
    path.write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses)))


def test_metrics_mode_compares_files_without_training(tmp_path):
    from hpctrain.tools.loss_compare import main

    a, b, short = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "short.jsonl"
    _write(a, [5.0, 4.0, 3.0])
    _write(b, [5.0, 4.0 + 1e-12, 3.5])
    _write(short, [5.0, 4.0])
    assert main(["--metrics", str(a), str(a)]) == 0
    assert main(["--metrics", str(a), str(b), "--rtol", "1e-9"]) == 1
    assert main(["--metrics", str(a), str(b), "--atol", "0.6"]) == 0
    assert main(["--metrics", str(a), str(short)]) == 1  # step 3 missing from B
    assert main(["--metrics", str(a), str(tmp_path / "none.jsonl")]) == 2
    assert main(["--a", "x:train.lr=1"]) == 2  # malformed spec, no --b


def test_out_never_deletes_a_run_it_did_not_write(tmp_path):
    run = tmp_path / "a"  # a real training run's directory where --out would put side a
    (run / "checkpoints" / "step-00000005").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    result = loss_compare("--a", "1:", "--b", "1:", "--overrides", FAST, "--steps", "1", "--out", str(tmp_path))
    assert result.returncode == 2 and "not written by hpctrain" in result.stdout + result.stderr
    assert (run / "checkpoints" / "step-00000005").is_dir() and (run / "metrics.jsonl").exists()
