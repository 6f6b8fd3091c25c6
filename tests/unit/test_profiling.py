"""Phase timers, the trace recorder and the trace report, without MPI (tests/mpi/test_trace.py runs them
in real training)."""
import json
import os
import time

import pytest

from hpctrain.profiling.report import TraceError, breakdown, load_traces, merge, slowest, table
from hpctrain.profiling.timers import NULL_TIMER, PhaseTimer
from hpctrain.profiling.trace import TraceRecorder


def test_nested_phases_are_exclusive_and_add_up_to_the_step():
    """Only bounds a sleep guarantees (it never returns early) and exact sums: no wall-clock window."""
    timer = PhaseTimer()
    start = time.perf_counter()
    with timer.phase("forward"):
        time.sleep(0.02)
        with timer.phase("pp_wait"):
            time.sleep(0.03)
    with timer.phase("forward"):  # accumulates
        time.sleep(0.01)
    elapsed = time.perf_counter() - start
    wall = elapsed + 0.005  # the step's wall time: 5 ms that no phase covers
    phases = timer.collect(wall)
    assert set(phases) == {"forward", "pp_wait", "other"}, phases
    assert phases["pp_wait"] >= 0.03, phases
    assert phases["forward"] >= 0.03, phases  # 20 + 10 ms: both blocks count
    # exclusive: had forward also counted the nested pp_wait, the two would exceed the time elapsed
    assert phases["forward"] + phases["pp_wait"] <= elapsed, phases
    assert sum(phases.values()) == pytest.approx(wall)
    assert phases["other"] >= 0.005 - 1e-9, phases
    assert timer.collect(0.0) == {"other": 0.0}  # collect resets


def test_take_removes_one_phase_and_null_timer_does_nothing():
    timer = PhaseTimer()
    timer.add("checkpoint", 0.5)
    assert timer.take("checkpoint") == 0.5 and timer.take("checkpoint") == 0.0
    with NULL_TIMER.phase("forward"):
        pass
    assert NULL_TIMER.collect(1.0) == {} and NULL_TIMER.take("x") == 0.0


def test_recorder_keeps_the_window_and_writes_once_atomically(tmp_path):
    rec = TraceRecorder(3, str(tmp_path / "trace"), first_step=2, last_step=3, meta={"world_size": 4})
    timer = PhaseTimer(trace=rec)
    for step in range(1, 6):
        rec.begin_step(step)
        with timer.phase("forward"):
            if rec.active:  # the Communicator's rule
                rec.comm("tp", "allreduce", 64, 32, time.perf_counter(), time.perf_counter(), blocked=True)
        with timer.phase("checkpoint"):  # between steps: belongs to the step just ended
            pass
        if step == 3:
            assert not os.path.exists(tmp_path / "trace" / "rank00003.json")  # written when step 4 begins
    rec.close()
    doc = json.load(open(tmp_path / "trace" / "rank00003.json"))
    assert not list((tmp_path / "trace").glob("*.tmp.*"))
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["args"]["step"] for e in events if e["cat"] == "step") == [2, 3]
    assert [e["name"] for e in events if e["cat"] == "phase"] == ["forward", "checkpoint"] * 2
    comms = [e for e in events if e["cat"] == "blocked"]
    assert len(comms) == 2 and comms[0]["args"] == {"group": "tp", "bytes": 64, "sent": 32}
    assert {e["pid"] for e in doc["traceEvents"]} == {3} and doc["otherData"]["world_size"] == 4
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert {"rank 3", "steps", "phases", "comm tp"} <= names


def fake_rank(rank, forward_ms, dp_wait_ms, world=2, steps=4, host="h1"):
    """A trace document as TraceRecorder writes it: ``steps`` steps of forward, then a dp wait."""
    events, t = [], 0.0
    for s in range(steps):
        step_us = (forward_ms + dp_wait_ms) * 1e3
        events.append({"name": f"step {s + 2}", "cat": "step", "ph": "X", "pid": rank, "tid": 0, "ts": t,
                       "dur": step_us, "args": {"step": s + 2}})
        events.append({"name": "forward", "cat": "phase", "ph": "X", "pid": rank, "tid": 1, "ts": t,
                       "dur": forward_ms * 1e3, "args": {"exclusive_us": forward_ms * 1e3}})
        events.append({"name": "dp_wait", "cat": "phase", "ph": "X", "pid": rank, "tid": 1,
                       "ts": t + forward_ms * 1e3, "dur": dp_wait_ms * 1e3,
                       "args": {"exclusive_us": dp_wait_ms * 1e3}})
        events.append({"name": "wait allreduce", "cat": "blocked", "ph": "X", "pid": rank, "tid": 2,
                       "ts": t + forward_ms * 1e3, "dur": dp_wait_ms * 1e3,
                       "args": {"group": "dp", "bytes": 100, "sent": 100}})
        t += step_us
    return {"traceEvents": events, "otherData": {"rank": rank, "world_size": world, "hostname": host}}


def test_breakdown_and_the_slowest_rank(tmp_path):
    docs = [fake_rank(0, forward_ms=10, dp_wait_ms=30), fake_rank(1, forward_ms=38, dp_wait_ms=2, host="h2")]
    rows = [breakdown(d) for d in docs]
    assert rows[0]["step"] == pytest.approx(0.040) and rows[0]["comm"] == {"dp": pytest.approx(0.030)}
    assert rows[0]["compute"] == pytest.approx(0.010) and rows[1]["compute"] == pytest.approx(0.038)
    verdict = slowest(rows)
    assert verdict.startswith("slowest rank: 1 (h2)") and "forward takes 38.0 ms, +28.0 ms" in verdict, verdict
    assert "dp comm" in table(rows) and " W " not in table(rows)
    rows[1]["phases"].update(backward=0.004, weight=0.003)  # a zero-bubble schedule: B and W shown apart
    header, _, second = table(rows).splitlines()
    assert header.split()[6:8] == ["B", "W"] and second.split()[5:7] == ["4.0", "3.0"], table(rows)  # "step ms"
    even = [fake_rank(0, forward_ms=20, dp_wait_ms=5), fake_rank(1, forward_ms=20.5, dp_wait_ms=4.5)]
    assert slowest([breakdown(d) for d in even]).startswith("balanced: every rank's compute is within 5%")
    path = merge(docs, str(tmp_path / "trace.json"))
    assert {e["pid"] for e in json.load(open(path))["traceEvents"]} == {0, 1}


def test_report_errors_name_the_problem(tmp_path):
    with pytest.raises(TraceError, match="train.trace=true"):
        load_traces(str(tmp_path))
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank00000.json").write_text(json.dumps(fake_rank(0, 1, 1, world=2)))
    with pytest.raises(TraceError, match=r"1 of 2 ranks; missing ranks \[1\]"):
        load_traces(str(tmp_path))
    (tmp_path / "trace" / "rank00001.json").write_text("{not json")
    with pytest.raises(TraceError, match="rank00001.json is not a trace"):
        load_traces(str(tmp_path))


def test_alpha_beta_fit_recovers_a_known_link():
    from hpctrain.bench.profile import fit_alpha_beta, wire_bytes

    alpha, beta = 20e-6, 1 / 5e9  # 20 us, 5 GB/s
    points = [(w, alpha + beta * w) for w in (4e3, 6.4e4, 1e6, 1.6e7)]
    fit = fit_alpha_beta(points)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6) and fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert fit["fit_error"] < 1e-9
    noisy = [(w, t * (1.1 if i % 2 else 0.9)) for i, (w, t) in enumerate(points)]
    assert 0.05 < fit_alpha_beta(noisy)["fit_error"] < 0.15
    assert wire_bytes("allreduce", 100, 4) == 150 and wire_bytes("allgather", 100, 4) == 75
    assert wire_bytes("sendrecv", 100, 4) == 100
