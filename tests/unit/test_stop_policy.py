"""The stop decision: signals, time limit with a measured save margin, max steps; the agreed code."""
import os
import signal
from types import SimpleNamespace

import pytest

from hpctrain.errors import HpcTrainError
from hpctrain.runtime.signals import SignalFlag, scheduler_deadline, slurm_job_to_requeue
from hpctrain.train.stop import StopPolicy, decode, encode


def test_a_handler_only_sets_a_flag_and_the_first_signal_wins():
    flag = SignalFlag(["USR1", "TERM"])
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # handled too: the process is still here
        assert flag.received == "USR1"
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_unknown_signal_is_named():
    with pytest.raises(HpcTrainError, match="unknown signal 'NOPE'"):
        SignalFlag(["NOPE"])


def test_time_limit_uses_the_measured_save_after_the_first():
    now = [1000.0]
    policy = StopPolicy(last_step=100, deadline=1100.0, first_margin_s=60.0, clock=lambda: now[0])
    policy.record_step(5.0)
    assert policy.local_reason(1) == ""  # 1000 + 5 + 60 < 1100
    now[0] = 1040.0
    assert policy.local_reason(2) == "time limit"  # 1040 + 65 > 1100
    policy.record_save(10.0)  # measured: margin = 5 + 2 * 10
    assert policy.margin_s() == 25.0 and policy.local_reason(2) == ""
    now[0] = 1080.0
    assert policy.local_reason(3) == "time limit"


def test_signal_beats_time_beats_max_steps_and_codes_round_trip():
    policy = StopPolicy(signal_flag=SimpleNamespace(received="TERM"), last_step=5, deadline=0.0)
    assert policy.local_reason(5) == "signal TERM"
    assert StopPolicy(last_step=5).local_reason(5) == "max steps"
    assert StopPolicy(last_step=5).local_reason(4) == ""
    for reason in ("", "max steps", "time limit", "signal USR1", "signal TERM"):
        assert decode(encode(reason)) == reason
    assert encode("signal USR1") > encode("time limit") > encode("max steps") > encode("")


def test_slurm_ids():
    assert scheduler_deadline({}) is None
    assert scheduler_deadline({"SLURM_JOB_END_TIME": "1790000000"}) == 1790000000.0
    assert slurm_job_to_requeue({"SLURM_JOB_ID": "12"}) == "12"
    assert slurm_job_to_requeue({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}) == "10_2"
    assert slurm_job_to_requeue({}) is None


def test_run_lock_live_stale_and_release(tmp_path):
    import json
    import socket
    import time as clock

    from hpctrain.train.run_lock import STALE_S, RunDirInUse, RunLock

    mine = RunLock(str(tmp_path), enabled=True)
    assert mine.acquire() is None and (tmp_path / ".hpctrain.lock").exists()
    with pytest.raises(RunDirInUse, match="is in use by pid"):
        RunLock(str(tmp_path), enabled=True).acquire()  # this very process is alive
    mine.release()
    assert not (tmp_path / ".hpctrain.lock").exists()
    lock = tmp_path / ".hpctrain.lock"
    lock.write_text(json.dumps({"host": "other-node", "pid": 1, "job": "77"}))
    with pytest.raises(RunDirInUse, match="job 77, pid 1 on other-node"):
        RunLock(str(tmp_path), enabled=True).acquire()  # another host, fresh heartbeat
    old = clock.time() - STALE_S - 10
    os.utime(lock, (old, old))
    taker = RunLock(str(tmp_path), enabled=True)
    assert "took over the stale lock of job 77" in taker.acquire()
    assert json.loads(lock.read_text())["host"] == socket.gethostname()
    taker.release()
    assert RunLock(str(tmp_path), enabled=False).acquire() is None and not lock.exists()


def test_retarget_keeps_an_early_signal_it_still_handles_and_drops_the_rest():
    flag = SignalFlag(["USR1", "TERM"])  # the entry point's, before the config is read
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        flag.retarget(["USR1", "USR2"])  # the config's train.exit_signals
        assert flag.received == "USR1"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # no longer handled
        assert signal.getsignal(signal.SIGUSR2) == flag._handle
    finally:
        flag.restore()


def test_retarget_gives_an_early_signal_the_config_drops_its_default_action():
    code = ("import os, signal\nfrom hpctrain.runtime.signals import SignalFlag\n"
            "flag = SignalFlag(['USR1', 'TERM'])\nos.kill(os.getpid(), signal.SIGTERM)\n"
            "flag.retarget(['USR1'])\nprint('survived')\n")
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGTERM and "survived" not in result.stdout


def test_an_unmeasured_save_keeps_the_first_margin():
    policy = StopPolicy(last_step=100, deadline=1100.0, first_margin_s=60.0, clock=lambda: 1000.0)
    policy.record_step(5.0)
    policy.record_save(None)  # the first async save is still running: nothing measured yet
    assert policy.margin_s() == 65.0  # not 5 s: a time-limit stop in this window still has its margin


def test_a_signal_stop_reports_when_it_was_seen_and_how_long_it_took():
    now = [500.0]
    flag = SimpleNamespace(received=None, received_at=None)
    policy = StopPolicy(signal_flag=flag, last_step=100, clock=lambda: now[0])
    assert policy.local_reason(6) == "" and policy.signal_timing(9) == {}
    flag.received, flag.received_at = "USR1", 499.5
    assert policy.local_reason(7) == "signal USR1"
    assert policy.local_reason(8) == "signal USR1"  # still set: the first sighting is kept
    now[0] = 503.0
    assert policy.signal_timing(9) == {"signal_seen_after_step": 7, "steps_after_signal": 2,
                                       "signal_to_saved_s": 3.5}
