"""The monitor's pieces on one process: straggler arithmetic, label rules, the Prometheus sink's counters,
series and textfile, the TensorBoard sink's tags."""
import pytest

from hpctrain.config import ConfigError, load_config
from hpctrain.config.metric_names import METRICS, layout_label, parse_labels, step_samples
from hpctrain.monitor.ranks import RankWindow, summarize


def test_the_slowest_and_median_rank_and_the_bytes_of_all_ranks():
    summary = summarize([(0.10, {"dp": 5}), (0.30, {"dp": 5, "tp": 1}), (0.12, {}), (0.11, {"dp": 5})])
    assert (summary.slowest_rank, summary.median_rank) == (1, 3)  # the lower median of 0.10, 0.11, 0.12, 0.30
    assert summary.ratio == pytest.approx(0.30 / 0.11) and summary.bytes_by_group == {"dp": 15, "tp": 1}
    assert summarize([(0.0, {}), (0.0, {})]).ratio == 1.0


def test_a_ranks_work_is_its_step_time_less_its_communication_waits():
    window = RankWindow()
    for step_s, comm_s in ((1.0, 0.25), (0.5, 0.25)):
        window.add({"step_time_s": step_s, "comm_time_s": comm_s, "groups": {"tp": {"bytes_sent": 4, "comm_s": 0}}})

    class World:
        @staticmethod
        def allgather_object(obj):
            return [obj, (0.1, {"tp": 1})]
    summary = window.gather(World())
    assert summary.slowest_rank == 0 and summary.slowest_s == pytest.approx(0.5) and summary.bytes_by_group == {"tp": 9}
    assert window.steps == 0  # the window starts over


def test_labels_and_textfile_rules():
    assert parse_labels(["cluster=frontier", "project = abc"]) == {"cluster": "frontier", "project": "abc"}
    for bad, why in ((["cluster"], "NAME=VALUE"), (["1x=a"], "NAME=VALUE"), (["layout=a"], "hpctrain own"),
                     (["phase=a"], "hpctrain own"), (["a=1", "a=2"], "set twice")):
        with pytest.raises(ValueError, match=why):
            parse_labels(bad)
    with pytest.raises(ConfigError, match="monitor.prometheus_textfile: 'x.txt' must end in .prom"):
        load_config(None, ["monitor.prometheus_textfile=x.txt"])
    with pytest.raises(ConfigError, match="monitor.labels: 'x' is not NAME=VALUE"):
        load_config(None, ["monitor.labels=[x]"])
    assert layout_label({"dp": 2, "pp": 1, "cp": 1, "tp": 4}) == "dp2-pp1-tp4"
    assert layout_label({"dp": 1, "pp": 2, "cp": 2, "tp": 1}) == "dp1-pp2-cp2-tp1"


def test_step_samples_name_only_exported_metrics_and_turn_inf_into_nan():
    record = {"step": 3, "loss": float("inf"), "lr": 1e-3, "grad_norm": 2.0, "tokens_per_s": 10.0, "step_time_s": 0.5,
              "mfu": None, "time_s": {"forward": 0.2}, "val_loss": 1.5}
    samples = step_samples(record)
    assert {name for name, _, _ in samples} <= set(METRICS)
    loss = next(v for n, _, v in samples if n == "hpctrain_loss")
    assert loss != loss and ("hpctrain_step_seconds", {"phase": "forward"}, 0.2) in samples
    assert not any(n == "hpctrain_mfu_ratio" for n, _, _ in samples)


def test_prometheus_sink_counters_only_grow_and_the_textfile_is_replaced_whole(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from hpctrain.monitor.prometheus import PrometheusSink

    path = tmp_path / "run.prom"
    sink = PrometheusSink({"run": "r", "job_id": "7", "layout": "dp1-pp1-tp1"}, textfile=str(path))
    sink.start()
    sink.set("hpctrain_comm_bytes_total", {"group": "dp"}, 100, 1)
    sink.set("hpctrain_comm_bytes_total", {"group": "dp"}, 250, 2)
    sink.set("hpctrain_restarts_total", {}, 0, 2)
    sink.set("hpctrain_rank_step_seconds", {"rank": "3", "which": "slowest"}, 0.5, 2)
    sink.clear("hpctrain_rank_step_seconds")
    sink.set("hpctrain_rank_step_seconds", {"rank": "1", "which": "slowest"}, 0.4, 3)
    sink.close()
    families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    dp = next(s for s in families["hpctrain_comm_bytes"].samples if s.name.endswith("_total"))
    assert dp.value == 250 and dp.labels == {"run": "r", "job_id": "7", "layout": "dp1-pp1-tp1", "group": "dp"}
    assert [s.value for s in families["hpctrain_restarts"].samples if s.name.endswith("_total")] == [0]
    ranks = families["hpctrain_rank_step_seconds"].samples
    assert [(s.labels["rank"], s.value) for s in ranks] == [("1", 0.4)]  # the old slowest rank's series is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.prom"]


def test_tensorboard_sink_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpctrain.monitor.tensorboard import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path))
    for step in (1, 2):
        sink.set("hpctrain_loss", {}, 3.0 - step, step)
        sink.set("hpctrain_step_seconds", {"phase": "forward"}, 0.1, step)
        sink.set("hpctrain_up", {}, 1, step)  # liveness is not a scalar worth plotting
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["hpctrain_loss", "hpctrain_step_seconds/phase=forward"]
    assert [(e.step, e.value) for e in events.Scalars("hpctrain_loss")] == [(1, 2.0), (2, 1.0)]
