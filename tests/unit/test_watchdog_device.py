"""Device work stays watched until it completes (``Watchdog.end_when``): a queued NCCL kernel that never
finishes is reported like a call that never returns. Device-generic: ``done`` is any callable (on a GPU,
the CUDA event query of ``NcclWork.device_done``)."""
import threading
import time
from types import SimpleNamespace

from hpctrain.comm.collectives import _end
from hpctrain.comm.watchdog import Watchdog


def group():
    return SimpleNamespace(seq=0, p2p_seq=0, done_seq=0, done_op=None, done_at=None, name="dp", rank=0, size=1,
                           members=(0,))


def test_device_work_is_watched_until_its_event_completes():
    dog = Watchdog(0, timeout_s=30)
    try:
        finished = threading.Event()
        token = dog.begin("allreduce", group())
        _end(dog, token, SimpleNamespace(device_done=finished.is_set))  # host part returned, kernel queued
        assert [c.op for c in dog.inflight()] == ["allreduce"]
        finished.set()
        deadline = time.monotonic() + 10
        while dog.inflight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dog.inflight() == []  # the watchdog thread saw the event complete
        _end(dog, dog.begin("allreduce", group()), None)  # host work: ends at once
        assert dog.inflight() == []
    finally:
        dog.close()


def test_device_work_that_never_completes_fires_the_hang_report(capfd, monkeypatch):
    monkeypatch.setenv("HPCTRAIN_ERROR_GRACE_S", "0")
    aborted = []
    dog = Watchdog(0, timeout_s=0.4, abort=aborted.append)  # abort(code) instead of MPI_Abort
    try:
        _end(dog, dog.begin("allreduce", group()), SimpleNamespace(device_done=lambda: False))
        deadline = time.monotonic() + 15
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted == [3]
        assert "allreduce" in capfd.readouterr().err
    finally:
        dog.close()


def test_without_a_watchdog_thread_device_work_ends_at_once():
    dog = Watchdog(0, timeout_s=0)  # comm.timeout_s = 0: nothing would ever poll the event
    _end(dog, dog.begin("allreduce", group()), SimpleNamespace(device_done=lambda: False))
    assert dog.inflight() == [] and dog._device == {}


def test_a_device_query_that_raises_keeps_the_call_watched_and_the_thread_alive():
    dog = Watchdog(0, timeout_s=30)
    answers = iter([RuntimeError("CUDA error: an illegal memory access"), False, True])

    def done():
        answer = next(answers, True)
        if isinstance(answer, Exception):
            raise answer
        return answer
    try:
        _end(dog, dog.begin("allreduce", group()), SimpleNamespace(device_done=lambda: False))
        token = dog.begin("allgather", group())
        dog._device[token] = done  # as end_when leaves it, polled from the next period on
        deadline = time.monotonic() + 20
        while [c.op for c in dog.inflight()] != ["allreduce"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [c.op for c in dog.inflight()] == ["allreduce"] and dog._thread.is_alive()
    finally:
        dog.close()
