"""metrics.jsonl is strict JSON (non-finite numbers as null) and streamed; the summary is kept from counts."""
import io
import json
import math

from hpctrain.train.metrics import MetricsLog, json_line


def record(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": float("inf"), "tokens_per_s": 100.0,
            "step_time_s": 0.5, "comm_time_s": 0.1, "time_s": {"forward": float("nan")}}


def test_non_finite_numbers_are_null_and_every_line_is_strict_json(tmp_path):
    log = MetricsLog(str(tmp_path), 3, enabled=True, progress=False, stream=io.StringIO())
    for step, loss in ((1, 5.0), (2, float("nan")), (3, float("inf"))):
        log.log(record(step, loss))
    summary = log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    strict = [json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) for line in lines]
    assert [r["loss"] for r in strict] == [5.0, None, None]
    assert strict[0]["grad_norm"] is None and strict[0]["time_s"]["forward"] is None
    assert summary["steps"] == 3 and summary["first_loss"] == 5.0 and math.isinf(summary["final_loss"])
    assert summary["mean_step_time_s"] == 0.5 and abs(summary["comm_fraction"] - 0.2) < 1e-12


def test_the_log_keeps_no_records_in_memory():
    log = MetricsLog("unused", 10, enabled=False)
    assert not hasattr(log, "records")
    assert json_line({"x": float("-inf"), "y": [1.0, float("nan")]}) == '{"x": null, "y": [1.0, null]}\n'
