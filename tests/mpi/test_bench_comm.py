"""`hpctrain bench comm` on 2 real ranks (tiny sizes, few iterations; never asserts on speed)."""
import csv
import json
from pathlib import Path

import pytest

from hpctrain.bench.comm import FIELDS, bus_factor, default_iters, format_size, parse_size
from hpctrain.bench.profile import fit_alpha_beta
from hpctrain.plan.machine import wire_bytes
from mpirun import ROOT, run_mpi

OPS = ["allreduce", "reduce_scatter", "allgather", "broadcast", "sendrecv", "alltoall"]
IMPLS = ["hpctrain", "mpi4py", "gloo"]
KEYS = {"impl", "op", "bytes", "time_us", "algbw_GBps", "busbw_GBps"}


def test_bench_comm_two_ranks_json_and_csv(tmp_path):
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    result = run_mpi(2, "hpctrain.cli", "bench", "comm", "--ops", ",".join(OPS), "--sizes", "1K,64K",
                     "--iters", "3", "--rounds", "1", "--json", str(out), "--csv", str(table),
                     module=True, timeout=240)
    records = json.loads(out.read_text())
    assert len(records) == len(OPS) * 2 * len(IMPLS)
    assert {(r["impl"], r["op"], r["bytes"]) for r in records} == {
        (i, o, b) for i in IMPLS for o in OPS for b in (1024, 65536)}
    for r in records:
        assert KEYS <= set(r) and set(r) <= set(FIELDS), r
        assert r["time_us"] > 0 and r["algbw_GBps"] > 0 and r["ranks"] == 2 and r["axis"] == "world"
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2))
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == len(records) and list(rows[0]) == list(FIELDS)
    assert "busbw GB/s" in result.stdout and "reduce_scatter" in result.stdout  # rank 0's table


def test_bench_script_without_gloo(tmp_path):
    out = tmp_path / "bench.json"
    run_mpi(2, str(ROOT / "benchmarks" / "bench_comm.py"), "--ops", "allreduce", "--sizes", "4K",
            "--impls", "hpctrain,mpi4py", "--iters", "2", "--rounds", "1", "--json", str(out), timeout=120)
    records = json.loads(out.read_text())
    assert [(r["impl"], r["bytes"]) for r in records] == [("hpctrain", 4096), ("mpi4py", 4096)]
    assert records[1]["ratio_vs_mpi4py"] == 1.0


def test_sizes_and_formulas():
    assert [parse_size(s) for s in ("1K", "64k", "16M", "1G", "4096", "2MiB")] == [
        1024, 65536, 16 << 20, 1 << 30, 4096, 2 << 20]
    assert [format_size(n) for n in (1024, 16 << 20, 1 << 30, 1000)] == ["1K", "16M", "1G", "1000"]
    for bad in ("", "1T", "0K", "K"):
        with pytest.raises(Exception, match="bad message size"):
            parse_size(bad)
    assert bus_factor("allreduce", 4) == 1.5 and bus_factor("allgather", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("sendrecv", 4) == 1.0
    assert bus_factor("alltoall", 4) == 0.75 and bus_factor("alltoall", 2) == 0.5
    assert default_iters(1024) == 200 and default_iters(256 << 20) == 5


def test_link_profile_fits_each_level_of_two_nodes(tmp_path):
    """4 ranks on 2 emulated nodes: the profile has an intra-node and an inter-node level, each collective
    fitted from the sizes measured, in the JSON ``hpctrain plan --profile`` reads. The fits are checked
    against the points they came from (5 iterations on a loaded machine can measure a flat curve, which
    fits as pure latency, beta = 0); the fit itself is unit-tested on known links in test_profiling."""
    out = tmp_path / "profile.json"
    run_mpi(4, "hpctrain.cli", "bench", "comm", "--profile", str(out), "--sizes", "4K,64K,1M", "--rounds", "1",
            "--iters", "5", "--ops", "allreduce,allgather", module=True, timeout=150, fake_nodes=["nA", "nB"])
    doc = json.loads(out.read_text())
    assert doc["nodes"] == 2 and doc["ranks"] == 4 and set(doc["levels"]) == {"intra", "inter"}, doc
    for level, lv in doc["levels"].items():
        assert lv["ranks"] == 2 and lv["groups"] == 2, lv
        pooled = [(wire_bytes(op, b, 2), t) for op in ("allreduce", "allgather")
                  for b, t in doc["collectives"][op][level]["points"]]
        assert_fit_of(lv, pooled)
        beta = lv["beta_s_per_byte"]
        assert lv["bandwidth_GBps"] == (pytest.approx(1 / beta / 1e9) if beta > 0 else None), lv
    for op in ("allreduce", "allgather"):
        for level in ("intra", "inter"):
            c = doc["collectives"][op][level]
            assert [p[0] for p in c["points"]] == [4096, 65536, 2**20] and all(p[1] > 0 for p in c["points"])
            assert_fit_of(c, [(wire_bytes(op, b, 2), t) for b, t in c["points"]])
    dev = doc["device"]  # measured with every rank busy: what `hpctrain plan --profile` uses for compute
    assert dev["name"] == "cpu" and dev["ranks_per_node"] == 2 and dev["peak_tflops"] > 0
    assert 0.05 <= dev["efficiency"] <= 1 and dev["optimizer_s_per_param"] > 0 and dev["block_s"] > 0


def assert_fit_of(entry, points):
    """``entry`` holds the alpha-beta fit of ``points`` (wire bytes, seconds): non-negative, as fitted."""
    fit = fit_alpha_beta(points)
    assert entry["alpha_s"] >= 0 and entry["beta_s_per_byte"] >= 0 and entry["fit_error"] >= 0, entry
    for key in ("alpha_s", "beta_s_per_byte", "fit_error"):
        assert entry[key] == pytest.approx(fit[key]), (key, entry, fit)


def test_link_profile_of_one_rank_says_what_to_launch(tmp_path):
    result = run_mpi(1, "hpctrain.cli", "bench", "comm", "--profile", str(tmp_path / "p.json"), module=True,
                     timeout=60, check=False)
    assert result.returncode != 0 and "launch at least 2 ranks" in result.stdout + result.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_stopped_rank_ends_a_profile_with_a_hang_report(tmp_path):
    """SIGSTOP one rank while the profile measures: the job ends with the hang report, never hangs.
    The stop comes once rank 0 has reported its first measured collective (so every rank is inside the
    watched measurement loop), not after a guessed delay."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from mpirun import ROOT, mpi_env, mpiexec

    out = tmp_path / "stopped-profile.json"
    cmd = ["timeout", "-k", "5", "120"] + mpiexec() + ["-n", "2", sys.executable, "-m", "hpctrain.cli", "bench",
                                                        "comm", "--profile", str(out), "--comm-timeout", "5"]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=mpi_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    lines, measuring = [], threading.Event()

    def read_output():  # until EOF; `timeout` ends the job at the latest
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("bench comm --profile: "):  # rank 0 measured a collective: all ranks are in
                measuring.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    ranks = []
    try:
        assert measuring.wait(timeout=110), "".join(lines)[-3000:]
        ranks = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_rank(p, str(out))]
        assert len(ranks) == 2, ("the two rank processes were not found", ranks)
        os.kill(max(ranks), signal.SIGSTOP)
        stopped_at = time.monotonic()
        proc.wait(timeout=100)
        reader.join(timeout=30)
        took = time.monotonic() - stopped_at
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    output = "".join(lines)
    assert proc.returncode not in (0, 124, 137), output[-3000:]
    assert "hang report" in output and "stopped (SIGSTOP" in output, output[-3000:]
    assert took < 60 and not out.exists()


def _is_rank(pid: str, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return marker.encode() in args and b"hpctrain.cli" in args and not any(
        a.endswith((b"mpiexec", b"mpiexec.hydra", b"timeout", b"hydra_pmi_proxy")) for a in args[:1])
