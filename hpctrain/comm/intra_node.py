"""``comm.intra_node``: a group's float host collectives through node-local shared memory (shm.py).

``route_intra_node(comm, world, choice)`` (collective over the world) gives ``comm`` (the data-parallel
group) a ``ShmRoute`` when ``choice`` is "shm" or "auto" and every group of its kind lies within one
node and can allocate a shared window, or spans nodes with the same number of its ranks on each
(hierarchical.py: shared memory on each node, MPI between nodes); the ``Communicator`` then sends
allreduce / reduce_scatter / allgather of contiguous CPU float32/float64 tensors with op "sum" through
it (``ShmRoute.takes``); with "auto", only the ops and sizes where it measured faster than MPI on this
node (routes.py: a short measurement at set-up, cached per node and MPI). Everything else (other dtypes,
CUDA tensors, other ops, "avg"/"max") stays on MPI.
Across nodes the eager call also blocks on the inter-node MPI part at call time.

When a shm call runs (``comm.shm_progress``, the route's ``when``): "call" (the default) runs it
inside the call and returns a finished handle (shared memory needs no MPI progress); "thread" hands
every call, blocking or not, to one worker thread per route, in program order, so a bucket's reduction
runs while backward computes the next (numpy's sums and copies and torch's kernels release the GIL)
and its wait for the slowest peer does not stall backward (running it at ``wait()`` instead
measured the same as "call" and was dropped). On this 2-core machine "call" measured fastest: the thread hides 98% of the reduction
(trace) but competes with backward for the cores (docs/benchmarks.md, "The dp reduction in shared
memory"); "thread" is for nodes with a spare core per rank. Every rank issues the group's collectives
in the same program order, so a shm call cannot deadlock against the MPI calls around it. The
``Communicator`` still counts and watches each call (``Watchdog``) until its work is done.
"""
from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass

import torch

from hpctrain.comm.hierarchical import hierarchical_collectives
from hpctrain.comm.routes import ROUTE_OPS, Table, bounds, choose_routes, describe, uses_shm
from hpctrain.comm.shm import ShmCollectives, ShmSpansNodes, ShmUnavailable
from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.runtime import env

SHM_DTYPES = frozenset((torch.float32, torch.float64))  # a set: a hash lookup on the hot path
ROUTE_NAMES = {"shm": "shared memory", "shm-hierarchical": "shared memory within nodes, MPI between"}


class IntraNodeError(HpcTrainError):
    """comm.intra_node=shm cannot run here (uneven nodes, one rank per node, no shared window)."""


class _Finished:
    """The work of a shm call run inside the call (``when="call"``): already complete."""

    __slots__ = ()
    done = True

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


_FINISHED = _Finished()  # stateless: one instance serves every call


class _Queued:
    """A shm call handed to the route's worker thread; ``wait`` re-raises what the call raised."""

    __slots__ = ("event", "error", "done")

    def __init__(self):
        self.event, self.error, self.done = threading.Event(), None, False

    def test(self) -> bool:
        if not self.done and self.event.is_set():
            self.wait()
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.event.wait()
            self.done = True
            if self.error is not None:
                raise self.error


class _Worker:
    """One daemon thread running the route's shm calls in the order they were made."""

    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="hpctrain-shm", daemon=True)
        self.thread.start()

    def submit(self, call, args) -> _Queued:
        work = _Queued()
        self.calls.put((call, args, work))
        return work

    def _run(self) -> None:
        while (item := self.calls.get()) is not None:
            call, args, work = item
            try:
                call(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's wait()
                work.error = exc
            work.event.set()

    def close(self) -> None:
        self.calls.put(None)
        self.thread.join()


class ShmRoute:
    """The shm backend of one ``Communicator``: same signatures as ``MpiBackend``'s three collectives.
    ``shm``: a ``ShmCollectives`` (one node) or a ``HierarchicalCollectives`` (across nodes). ``bounds``
    (comm.intra_node=auto, routes.py): {op: ((max bytes, through shm), ...)}; an op without entry: always shm.
    ``calls``: the calls it carried per op."""

    def __init__(self, shm, when: str = "call"):
        self.shm, self.when = shm, when
        if self.when not in ("thread", "call"):
            raise ValueError(f"ShmRoute: when={self.when!r}; expected thread or call")
        self.worker = _Worker() if self.when == "thread" else None
        self.route = ROUTE_NAMES.get(shm.kind, shm.kind)  # how a hang report names this route's calls
        self._enter = getattr(shm, "enter", None)  # one node's window: publish the call's number in it
        self.bounds: dict[str, tuple[tuple[float, bool], ...]] = {}
        self.calls = dict.fromkeys(ROUTE_OPS, 0)

    def takes(self, tensor: torch.Tensor, op: str = "sum", collective: str = "allreduce") -> bool:
        """Whether this call goes through shared memory: a CPU float32/float64 contiguous sum, of a size
        the table (``bounds``) gives to shm for ``collective`` (the whole buffer's bytes)."""
        if op != "sum" or tensor.dtype not in SHM_DTYPES or tensor.is_cuda or not tensor.is_contiguous():
            return False
        classes = self.bounds.get(collective)
        if classes is None:
            return True
        nbytes = tensor.nbytes
        for limit, through_shm in classes:
            if nbytes <= limit:
                return through_shm
        return False

    def _start(self, call, args, nonblocking: bool):
        if self._enter is not None:  # the Communicator has just numbered this call (Watchdog.begin)
            call, args = self._entered, (self.shm.comm.seq, call, args)
        if self.worker is not None:
            work = self.worker.submit(call, args)
            if nonblocking:
                return work
            work.wait()  # a blocking call waits for the calls queued before it too
            return None
        call(*args)
        return _FINISHED if nonblocking else None

    def _entered(self, seq: int, call, args) -> None:
        """``call(*args)`` as the group's collective number ``seq``, published in the window first."""
        assert self._enter is not None  # _start routes a call here only then
        self._enter(seq)
        call(*args)

    def allreduce(self, tensor, op="sum", nonblocking=False):
        shm = self.shm
        self.calls["allreduce"] += 1
        return self._start(shm._allreduce, (shm._array(tensor, "allreduce"),), nonblocking)

    def reduce_scatter(self, output, input, op="sum", nonblocking=False):
        shm = self.shm
        if input.numel() != shm.size * output.numel() or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input has {input.numel()} {input.dtype} elements, expected "
                             f"{shm.size} x {output.numel()} {output.dtype}")
        self.calls["reduce_scatter"] += 1
        args = (shm._array(output, "reduce_scatter"), shm._array(input, "reduce_scatter"))
        return self._start(shm._reduce_scatter, args, nonblocking)

    def allgather(self, output, input=None, nonblocking=False):
        shm = self.shm
        if output.numel() % shm.size or (input is not None and input.numel() * shm.size != output.numel()):
            raise ValueError(f"allgather: output has {output.numel()} elements, not {shm.size} x the input")
        self.calls["allgather"] += 1
        blocks = shm._array(output, "allgather").reshape(shm.size, -1)
        source = blocks[shm.rank] if input is None else shm._array(input, "allgather")
        return self._start(shm._allgather, (blocks, source, input is None), nonblocking)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()  # after every queued call: the window must outlive them
            self.worker = None
        self.shm.close()


@dataclass
class RouteChoice:
    """What ``route_intra_node`` set up: ``kind`` ("shm", "shm-hierarchical" or "mpi"); with auto's routing
    table (routes.py) ``table`` (None otherwise) and ``source`` (cached or measured, and the cache file)."""
    kind: str
    table: Table | None = None
    source: str = ""

    def note(self) -> str:
        """For the start-up line, after the kind: "" or " (auto, measured: allreduce shm > 64K, ...)"."""
        if self.table is None:
            return ""
        how = "cached" if self.source.startswith("cached") else "measured"
        return f" (auto, {how}: {describe(self.table) if uses_shm(self.table) else 'shm slower at every size'})"


def route_intra_node(comm, world, choice: str, stream=None, node_split=None, progress: str = "call",
                     cache_dir: str = "", use_cache: bool = True) -> RouteChoice:
    """Collective over ``world`` (every rank calls it with its own ``comm``, a group of one kind, e.g.
    dp): attach a ``ShmRoute`` to ``comm`` per ``choice`` ("auto" | "shm" | "mpi"). A group on one node
    reduces in its shared window; with "shm", a group spanning nodes with the same number of its ranks on
    each (``node_split``: ``ProcessGrid.node_split`` for its axis) through ``HierarchicalCollectives``
    ("auto" keeps such a group on MPI: the hierarchical training step measured no faster, docs/benchmarks.md).
    Its kind: "shm", "shm-hierarchical" or "mpi" (also for a group of one rank). All groups use a route or none does: "shm" raises
    ``IntraNodeError`` on every rank with the first reason found; "auto" falls back to MPI with one
    line on world rank 0. "auto" with a window then routes each op and size class by the table of
    ``routes.choose_routes`` (``cache_dir``: default ``runtime.env.cache_dir()``; ``use_cache``: read the
    cached table; written either way), MPI everywhere when shm measured faster nowhere."""
    stream = sys.stderr if stream is None else stream  # the stream of the call, not of the import
    if choice == "mpi":
        return RouteChoice("mpi")
    shm, reason = None, ""
    if comm.size > 1:
        try:
            shm = ShmCollectives(comm)  # collective over comm; raises on every member alike
        except ShmSpansNodes as e:
            if choice == "shm":
                shm, reason = hierarchical_collectives(comm, node_split, str(e))
            else:  # auto: the hierarchical step measured no faster than MPI (docs/benchmarks.md)
                reason = (f"{e} (comm.intra_node=shm reduces such a group hierarchically; auto keeps MPI "
                          f"across nodes, where that measured no faster)")
        except ShmUnavailable as e:
            reason = str(e)
    reason = next((r for r in world.allgather_object(reason) if r), "")
    if reason:
        if shm is not None:  # this group could, another could not: every group falls back together
            shm.close()
        if choice == "shm":
            raise everywhere(IntraNodeError(f"comm.intra_node=shm: {reason}; use comm.intra_node=auto (falls "
                                            f"back to MPI) or comm.intra_node=mpi"))
        if world.rank == 0:
            print(f"hpctrain: comm.intra_node=auto: the {comm.name} reduction uses MPI: {reason}",
                  file=stream, flush=True)
        return RouteChoice("mpi")
    if shm is None:  # a group of one rank: nothing to reduce
        return RouteChoice("mpi")
    route = comm.shm = ShmRoute(shm, progress)
    if choice != "auto":
        return RouteChoice(shm.kind)
    table, source = choose_routes(comm, world, route, cache_dir or env.cache_dir(), use_cache, progress)
    if not uses_shm(table):  # the same table in every group: each closes its window (collective over it)
        comm.shm = None
        route.close()
        return RouteChoice("mpi", table, source)
    route.bounds = bounds(table)
    return RouteChoice(shm.kind, table, source)
