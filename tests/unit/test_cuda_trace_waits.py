"""``host_waits``: where a CUDA trace's host waited, split at the step's optimizer (hpctrain/profiling/cuda_trace.py).

The events are what torch.profiler writes (``ProfilerStep#N`` spans, ``cuda_runtime`` calls, CPU ops);
the CUDA run itself is exercised by benchmarks/gpu_session.sh on a GPU."""
import json

from hpctrain.profiling.cuda_trace import host_wait_lines, host_waits


def span(name, ts, dur, cat="cpu_op"):
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "cat": cat}


EVENTS = [span("ProfilerStep#2", 0, 100, "user_annotation"), span("aten::mm", 5, 3),
          span("cudaMemcpyAsync", 10, 1, "cuda_runtime"),  # non-blocking: not a wait
          span("cudaStreamSynchronize", 20, 4, "cuda_runtime"),  # a wait in the middle of the step
          span("aten::_fused_adamw_", 60, 5), span("cudaEventSynchronize", 70, 2, "cuda_runtime"),
          span("ProfilerStep#3", 100, 100, "user_annotation"), span("aten::_fused_adamw_", 150, 5),
          span("cudaEventSynchronize", 160, 1, "cuda_runtime"), span("cudaMemcpy", 190, 5, "cuda_runtime"),
          span("fusedAdamKernel", 151, 30, "kernel")]


def test_waits_are_split_at_the_optimizer_of_each_step():
    rows = host_waits(EVENTS)
    assert [r["step"] for r in rows] == ["ProfilerStep#2", "ProfilerStep#3"]
    assert rows[0]["before_optimizer"] == ["cudaStreamSynchronize"]
    assert rows[0]["after_optimizer"] == ["cudaEventSynchronize"] and rows[0]["wait_ms"] == 0.006
    assert rows[1]["before_optimizer"] == [] and rows[1]["after_optimizer"] == ["cudaEventSynchronize", "cudaMemcpy"]


def test_the_trace_report_lines(tmp_path):
    assert host_wait_lines(str(tmp_path)) == []  # a CPU run: no CUDA trace, nothing said
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "cuda-rank00000.json").write_text(json.dumps({"traceEvents": EVENTS}))
    lines = host_wait_lines(str(tmp_path))
    assert lines[0] == "cuda-rank00000.json: 2 profiled steps; host waits before the optimizer is queued: 1"
    assert lines[1].startswith("  ProfilerStep#2: before ['cudaStreamSynchronize'], after ['cudaEventSynchronize']")
