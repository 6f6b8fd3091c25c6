"""`hpctrain train` end to end on real ranks: metrics, precision modes, and clear errors."""
import json
import math
import socket

import pytest

from mpirun import assert_refused_alike, refused_inputs, run_many, run_mpi

FAST = ["data.max_bytes=300000", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2",
        "train.lr=3e-3", "model.n_layers=2"]
FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "comm_time_s", "mfu"}


def train(nprocs, run_dir, *overrides, check=True, timeout=240):
    return run_mpi(nprocs, "hpctrain.cli", "train", "--config", "configs/tiny.toml", *FAST,
                   f"train.run_dir={run_dir}", *overrides, module=True, timeout=timeout, check=check)


def read_metrics(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "event" not in r]  # step records; stop events are checked separately


def command(run_dir, *overrides):
    """The argv of ``train`` below for scripts/train_many.py (mpirun.run_many)."""
    return ["train", "--config", "configs/tiny.toml", *FAST, f"train.run_dir={run_dir}", *overrides]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The independent runs of the tests below, one launch per world size (mpirun.run_many):
    {name: (run directory, what its ranks printed to stdout)}."""
    base = tmp_path_factory.mktemp("runs")
    by_size = {
        4: {"tiny demo": ["train.steps=12", "train.peak_tflops=1.0"],
            **{dtype: ["train.steps=8", f"train.dtype={dtype}", "parallel.zero=1", "parallel.tp=1",
                       "parallel.sequence_parallel=false"] for dtype in ("bfloat16", "float16")}},
        # train.loss_scale=1e12 overflows ~20 steps in a row (more than max_skipped_steps=20 before the fix)
        2: {"overflow": ["train.steps=3", "train.dtype=float16", "train.loss_scale=1e30", "parallel.tp=1",
                         "parallel.pp=2", "parallel.microbatches=2"],
            "huge loss scale": ["train.steps=30", "train.dtype=float16", "train.loss_scale=1e12", "parallel.tp=2",
                                "parallel.pp=1"]},
    }
    found = {}
    for size, named in by_size.items():
        done = run_many(size, [command(base / name, *overrides) for name, overrides in named.items()])
        found.update({name: (base / name, run["stdout"]) for name, run in zip(named, done)})
    return found


def test_tiny_demo_layout_trains_and_logs(runs):
    run_dir, stdout = runs["tiny demo"]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert FIELDS <= set(records[0])
    assert records[0]["mfu"] > 0 and all(r["tokens_per_s"] > 0 for r in records)
    first, last = sum(r["loss"] for r in records[:3]) / 3, sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.3, (first, last)  # the loss falls
    assert "dp=1 x pp=2 x tp=2" in stdout and "done: 12 steps" in stdout
    assert json.loads((run_dir / "config.json").read_text())["parallel"]["tp"] == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_trains(runs, dtype):
    losses = [r["loss"] for r in read_metrics(runs[dtype][0])]
    assert all(math.isfinite(v) for v in losses), losses  # no NaN, no infinity
    assert len(losses) == 8, losses
    # it learns: ln 256 = 5.55 at step 1, about 4.26 at step 8 in both dtypes (no step skipped); the
    # margin is half that drop, so a few skipped or noisier steps still pass but a stalled run does not
    assert losses[-1] < losses[0] - 0.6, losses


def test_float16_overflow_skips_the_step_and_says_so(runs):
    run_dir, stdout = runs["overflow"]
    records = read_metrics(run_dir)
    assert records[0]["skipped"] and records[0]["loss_scale"] < 1e30
    assert "SKIPPED (inf/NaN loss or gradients" in stdout


def test_a_huge_initial_float16_loss_scale_halves_until_it_trains_instead_of_stopping(runs):
    """train.loss_scale=1e12 overflows ~20 steps in a row (more than max_skipped_steps=20 before the fix:
    exit 4 at step 21); overflows above the minimum scale only halve it, so the run recovers and finishes
    (exit 0: run_many asserts it)."""
    records = read_metrics(runs["huge loss scale"][0])
    skipped = [r["skipped"] for r in records]
    assert len(records) == 30 and sum(skipped) > 15 and not any(skipped[-5:]), skipped
    assert records[-1]["loss_scale"] < 1e6 and math.isfinite(records[-1]["loss"])


BAD_CONFIGS = [  # (overrides, what the one line says); configs/tiny.toml at parallel.pp=1 on 4 ranks
    (["parallel.tpp=2"], "parallel.tpp"),
    (["parallel.tp=3"], "not divisible by tp*pp"),
    (["model.n_heads=6", "model.n_kv_heads=3", "model.d_model=48", "parallel.dp=2", "parallel.tp=2"],
     "model.n_kv_heads=3 is not divisible by parallel.tp=2"),
    (["model.n_heads=6", "model.n_kv_heads=6", "model.d_model=48", "parallel.tp=4"],
     "model.n_heads=6 is not divisible by parallel.tp=4"),
    (["train.global_batch=6", "parallel.tp=1"], "not divisible by dp=4"),
    (["data.source=/nonexistent/corpus.txt"], "data source '/nonexistent/corpus.txt': path does not exist"),
    (["data.source=README.md", "data.max_bytes=20"], "corpus too short: 20 tokens"),
    # context parallelism
    (["train.seq_len=20", "parallel.tp=1", "parallel.cp=4"], "train.seq_len=20 must be divisible by 2 x parallel.cp = 8"),
    (["model.attention_window=100", "train.seq_len=64", "parallel.tp=1", "parallel.cp=2"],
     "model.attention_window=100 is larger than the sequence train.seq_len=64"),
    # `hpctrain info`'s layout flags
    (["info", "--tp", "3"], "not divisible by tp*pp"),
    (["info", "--tp", "2", "--pp", "2", "--dp", "2"], "dp*pp*tp = 2*2*2 = 8 but the job has 4 ranks"),
    (["info", "--tp", "0"], "parallel.tp must be a positive integer"),
    (["info", "--pp", "2", "--virtual-stages", "2"], "parallel.virtual_stages=2 needs parallel.schedule=interleaved"),
]


def test_bad_config_fails_clearly_on_every_rank(tmp_path):
    """One 4-rank launch runs every case in-process (scripts/check_bad_inputs.py): each raises the same
    user error on every rank, marked as raised everywhere, which the CLI prints once as "all 4 ranks: ..."
    (that printing and its exit code: tests/mpi/test_bad_input.py)."""
    for (overrides, expected), ranks in zip(BAD_CONFIGS, refused_inputs(4, tmp_path / "runs",
                                                                        [c for c, _ in BAD_CONFIGS])):
        assert_refused_alike(ranks, 4, expected, overrides)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error_that_writes_nothing(tmp_path):
    result = train(2, tmp_path / "run", "train.device=cuda", "parallel.pp=1", check=False)
    assert result.returncode == 2
    for rank in (0, 1):
        assert f"rank {rank}: train.device='cuda' but torch sees no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_a_used_run_directory_is_refused_then_set_aside_never_mixed(tmp_path):
    train(2, tmp_path, "train.steps=2", "parallel.pp=1")
    first_log = (tmp_path / "metrics.jsonl").read_text()
    again = train(2, tmp_path, "train.steps=2", "parallel.pp=1", check=False)
    assert again.returncode == 2, again.output[-2000:]
    message = [line for line in again.output.splitlines() if "already holds a run" in line]
    assert len(message) == 1 and "--resume auto" in message[0] and "--resume none" in message[0], again.output
    assert (tmp_path / "metrics.jsonl").read_text() == first_log  # nothing appended, nothing moved

    fresh = run_mpi(2, "hpctrain.cli", "train", "--resume", "none", "--config", "configs/tiny.toml", *FAST,
                    f"train.run_dir={tmp_path}", "train.steps=2", "parallel.pp=1", module=True, timeout=240)
    assert "moved to" in fresh.stdout
    (aside,) = (tmp_path / "superseded").iterdir()
    assert (aside / "metrics.jsonl").read_text() == first_log
    assert (aside / "checkpoints" / "step-00000002" / "COMPLETE").exists()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # the new run's log holds the new run only
    assert (tmp_path / "checkpoints" / "step-00000002" / "COMPLETE").exists()


def test_a_start_that_fails_its_checks_leaves_the_earlier_run_where_it_was(tmp_path):
    """--resume none sets the earlier run aside only once every start-up check has passed: a Prometheus port in
    use stops the start (exit 2, one line naming the key) with the earlier run's files and checkpoints untouched."""
    step = tmp_path / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (tmp_path / "checkpoints" / "latest").write_text("step-00000002\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    state = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        result = run_mpi(2, "hpctrain.cli", "train", "--resume", "none", "--config", "configs/tiny.toml", *FAST,
                         f"train.run_dir={tmp_path}", "train.steps=2", "parallel.pp=1",
                         f"monitor.prometheus_port={busy.getsockname()[1]}", module=True, timeout=120, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "monitor.prometheus_port" in errors[0], result.output
    assert "Traceback" not in result.stderr and "moved to" not in result.stdout
    assert {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == state
