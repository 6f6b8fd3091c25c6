"""Bad values of the recently added keys, end to end on 2 real ranks: every rank raises the same one-line
error naming the key, marked as raised alike everywhere (printed once, exit 2), and nothing is written
to the run directory. One launch runs the cases in-process (scripts/check_bad_inputs.py); one more goes
through the CLI for the printed line and the exit code. Many more cases, without MPI:
tests/unit/test_bad_input_sweep.py."""

from mpirun import assert_refused_alike, refused_inputs, run_mpi

CASES = [  # (overrides, the key the line names)
    (["parallel.cp=3"], "parallel.cp"),
    (["parallel.cp=2", "parallel.tp=1", "parallel.pp=1", "parallel.dp=2"], "parallel.cp"),  # 1 x 1 x 2 x 2 != 2
    (["parallel.virtual_stages=2"], "parallel.virtual_stages"),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=3", "parallel.tp=1", "parallel.pp=2"],
     "parallel.virtual_stages"),
    (["parallel.schedule=zb-v", "parallel.tp=1", "parallel.pp=2"], "parallel.virtual_stages=2"),  # V = 1
    (["parallel.schedule=zb-h1", "parallel.tp=1", "parallel.pp=2", "parallel.microbatches=1"],
     "parallel.microbatches >= parallel.pp"),
    (["parallel.schedule=zb-h1", "parallel.tp=2", "parallel.pp=1"], "parallel.pp >= 2"),
    (["model.vocab_multiple=1000000000"], "model.vocab_multiple"),
    (["model.mlp=relu"], "model.mlp"),
    (["model.positions=alibi"], "model.positions"),
    (["lora.rank=4", "lora.targets=[q,qkv]"], "lora.targets"),
    (["lora.rank=4", "lora.alpha=nan"], "lora.alpha"),
    (["monitor.labels=[a=b,a=c]"], "monitor.labels"),
    (["monitor.prometheus_port=70000"], "monitor.prometheus_port"),
    (["monitor.prometheus_port=PORT_IN_USE"], "monitor.prometheus_port: cannot serve on 127.0.0.1:"),
    (["monitor.prometheus_textfile={base}/afile/x.prom"], "monitor.prometheus_textfile: cannot write"),  # a file
    (["monitor.prometheus_textfile={base}/x.txt"], "monitor.prometheus_textfile: "),  # not *.prom
    (["monitor.labels=[run=x]"], "monitor.labels: label 'run' is hpctrain own"),
    (["compression.method=onebit-adam"], "compression.warmup_steps"),
    (["compression.density=2"], "compression.density"),
    (["train.micro_batch_size=3", "parallel.pp=1", "parallel.tp=1"], "train.micro_batch_size"),
    (["moe.top_k=3"], "moe.top_k"),  # MoE keys without experts
    (["moe.num_experts=4", "moe.top_k=5"], "moe.top_k"),
    (["moe.num_experts=4", "parallel.ep=3"], "parallel.ep"),  # does not divide the experts
    (["moe.num_experts=6", "parallel.ep=3", "parallel.tp=1", "parallel.pp=1"], "parallel.ep"),  # nor dp x cp = 2
    (["moe.num_experts=4", "parallel.ep=2", "parallel.tp=1", "parallel.pp=1", "compression.method=topk"],
     "compression.method"),  # the experts' gradients are reduced uncompressed
    (["train.fp8=tensorwise", "train.dtype=float16"], "train.fp8"),  # float8 on bfloat16 (or emulated float32/64)
    (["train.fp8=rowwise", "train.dtype=bfloat16"], "train.fp8_emulate"),  # a CPU has no float8 matmul
    (["lora.rank=40"], "lora.rank: 40 exceeds the dimensions of target 'v' (in 64, out 32)"),  # per value: unit tests
    (["train.exit_signals=USR9"], "train.exit_signals: unknown signal 'USR9'"),
    (["train.compile=yes-please"], "train.compile: expected one of false, true, auto"),
    (["train.eval_interval=5"], "train.eval_interval: 5 needs held-out data: set data.valid_fraction"),
    (["checkpoint.local_interval=2"], "checkpoint.local_dir"),  # a local interval needs a local directory
    (["model.vocab_size=16777216", "model.d_model=65536", "model.n_heads=64", "model.n_kv_heads=64"],
     "model.vocab_size=16777216 padded to"),  # fits no host: refused by the memory check, before allocation
]


def test_bad_values_are_refused_alike_on_every_rank_and_write_nothing(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "afile").write_text("a file where a directory should be\n")
    for (overrides, key), ranks in zip(CASES, refused_inputs(2, tmp_path / "runs", [c for c, _ in CASES])):
        assert_refused_alike(ranks, 2, key, overrides)  # the same line on both ranks
        assert not any(written for *_, written in ranks), (overrides, "the run directory was created")


def test_the_cli_prints_one_line_exits_2_and_writes_nothing(tmp_path):
    result = run_mpi(2, "hpctrain.cli", "train", "--config", "configs/tiny.toml", "model.vocab_multiple=0",
                     f"train.run_dir={tmp_path / 'run'}", module=True, timeout=90, check=False)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert errors == ["hpctrain: error: all 2 ranks: config: model.vocab_multiple: must be >= 1, got 0"], \
        result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
