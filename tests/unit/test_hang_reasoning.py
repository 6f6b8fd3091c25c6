"""The hang report's reasoning without MPI: who waits for whom, and what the report says of each rank."""
import os

from hpctrain.comm.hang_report import format_report, process_state, wait_chain
from hpctrain.comm.watchdog import Call, Watchdog


class FakeComm:
    def __init__(self, name, members):
        self.name, self.members = name, tuple(members)
        self.seq = self.p2p_seq = self.done_seq = 0
        self.done_op = self.done_at = None


def call_info(group, members, op, seq, peer=None, age=20.0):
    return {"group": f"{group}{list(members)}", "name": group, "members": list(members), "op": op, "seq": seq,
            "peer": peer, "peer_world": None if peer is None else members[peer], "age": age,
            "text": f"{op} #{seq} on group '{group}'"}


def answer(rank, inflight=(), blocked=True, done=None, where="x.py:1 in f"):
    return {"rank": rank, "noticed": False, "inflight": list(inflight), "blocked": blocked and bool(inflight),
            "done": done or {}, "started": {}, "where": {"main thread": where}}


def test_the_chain_leads_past_a_waiting_rank_to_the_silent_one():
    # rank 0 waits in dp allreduce #5 with rank 2; rank 2 waits in a pp exchange for rank 3; 3 is silent
    answers = {0: answer(0, [call_info("dp", [0, 2], "allreduce", 5)]),
               2: answer(2, [call_info("pp", [2, 3], "exchange", 7, peer=1)])}
    causes, waits = wait_chain(answers, [2])
    assert causes == [3] and list(waits) == [2]


def test_a_rank_busy_in_python_is_the_cause_even_with_calls_posted():
    answers = {1: answer(1, [call_info("dp", [0, 1], "allreduce", 3)], blocked=False, where="data.py:9 in load")}
    assert wait_chain(answers, [1]) == ([1], {})


def test_report_names_the_missing_rank_its_node_pid_and_last_call():
    peers = [("h0", 0, 100), ("h1", 1, 101)]
    watchdog = Watchdog(0, timeout_s=0, peers=peers)
    dp = FakeComm("dp", [0, 1])
    stalled = Call("allreduce", dp, 64, 5)
    answers = {0: answer(0, [call_info("dp", [0, 1], "allreduce", 5)]),
               1: answer(1, [], done={"dp[0, 1]": ("allreduce", 4, 3.5)}, where="loader.py:12 in next")}
    report = format_report(watchdog, stalled, answers, window_s=4)
    assert "allreduce #5 of 64 bytes on group 'dp' (world ranks [0, 1]) has not completed" in report
    assert "cause: rank 1 (node 1 h1, pid 101): it is in no communication call; main thread at loader.py:12" in report
    assert "rank 1 (node 1 h1, pid 101) has not entered allreduce #5 on group dp [0, 1]; its last completed " \
           "call there: allreduce #4, 3.5 s ago" in report


def test_a_silent_rank_on_another_host_and_a_stopped_one_here():
    peers = [("elsewhere", 1, 1), ("here", 0, os.getpid())]
    assert "on host elsewhere" in process_state(0, peers)
    import socket
    peers[1] = (socket.gethostname(), 0, os.getpid())
    assert process_state(1, peers).startswith("running")  # this very process: alive, state R
    peers[1] = (socket.gethostname(), 0, 2 ** 22 + 12345)
    assert process_state(1, peers) == "dead (no such process)"


def test_a_stall_whose_causes_all_compile_is_not_a_hang_and_the_report_says_compile():
    from hpctrain.comm.hang_report import compiling_causes

    pp = FakeComm("pp", [0, 1])
    waiting = Call("exchange", pp, 64, 1, peer=1)  # rank 0 waits for its pipeline neighbour, rank 1
    answers = {0: answer(0, [call_info("pp", [0, 1], "exchange", 1, peer=1)]), 1: answer(1, [], where="torch/x.py:1")}
    assert compiling_causes(waiting, answers) == []  # busy in Python, not compiling: a cause
    answers[1]["compiling"] = True
    assert compiling_causes(waiting, answers) == [1]
    watchdog = Watchdog(0, timeout_s=0, peers=[("h0", 0, 100), ("h1", 1, 101)])
    assert "it is in no communication call (inside torch.compile)" in format_report(watchdog, waiting, answers, 4)
    dp = FakeComm("dp", [0, 1, 2])  # two missing ranks: one compiling, one silent (dead or stopped)
    stalled = Call("allreduce", dp, 8, 3)
    answers = {0: answer(0, [call_info("dp", [0, 1, 2], "allreduce", 3)]), 1: answers[1]}
    assert compiling_causes(stalled, answers) == []
    # every member inside a nonblocking reduction (launched in the backward) that cannot advance while rank 1
    # compiles (MPI progresses it only inside MPI calls): the compile is the cause; nobody compiling: a hang
    inside = [call_info("dp", [0, 1, 2], "allreduce", 3)]
    answers = {r: answer(r, inside, where="torch/x.py:1") for r in (0, 1, 2)}
    assert compiling_causes(stalled, answers) == []
    answers[1]["compiling"] = True
    assert compiling_causes(stalled, answers) == [1]


def test_compiling_is_read_off_the_main_threads_whole_stack():
    from hpctrain.comm import hang_report

    namespace = {"probe": hang_report.compiling}  # a frame whose code lives under torch/_inductor/
    exec(compile("seen = probe()", os.sep.join(("", "x", "torch", "_inductor", "fake.py")), "exec"), namespace)
    assert namespace["seen"] is True and hang_report.compiling() is False
    # a compiled backward's first call fakes the saved tensors (AOT autograd) before inductor is on the stack
    exec(compile("seen = probe()", os.sep.join(("", "x", "torch", "_subclasses", "meta_utils.py")), "exec"),
         namespace)
    assert namespace["seen"] is True


def test_a_shared_memory_call_is_named_so_and_a_rank_stopped_inside_it_has_entered():
    """Rank 2 entered dp allreduce #5 through the shared-memory window (its header says so) but stopped before
    the second barrier, where ranks 0 and 1 wait; rank 3 never entered (its header names call #4)."""
    from types import SimpleNamespace

    dp = FakeComm("dp", [0, 1, 2, 3])
    entries, arrivals = [5, 5, 5, 4], [10, 10, 9, 8]  # this rank (0) waits in its 10th barrier
    dp.shm = SimpleNamespace(shm=SimpleNamespace(progress=lambda: (entries, arrivals, 10, 0)))
    stalled = Call("allreduce", dp, 64, 5)
    stalled.route = "shared memory"
    watchdog = Watchdog(0, timeout_s=0, peers=[("h0", 0, 100 + r) for r in range(4)])
    answers = {0: answer(0, [call_info("dp", [0, 1, 2, 3], "allreduce", 5)]),
               1: answer(1, [call_info("dp", [0, 1, 2, 3], "allreduce", 5)])}  # 2 and 3 do not answer
    report = format_report(watchdog, stalled, answers, window_s=4)
    assert "allreduce #5 (shared memory) of 64 bytes on group 'dp' (world ranks [0, 1, 2, 3]) has not completed" \
        in report, report
    assert "in the call: ranks [0, 1]" in report, report
    assert "rank 2 (node 0 h0, pid 102) entered allreduce #5 (shared memory) on group dp [0, 1, 2, 3] and is " \
           "inside the shared-memory exchange, but has not arrived at the barrier this rank waits in: it did " \
           "not answer" in report, report
    assert "rank 3 (node 0 h0, pid 103) has not entered allreduce #5 (shared memory)" in report, report
    assert "rank 2 (node 0 h0, pid 102) has not entered" not in report, report
    entries[0] = 6  # this rank's window is already in a later call (a worker thread): no evidence, as before
    assert "rank 2 (node 0 h0, pid 102) has not entered allreduce #5" in format_report(watchdog, stalled, answers, 4)
