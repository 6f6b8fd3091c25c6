"""Monitoring with real parts: a real Prometheus (Debian's, started on a scratch directory) scrapes a live
4-rank run and its HTTP API returns the run's hpctrain_loss and hpctrain_tokens_per_second; promtool checks
the alert rules shipped in docs/monitoring/; the node_exporter textfile and TensorBoard's own event reader
give the same numbers as metrics.jsonl; a rank slowed by fault injection is named the slowest; bad input
stops the run before its first step in one line; a sink that fails mid-run is dropped with one warning.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from mpirun import ROOT, mpi_env, mpiexec, run_mpi

TINY = ["--config", str(ROOT / "configs" / "tiny.toml"), "checkpoint.async=false"]
RULES = ROOT / "docs" / "monitoring" / "hpctrain-alerts.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(nprocs, run_dir, *args, check=True, env=None, timeout=180):
    return run_mpi(nprocs, "hpctrain.cli", "train", *TINY, f"train.run_dir={run_dir}", *args, module=True,
                   check=check, env=env, timeout=timeout)


def start_train(nprocs, run_dir, *args) -> subprocess.Popen:
    # -k 60: hydra's mpiexec passes a SIGTERM on to its process group, `timeout` included, which then SIGKILLs
    # the group -k seconds later: a graceful stop on a loaded machine needs more than 5 s to save and exit
    cmd = ["timeout", "-k", "60", "300"] + mpiexec() + ["-n", str(nprocs), sys.executable, "-m", "hpctrain.cli",
                                                       "train", *TINY, f"train.run_dir={run_dir}", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def term_the_job_not_its_timeout(run: subprocess.Popen) -> None:
    """SIGTERM to mpiexec and every rank, as Slurm sends it to a step. The `timeout` wrapper (run.pid) is
    spared: on TERM it would SIGKILL the whole group 5 s later, killing a run still saving."""
    members = subprocess.run(["pgrep", "-g", str(run.pid)], capture_output=True, text=True).stdout.split()
    for pid in (int(p) for p in members if int(p) != run.pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def textfile_samples(path) -> dict:
    """{(name, frozenset(labels)): value} of a Prometheus text file."""
    samples = {}
    for line in open(path, encoding="utf-8"):
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line.strip())
        if m and not line.startswith("#"):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            samples[(m.group(1), labels)] = float(m.group(3))
    return samples


def value(samples, name, **labels):
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


@pytest.fixture(scope="module")
def prometheus():
    """The prometheus and promtool binaries (Debian's package, installed where root + apt allow)."""
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        subprocess.run(["bash", str(ROOT / "scripts" / "install_prometheus.sh"), "--if-possible"], timeout=900,
                       stdin=subprocess.DEVNULL, capture_output=True)
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.skip("Prometheus is not installed and cannot be here (Debian's package needs root and apt-get)")
    return shutil.which("prometheus")


def query(port: int, promql: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def test_a_real_prometheus_scrapes_a_live_4_rank_run(prometheus, tmp_path):
    """promtool accepts the shipped rules; `hpctrain runs --file-sd` lists the live run as a target; a real
    Prometheus finds it through that file, scrapes it every second and answers queries for its loss,
    throughput and per-rank step times, with the run's labels."""
    rules = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert rules.returncode == 0 and "SUCCESS" in rules.stdout + rules.stderr, rules.stdout + rules.stderr
    port, prom_port = free_port(), free_port()
    run = start_train(4, tmp_path / "run", "train.steps=100000",  # stopped by the test (SIGTERM)
                      "train.log_interval=20", "monitor.interval=5",
                      f"monitor.prometheus_port={port}", "monitor.labels=[cluster=ci]")
    server = None
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run" / "monitor.json").exists() and time.time() < deadline and run.poll() is None:
            time.sleep(0.2)
        listed = subprocess.run([sys.executable, "-m", "hpctrain.cli", "runs", str(tmp_path), "--file-sd",
                                 str(tmp_path / "targets.json")], capture_output=True, text=True, cwd=ROOT, env=mpi_env(),
                                timeout=60)
        assert f"{tmp_path / 'run'}  live" in listed.stdout and "1 scrape target(s)" in listed.stdout, listed.stdout
        assert json.loads((tmp_path / "targets.json").read_text())[0]["targets"] == [f"127.0.0.1:{port}"]
        (tmp_path / "prometheus.yml").write_text(  # the centre's way: file-based discovery from `hpctrain runs --file-sd`
            f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: ['{RULES}']\n"
            f"scrape_configs:\n  - job_name: hpctrain\n    honor_labels: true\n    file_sd_configs:\n"
            f"      - files: ['{tmp_path / 'targets.json'}']\n")
        server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        names = ("hpctrain_loss", "hpctrain_tokens_per_second", "hpctrain_rank_step_seconds")
        found, deadline = {}, time.time() + 150
        while time.time() < deadline and not all(found.get(n) for n in names) and run.poll() is None:
            time.sleep(1)
            for name in names:
                try:
                    found[name] = found.get(name) or query(prom_port, f'{name}{{cluster="ci"}}')
                except OSError:
                    pass  # Prometheus still starting
        assert len(found) == 3 and all(found.values()), (found, run.poll())
        loss = found["hpctrain_loss"][0]
        assert loss["metric"]["job"] == "hpctrain" and loss["metric"]["layout"] == "dp1-pp2-tp2"
        assert loss["metric"]["run"] == "run" and 0 < float(loss["value"][1]) < 10
        assert float(found["hpctrain_tokens_per_second"][0]["value"][1]) > 0
        assert {r["metric"]["which"] for r in found["hpctrain_rank_step_seconds"]} == {"slowest", "median"}
        steps = query(prom_port, "max_over_time(hpctrain_step[5m])")
        assert steps and float(steps[0]["value"][1]) >= 1
        assert json.loads((tmp_path / "run" / "monitor.json").read_text())["url"] == f"http://127.0.0.1:{port}/metrics"
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGTERM)  # a graceful stop: the run saves and exits
        out, err = run.communicate(timeout=120)
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    assert run.returncode == 75 and "(signal TERM); checkpoint saved" in out, out[-3000:] + err[-3000:]  # requeue


@pytest.mark.alone  # the straggler ratio of a rank slowed by 60 ms a step
def test_textfile_and_tensorboard_hold_the_runs_numbers_and_name_a_slow_rank(tmp_path):
    """tp=2 x pp=2, rank 2 sleeps 60 ms in every forward: it is the slowest rank; the textfile (written at
    exit with hpctrain_up 0) and TensorBoard's EventAccumulator give metrics.jsonl's losses."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, prom = tmp_path / "run", tmp_path / "textfiles" / "hpctrain-1.prom"
    train(4, run, "train.steps=12", "train.log_interval=4", "checkpoint.interval=6", f"monitor.prometheus_textfile={prom}",
          "monitor.tensorboard=true", env={"HPCTRAIN_FAULT": "rank=2,step=1,phase=forward,action=slow:0.06",
                                           "SLURM_RESTART_COUNT": "2"})
    losses = [json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"loss"' in line]
    samples = textfile_samples(prom)
    assert value(samples, "hpctrain_up") == 0 and value(samples, "hpctrain_step") == 12
    assert value(samples, "hpctrain_loss") == pytest.approx(losses[-1], rel=1e-12)
    assert value(samples, "hpctrain_rank_step_seconds", which="slowest", rank="2") > 0.05
    assert value(samples, "hpctrain_straggler_ratio") > 1.5
    assert value(samples, "hpctrain_last_checkpoint_step") == 12 and value(samples, "hpctrain_restarts_total") == 2
    assert value(samples, "hpctrain_comm_bytes_total", group="tp") > 0 and value(samples, "hpctrain_comm_bytes_total",
                                                                                    group="pp") > 0
    assert value(samples, "hpctrain_step_seconds", phase="total") > value(samples, "hpctrain_step_seconds",
                                                                          phase="forward") > 0
    assert list(prom.parent.iterdir()) == [prom]  # written by rename: no half file left behind
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("hpctrain_loss")
    assert [e.step for e in scalars] == list(range(1, 13))
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)  # float32 in the event file
    assert "hpctrain_step_seconds/phase=forward" in events.Tags()["scalars"]


def test_bad_monitor_input_stops_the_run_before_its_first_step_in_one_line(tmp_path):
    """tensorboard missing (hidden by a package that fails to import); the other bad [monitor] values, in one
    launch: tests/mpi/test_bad_input.py."""
    missing = tmp_path / "no-tensorboard"
    (missing / "tensorboard").mkdir(parents=True)
    (missing / "tensorboard" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    run = tmp_path / "run"
    result = train(2, run, "parallel.pp=1", "train.steps=3", "monitor.tensorboard=true",
                   env={"PYTHONPATH": f"{missing}:{ROOT}"}, check=False, timeout=90)
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error: ")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "monitor.tensorboard: needs the tensorboard package" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and not (run / "checkpoints").exists()


def test_a_sink_that_fails_mid_run_is_dropped_with_one_warning(tmp_path):
    prom = tmp_path / "textfiles" / "hpctrain.prom"
    run = start_train(2, tmp_path / "run", "parallel.pp=1", "train.steps=150", "monitor.interval=2",
                      f"monitor.prometheus_textfile={prom}")
    deadline = time.time() + 120
    while not prom.exists() and time.time() < deadline and run.poll() is None:
        time.sleep(0.2)
    for _ in range(50):  # the sink may recreate the directory between the two calls: try again
        shutil.rmtree(prom.parent, ignore_errors=True)
        try:
            prom.parent.write_text("the directory is now a file: the next write fails\n")
            break
        except IsADirectoryError:
            time.sleep(0.05)
    out, err = run.communicate(timeout=240)
    assert run.returncode == 0, out[-2000:] + err[-2000:]
    assert err.count("hpctrain: WARNING: monitor: the prometheus sink failed") == 1, err[-3000:]
    assert "done: 150 steps" in out
