"""Ring attention on real ranks (hpctrain/parallel/context_parallel.py): equal to single-process attention
(float64, 1e-10) for cp = 2 and 4 with full causal masks, GQA and sliding windows, fewer blocks computed
under a window, and a rank stopped inside the ring named in the hang report."""
import re

import pytest

from mpirun import run_mpi, run_self_stopping


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_one_process(cp):
    result = run_mpi(cp, "check_ring_attention.py", "check", timeout=120)
    found = re.search(r"ring attention ok on (\d+) ranks: .* full causal (\d+), window 6 of (\d+) tokens (\d+) "
                      r"\((\d+) skipped\)", result.stdout)
    assert found, result.output
    ranks, full, seq, windowed, skipped = map(int, found.groups())
    assert ranks == cp and seq == 8 * cp
    assert full == 2 * cp * (2 * cp + 1)  # forward + backward: the lower triangle of the 2cp x 2cp chunk pairs
    assert 0 < windowed < full and skipped == 2 * 4 * cp * cp - windowed


def test_a_stopped_rank_inside_the_ring_is_named():
    result = run_self_stopping(4, "check_ring_attention.py", "stop", env={"HPCTRAIN_COMM_TIMEOUT": "3"})
    report = result.stderr
    assert result.returncode not in (0, 124, 137), result.output
    assert "not detected" not in result.stdout
    assert report.count("hpctrain: hang report from") == 1, report
    assert re.search(r"exchange #\d+ of \d+ bytes with group rank \d \(world rank \d\) on group 'world' "
                     r"\(world ranks \[0, 1, 2, 3\]\) has not completed", report), report
    cause = re.search(r"  cause: rank 1 \(node 0 \S+, pid \d+\): (.*)", report)
    assert cause and "stopped (SIGSTOP" in cause.group(1), report
    # the ranks downstream wait on their ring neighbour, back to the stopped one
    assert re.search(r"rank 2 waits in exchange #\d+ of \d+ bytes with group rank 1 \(world rank 1\)", report), report


def test_bench_ring_attention_records_fewer_blocks_with_a_window(tmp_path):
    """benchmarks/bench_ring_attention.py end to end on 2 ranks (a smoke test: records, never speed)."""
    import json

    from mpirun import ROOT

    out = tmp_path / "ring.json"
    run_mpi(2, str(ROOT / "benchmarks" / "bench_ring_attention.py"), "--seq", "64", "--windows", "0,8",
            "--head-dim", "8", "--rounds", "1", "--steps", "1", "--json", str(out), timeout=120)
    records = json.loads(out.read_text())
    assert [r["window"] for r in records] == [0, 8]
    assert records[0]["blocks"] == 2 * 2 * 5 and records[1]["blocks"] < records[0]["blocks"]  # cp=2: 5 per rank
    assert all(r["step_ms"] > 0 and r["exchange_wait_ms"] >= 0 for r in records)
