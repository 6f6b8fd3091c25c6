"""The planner's activation memory (hpctrain/plan/memory.py ``activation_bytes``, stages.py
``block_activation_bytes``) against the engine's metered peak on every rank: 1F1B, interleaved, ZB-H1 and
ZB-V at pp = 2 (issue #53: ZB-V's memory within 10% of the planner's) and tp = 2 with and without sequence
parallelism, GELU and SwiGLU with grouped KV heads; and ZB-H1 within 1.1x 1F1B's first-rank peak."""
from mpirun import run_mpi


def test_planned_activations_match_the_metered_peak_on_every_rank():
    result = run_mpi(2, "check_activations.py", "--low", "0.85", "--high", "1.10", timeout=180)
    assert "OK activations within the plan" in result.stdout, result.stdout + result.stderr
    assert result.stdout.count("measured/planned") == 7, result.stdout
