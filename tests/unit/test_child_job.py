"""The child-job launcher shared by loss_compare and sweep: its command, its log, its hard timeout."""
import sys
import time

from hpctrain.runtime.child_job import find_launcher, launch_training_job, train_command


def test_train_command_layout():
    cmd = train_command(["mpiexec", "-v"], 4, ["--config", "c.toml", "train.steps=2"], launcher_args=["-ppn", "2"])
    assert cmd == ["mpiexec", "-v", "-n", "4", "-ppn", "2", sys.executable, "-m", "hpctrain.cli", "train",
                   "--config", "c.toml", "train.steps=2"]


def test_find_launcher_prefers_the_interpreters_folder():
    assert find_launcher("python3") is not None and find_launcher("no-such-launcher-here") is None


def test_exit_status_log_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    log = tmp_path / "job.log"
    code = launch_training_job(["sh", "-c", "echo threads=$OMP_NUM_THREADS; exit 3"], log, timeout_s=30)
    assert code == 3 and log.read_text() == "threads=1\n"


def test_a_job_past_its_timeout_is_ended_with_its_children(tmp_path):
    marker = tmp_path / "child-survived"
    start = time.monotonic()
    code = launch_training_job(["sh", "-c", f"(sleep 3; touch {marker}) & sleep 60"], tmp_path / "log", timeout_s=0.5)
    assert code is None and time.monotonic() - start < 10
    time.sleep(3.5)
    assert not marker.exists()  # the whole process group was ended, not only the direct child
