"""A watchdog ``Slot`` (one reused call record per group and op: the blocking host calls of
``Communicator._host_call``, persistent collectives): in flight only between begin and end, reported as a
snapshot, and treated as ONE call across the watchdog's periods (a wait for a compiling peer keeps its patience)."""
import time
from types import SimpleNamespace

from hpctrain.comm import hang_report
from hpctrain.comm.watchdog import IDLE, OpCounter, Watchdog, clock


def group():
    return SimpleNamespace(seq=0, p2p_seq=0, done_seq=0, done_op=None, done_at=None, name="dp", rank=0, size=2,
                           members=(0, 1))


def test_a_slot_is_in_flight_between_begin_and_end_and_reported_as_a_snapshot():
    dog = Watchdog(0, timeout_s=0)
    comm = group()
    slot = dog.slot("allreduce", comm, OpCounter(), nbytes=64)
    assert slot.idle and dog.inflight() == []
    slot.begin(clock())
    first, again = dog.inflight(), dog.inflight()
    assert [c.op for c in first] == ["allreduce"] and first[0].seq == comm.seq == 1
    assert first[0] is not slot.call and first[0].key() == again[0].key()  # copies, one call
    slot.end(clock())
    assert dog.inflight() == [] and first[0].start != IDLE  # the snapshot keeps its time
    assert comm.done_seq == 1 and comm.done_op == "allreduce"
    slot.begin(clock())
    assert dog.inflight()[0].key() != first[0].key()  # the next call on the same record is another call
    slot.end(clock())
    dog.unslot(slot)
    dog.unslot(slot)  # idempotent
    slot.begin(clock())
    assert dog.inflight() == []  # forgotten


def test_a_slot_call_waiting_for_a_compiling_peer_keeps_its_patience(capfd, monkeypatch):
    """Rank 1 compiles for 1.2 s while rank 0 waits in a slot's allreduce (timeout 0.4 s): rank 0 says once that
    this is not a hang, and once the compile ends the call gets a full timeout before the report fires."""
    monkeypatch.setenv("HPCTRAIN_ERROR_GRACE_S", "0")
    compile_ends = time.monotonic() + 1.2

    def investigate(watchdog, call):
        return "hang report", [1] if time.monotonic() < compile_ends else []
    monkeypatch.setattr(hang_report, "investigate", investigate)
    aborted = []
    dog = Watchdog(0, timeout_s=0.4, abort=lambda code: aborted.append((code, time.monotonic())))
    try:
        slot = dog.slot("allreduce", group(), OpCounter(), nbytes=8)
        slot.begin(clock())
        deadline = time.monotonic() + 15
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted and aborted[0][0] == 3
        assert aborted[0][1] - compile_ends >= 0.35, aborted[0][1] - compile_ends  # a full timeout after
        err = capfd.readouterr().err
        assert err.count("inside torch.compile") == 1, err  # said once, not every period
    finally:
        dog.close()


def test_a_call_that_completes_while_the_ranks_are_asked_is_no_hang(monkeypatch):
    """The investigation of a stall takes seconds (longer when a lower rank reports); a call that completes
    meanwhile, a slot's or a registered one, is not reported: the thread goes on watching, and a later stall
    still fires."""
    monkeypatch.setenv("HPCTRAIN_ERROR_GRACE_S", "0")
    ended = []

    def investigate(watchdog, call):
        if len(ended) < 2:  # the first two stalls complete while their ranks are asked
            ended.append(call.op)
            if call.op == "allreduce":
                slot.end(clock())
            else:
                watchdog.end(token)
        return "hang report", []
    monkeypatch.setattr(hang_report, "investigate", investigate)
    aborted = []
    dog = Watchdog(0, timeout_s=0.2, abort=aborted.append)
    try:
        comm = group()
        slot = dog.slot("allreduce", comm, OpCounter(), nbytes=8)
        slot.begin(clock())
        token = dog.begin("reduce_scatter", comm, 64)
        deadline = time.monotonic() + 10
        while len(ended) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)
        assert sorted(ended) == ["allreduce", "reduce_scatter"] and aborted == [] and dog.noticed is None
        dog.begin("broadcast", comm)  # a real stall: reported
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted == [3]
    finally:
        dog.close()


def test_a_grid_closed_during_an_investigation_reports_nothing_and_its_thread_ends(monkeypatch):
    """A run that ends while its watchdog asks the ranks about a stall (one process may train several runs, one
    grid each): ``close`` waits for the thread, which stops asking and reports nothing."""
    monkeypatch.setenv("HPCTRAIN_ERROR_GRACE_S", "0")
    asking = []

    def investigate(watchdog, call):
        asking.append(call.op)
        while not watchdog.closed:
            time.sleep(0.01)
        return "hang report", []
    monkeypatch.setattr(hang_report, "investigate", investigate)
    aborted = []
    dog = Watchdog(0, timeout_s=0.2, abort=aborted.append)
    dog.begin("allreduce", group())
    deadline = time.monotonic() + 10
    while not asking and time.monotonic() < deadline:
        time.sleep(0.02)
    assert asking == ["allreduce"]
    dog.close()
    assert not dog._thread.is_alive() and aborted == []
