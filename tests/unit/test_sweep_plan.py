"""hpctrain sweep's planning and bookkeeping without launching anything (tests/mpi/test_sweep.py runs it)."""
import json

import pytest

from hpctrain.config import load_config
from hpctrain.sweep.runs import SweepError, SweepRun, add_efficiency, parse_layouts, parse_ranks, plan_runs, summarize


def test_parse_ranks_and_layouts():
    assert parse_ranks("4,1,2,2") == [1, 2, 4]
    assert parse_layouts("auto") is None
    assert parse_layouts("tp=2,pp=1; tp=1,pp=2,mb=4") == [{"tp": 2, "pp": 1, "mb": 0}, {"tp": 1, "pp": 2, "mb": 4}]
    for bad, message in (("1,x", "comma list"), ("0,2", ">= 1")):
        with pytest.raises(SweepError, match=message):
            parse_ranks(bad)
    for bad in ("tp=0", "dp=2", "tp=two", ";"):
        with pytest.raises(SweepError, match="--layouts"):
            parse_layouts(bad)


def test_plan_validates_with_layout_and_says_why_it_skips():
    cfg = load_config("configs/tiny.toml", [])
    runs, skipped = plan_runs(cfg, [1, 2, 4], None, "weak")
    names = {r.name for r in runs}
    assert "r1-dp1-tp1-pp1-mb1" in names and "r4-dp1-tp2-pp2-mb4" in names and "r4-dp2-tp2-pp1-mb1" in names
    assert all(r.dp * r.tp * r.pp == r.ranks for r in runs)
    assert {r.global_batch for r in runs if r.ranks == 4} == {4 * cfg.train.global_batch}  # weak scaling
    assert any("tp=4" in s and "divisible by parallel.tp=4" in s for s in skipped), skipped  # tiny: 2 KV heads
    strong, _ = plan_runs(cfg, [1, 2, 4], [{"tp": 1, "pp": 1, "mb": 0}], "strong")
    assert [r.global_batch for r in strong] == [cfg.train.global_batch] * 3
    with pytest.raises(SweepError, match="no feasible run"):
        plan_runs(cfg, [3], [{"tp": 2, "pp": 1, "mb": 0}], "weak")


def test_summary_folds_phases_and_efficiency(tmp_path):
    run = SweepRun(2, 1, 2, 1, 4, 8, name="r2")
    lines = [{"step": i, "loss": 5.0 - i, "step_time_s": 0.1, "tokens_per_s": 1000.0 + i, "bytes_sent": 10,
              "time_s": {"forward": 0.04, "backward": 0.03, "pp_wait": 0.02, "dp_wait": 0.01, "sync": 0.5}}
             for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines + [{"event": "stop"}])) + "\n")
    row = summarize(run, str(tmp_path), warmup=2)
    assert row["status"] == "ok" and row["steps"] == 5 and row["step_s"] == pytest.approx(0.1)
    assert row["tokens_per_s"] == 1004.0 and row["final_loss"] == 0.0
    assert row["compute_s"] == pytest.approx(0.07) and row["bubble_s"] == pytest.approx(0.02)
    assert row["comm_s"] == pytest.approx(0.01)  # sync is between steps: not in the step's breakdown
    assert summarize(run, str(tmp_path / "missing"), 2)["status"].startswith("no metrics")
    rows = [dict(row, ranks=1, tokens_per_s=1000.0), dict(row, ranks=4, tokens_per_s=3000.0),
            dict(row, status="exit 1")]
    add_efficiency(rows, "weak")
    assert rows[1]["speedup"] == 3.0 and rows[1]["efficiency"] == 0.75 and "efficiency" not in rows[2]
