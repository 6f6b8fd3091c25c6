"""The process grid: the world factored into named axes, each axis a set of communicators.

Axes run outermost to innermost: ``dp`` (across nodes), ``pp``, ``cp``, ``tp`` (inside a node). The
ranks that hold the same parameters, dp x cp, form one more group, ``dp_cp`` (``replica_axis``): it
sums gradients and shards ZeRO-1 (it is the dp group itself when cp = 1).

Placement: ranks are ordered by (node, node-local rank), NOT by world rank, and grid coordinates
are assigned along that order with tp varying fastest. So round-robin placement (even ranks on
node 0, odd on node 1) still yields node-local tp groups. The result is then verified from the node
map: each group reports whether it crosses nodes, and a tp group that does is a loud warning (or,
with ``strict_placement``, an error) that says what it costs.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from hpctrain.comm.collectives import Communicator
from hpctrain.comm.intra_node import RouteChoice, route_intra_node
from hpctrain.comm.watchdog import CommStats, Watchdog
from hpctrain.errors import GridError, LaunchError, everywhere
from hpctrain.config.layout import Layout
from hpctrain.config.rules import resolve_sizes, tp_across_nodes
from hpctrain.runtime import env
from hpctrain.runtime.launcher import RankInfo, missing_thread_multiple

if TYPE_CHECKING:
    import torch

AXES = ("dp", "pp", "cp", "tp")  # outermost -> innermost


def _position(coords: dict[str, int], varying: tuple[str, ...], sizes: dict[str, int]) -> int:
    """Rank inside the group whose members differ along ``varying`` (outermost first, last fastest)."""
    position = 0
    for axis in varying:
        position = position * sizes[axis] + coords[axis]
    return position


def layout_coordinates(order: list[int], sizes: dict[str, int]) -> dict[int, dict[str, int]]:
    """Coordinates of each world rank given the placement ``order`` (innermost axis fastest)."""
    coords = {}
    for position, rank in enumerate(order):
        rest, c = position, {}
        for axis in reversed(AXES):
            rest, c[axis] = divmod(rest, sizes[axis])
        coords[rank] = c
    return coords


class ProcessGrid:
    """This rank's view of the dp x pp x cp x tp grid. Built collectively by ``ProcessGrid.build``."""

    def __init__(self, info: RankInfo, sizes: dict[str, int], coords: dict[str, int],
                 comms: dict[str, Communicator], crosses_nodes: dict[str, bool], world: Communicator,
                 watchdog: Watchdog, stats: CommStats, warnings: list[str]):
        self.info, self.sizes, self.coords = info, sizes, coords
        self._comms, self.crosses_nodes, self.world = comms, crosses_nodes, world
        self.layout: Layout | None = None  # set by from_config
        self.watchdog, self.stats, self.warnings = watchdog, stats, warnings
        self.device: torch.device | None = None  # set by use_device
        self.intra_node = "mpi"  # how the dp group reduces CPU floats: "shm", "shm-hierarchical" or "mpi"
        self.intra_node_routes = RouteChoice("mpi")  # with its auto routing table (note(): for the start line)
        self._extra: list[Communicator] = []  # sub-groups split off later (node_split)

    @classmethod
    def from_config(cls, cfg, info: RankInfo, mpi_world=None, timeout_s: float | None = None) -> "ProcessGrid":
        """Collective: the grid of ``cfg``'s validated ``Layout`` (``grid.layout``), with its
        ``parallel.backend``, ``parallel.strict_placement``, ``comm.timeout_s`` (``$HPCTRAIN_COMM_TIMEOUT``
        overrides it when set; an explicit ``timeout_s`` overrides both) and ``comm.check``."""
        layout = Layout.from_config(cfg, info.size)
        p = cfg.parallel
        if timeout_s is None:
            timeout_s = env.comm_timeout_s(cfg.comm.timeout_s)
        grid = cls.build(info, mpi_world, dp=layout.dp_size, pp=layout.pp_size, tp=layout.tp_size,
                         cp=layout.cp_size, strict_placement=p.strict_placement, backend=p.backend, timeout_s=timeout_s,
                         check=cfg.comm.check, ep=layout.ep_size)
        grid.layout = layout
        if layout.ep_size > 1:
            grid.comm("ep").alltoall_by_peer_bytes = cfg.comm.alltoall_by_peer_kib << 10
        try:
            grid.use_intra_node(cfg.comm.intra_node, progress=cfg.comm.shm_progress,
                                cache_dir=env.cache_dir(cfg.data.cache_dir), use_cache=cfg.comm.route_cache)
        except Exception:
            grid.close()  # every rank raises alike: nothing is left waiting
            raise
        return grid

    def use_intra_node(self, choice: str, stream=None, progress: str = "call", cache_dir: str = "",
                       use_cache: bool = True) -> str:
        """Collective over the world: route the dp group's CPU float sums per ``comm.intra_node``
        (``choice``; ``progress``: ``comm.shm_progress``; ``cache_dir`` / ``use_cache``: auto's routing table,
        routes.py); sets and returns ``self.intra_node``: "shm" (one node), "shm-hierarchical" (shared
        memory on each node, MPI between nodes) or "mpi", and ``self.intra_node_routes``.
        Raises IntraNodeError for "shm"."""
        stream = sys.stderr if stream is None else stream  # the stream of the call, not of the import
        axis = self.replica_axis
        self.intra_node_routes = route_intra_node(self.comm(axis), self.world, choice, stream,
                                                  node_split=lambda: self.node_split(axis), progress=progress,
                                                  cache_dir=cache_dir, use_cache=use_cache)
        self.intra_node = self.intra_node_routes.kind
        return self.intra_node

    @classmethod
    def build(cls, info: RankInfo, mpi_world=None, dp: int = 0, pp: int = 1, tp: int = 1, cp: int = 1,
              strict_placement: bool = False, backend: str = "auto", timeout_s: float | None = None,
              check: bool = False, stream=None, ep: int = 1) -> "ProcessGrid":
        """Collective over the world: split it into dp/pp/cp/tp (and dp_cp) communicators, verify placement.
        With ``ep`` > 1 also the expert groups: "ep", ``ep`` consecutive ranks of the replica group (dp x cp
        position // ep), and "ep_replica", the replicas holding the same experts (position % ep).

        Every rank validates the same inputs, so a bad layout raises GridError on every rank with no
        communication (nothing can hang). ``mpi_world``: the mpi4py communicator to split (default
        COMM_WORLD). ``timeout_s`` (default ``$HPCTRAIN_COMM_TIMEOUT``, else the ``comm.timeout_s``
        default) bounds every communication call of this grid; ``check`` turns on comm.check fingerprints.
        """
        from mpi4py import MPI

        from hpctrain.config import CommConfig

        stream = sys.stderr if stream is None else stream  # the stream of the call, not of the import
        mpi_world = MPI.COMM_WORLD if mpi_world is None else mpi_world
        sizes = resolve_sizes(info.size, dp=dp, pp=pp, tp=tp, cp=cp)
        if timeout_s is None:
            timeout_s = env.comm_timeout_s(CommConfig.timeout_s)
        order = sorted(range(info.size), key=lambda r: (info.node_of_rank[r], info.local_rank_of_rank[r]))
        coords_of = layout_coordinates(order, sizes)
        if timeout_s > 0:  # the watchdog thread polls MPI while the main thread is inside it
            problem = missing_thread_multiple(f"the communication watchdog (comm.timeout_s={timeout_s:g})")
            if problem:  # the same on every rank: refused without communication
                raise everywhere(LaunchError(problem + "; or set comm.timeout_s=0 (no hang detection)"))
        peers = mpi_world.allgather((info.hostname, info.node, os.getpid()))  # named in hang reports
        watchdog = Watchdog(info.rank, timeout_s, status_comm=mpi_world.Dup(), peers=peers)
        stats = CommStats()
        warnings = []

        comms, crosses_nodes = {}, {}
        groups = [(axis, (axis,)) for axis in AXES] + ([("dp_cp", ("dp", "cp"))] if sizes["cp"] > 1 else [])
        for name, varying in groups:  # each group: the ranks that differ only along ``varying``
            fixed = [a for a in AXES if a not in varying]
            key_of = {r: tuple(c[a] for a in fixed) for r, c in coords_of.items()}
            position = {r: _position(c, varying, sizes) for r, c in coords_of.items()}
            colors = sorted(set(key_of.values()))
            mine = key_of[info.rank]
            members = tuple(sorted((r for r in range(info.size) if key_of[r] == mine), key=position.__getitem__))
            mpi_comm = mpi_world.Split(color=colors.index(mine), key=position[info.rank])
            if mpi_comm.Get_rank() != position[info.rank] or mpi_comm.Get_size() != len(members):
                raise GridError(f"internal: {name} communicator rank {mpi_comm.Get_rank()} != coordinate "
                                f"{position[info.rank]}")
            crosses_nodes[name] = len({info.node_of_rank[r] for r in members}) > 1
            comms[name] = Communicator(mpi_comm, name, members, watchdog, stats, backend, check)
        if ep > 1:  # expert groups, carved out of the replica group
            replica = {r: _position(c, ("dp", "cp"), sizes) for r, c in coords_of.items()}
            for name, group_of, rank_in in (("ep", lambda q: q // ep, lambda q: q % ep),
                                            ("ep_replica", lambda q: q % ep, lambda q: q // ep)):
                key_of = {r: (c["pp"], c["tp"], group_of(replica[r])) for r, c in coords_of.items()}
                colors = sorted(set(key_of.values()))
                mine = key_of[info.rank]
                members = tuple(sorted((r for r in range(info.size) if key_of[r] == mine),
                                       key=lambda r: rank_in(replica[r])))
                mpi_comm = mpi_world.Split(color=colors.index(mine), key=rank_in(replica[info.rank]))
                crosses_nodes[name] = len({info.node_of_rank[r] for r in members}) > 1
                comms[name] = Communicator(mpi_comm, name, members, watchdog, stats, backend, check)

        tp_nodes: dict[tuple, set] = {}
        for r, c in coords_of.items():
            tp_nodes.setdefault((c["dp"], c["pp"], c["cp"]), set()).add(info.node_of_rank[r])
        bad_tp = any(len(nodes) > 1 for nodes in tp_nodes.values())
        if bad_tp:
            per_node = sorted(set(info.node_of_rank.count(n) for n in range(info.num_nodes)))
            message = tp_across_nodes(tp, per_node)
            if strict_placement:
                raise GridError(message + " (parallel.strict_placement=true)")
            warnings.append(message)
            if info.rank == 0:
                print(f"hpctrain: WARNING: {message}", file=stream, flush=True)
        if sizes["cp"] > 1 and crosses_nodes["cp"] and not bad_tp:
            message = (f"context-parallel groups span nodes (cp={cp}, tp={tp}): ring attention passes every "
                       f"layer's K/V over the inter-node network; cp x tp dividing the ranks per node keeps it inside")
            warnings.append(message)
            if info.rank == 0:
                print(f"hpctrain: WARNING: {message}", file=stream, flush=True)

        world = Communicator(mpi_world, "world", tuple(range(info.size)), watchdog, stats, backend, check)
        return cls(info, sizes, coords_of[info.rank], comms, crosses_nodes, world, watchdog, stats, warnings)

    def comm(self, axis: str) -> Communicator:
        """The one accessor for a group's communicator: ``axis`` is "dp", "pp", "cp", "tp", "dp_cp" (the
        dp group when cp = 1), "ep" and "ep_replica" (with parallel.ep > 1) or "world"."""
        if axis == "dp_cp" and axis not in self._comms:
            return self._comms["dp"]
        return self.world if axis == "world" else self._comms[axis]

    @property
    def replica_axis(self) -> str:
        """The group of the ranks holding the same parameters: "dp", or "dp_cp" with context parallelism
        (gradient sums, ZeRO-1 shards, the loss's sum, shared-memory reduction, compression)."""
        return "dp_cp" if self.sizes["cp"] > 1 else "dp"

    def node_split(self, axis: str):
        """Collective over the ``axis`` group: ((intra, inter), problem). ``intra``: the group's members
        on this node; ``inter``: the members with the same position inside their node, one per node.
        Returns (None, reason) when the split does not apply (one node; nodes holding different
        numbers of the group's members)."""
        comm, info = self.comm(axis), self.info
        node_of = [info.node_of_rank[r] for r in comm.members]
        nodes = sorted(set(node_of))
        counts = {n: node_of.count(n) for n in nodes}
        if len(nodes) == 1:
            return None, f"the {axis} group lies on one node"
        if len(set(counts.values())) > 1:
            return None, f"the {axis} group's nodes hold different numbers of its ranks ({counts})"
        mine = node_of[comm.rank]
        position = [r for r, n in zip(comm.members, node_of) if n == mine].index(info.rank)
        intra_members = tuple(r for r, n in zip(comm.members, node_of) if n == mine)
        inter_members = tuple(r for r, n in zip(comm.members, node_of)
                              if [q for q, m in zip(comm.members, node_of) if m == n].index(r) == position)
        intra_mpi = comm.mpi.Split(color=nodes.index(mine), key=comm.rank)
        inter_mpi = comm.mpi.Split(color=position, key=comm.rank)
        intra = Communicator(intra_mpi, f"{axis}-intra", intra_members, self.watchdog, self.stats,
                             comm.backend_choice, comm.check)
        inter = Communicator(inter_mpi, f"{axis}-inter", inter_members, self.watchdog, self.stats,
                             comm.backend_choice, comm.check)
        intra.trace = inter.trace = comm.trace
        if comm._device is not None:  # the device backends of the sub-groups, in the same order everywhere
            assert self.device is not None  # use_device gave comm its device backend
            for sub in (intra, inter):
                sub.prepare_device(self.device)
        self._extra.extend((intra, inter))
        return (intra, inter), None

    def shm_collectives(self, axis: str):
        """Collective over the world: the ``axis`` group's collectives through shared memory, for
        benchmarks (``hpctrain bench comm --impls hpctrain-shm``): a ``ShmCollectives`` when the group lies
        on one node, else a second ``Communicator`` of the group with the hierarchical route (raises
        IntraNodeError when there is none). Both have allreduce / reduce_scatter / allgather and close()."""
        from hpctrain.comm.shm import ShmCollectives, ShmSpansNodes

        comm = self.comm(axis)
        try:
            return ShmCollectives(comm)
        except ShmSpansNodes:
            pass
        routed = Communicator(comm.mpi, comm.name, comm.members, self.watchdog, self.stats, comm.backend_choice)
        route_intra_node(routed, self.world, "shm", node_split=lambda: self.node_split(axis))
        return routed

    def use_device(self, device) -> dict[str, str]:
        """Collective over the world: set up every group's backend for tensors on ``device`` (NCCL
        communicators are created here, in one fixed order on every rank, never lazily inside a
        point-to-point call that only two ranks make). Returns {axis: backend name}. On CUDA, backward
        hooks (the dp buckets) run on autograd's device thread, so MPI must allow calls from a thread other
        than the main one (SERIALIZED at least; refused on every rank, without communication, otherwise)."""
        if str(device).startswith("cuda"):
            problem = missing_thread_multiple("training on CUDA (backward hooks run on autograd's device thread)",
                                              needed="SERIALIZED")
            if problem:  # the same on every rank: refused without communication
                raise everywhere(LaunchError(problem))
        self.device = device
        return {axis: self.comm(axis).prepare_device(device) for axis in self._axes_and_world()}

    def describe(self) -> dict:
        """This rank's record for ``hpctrain info --json``."""
        record = {"rank": self.info.rank, "node": self.info.node, "hostname": self.info.hostname,
                  "local_rank": self.info.local_rank}
        record.update(self.coords)
        for axis in self._comms:
            record[f"{axis}_group"] = list(self._comms[axis].members)
        record["crosses_nodes"] = [a for a in self._comms if self.crosses_nodes[a]]
        return record

    def communicators(self) -> list[Communicator]:
        """Every communicator of this grid: the axes, the world, and node splits made since."""
        return [self.comm(axis) for axis in self._axes_and_world()] + self._extra

    def _axes_and_world(self) -> list[str]:
        """The grid's groups in one fixed order: the axes, dp_cp when built, the world."""
        return [*self._comms, "world"]

    def set_trace(self, recorder) -> None:
        """Record every call of every group into ``recorder`` (a TraceRecorder; None stops)."""
        for comm in self.communicators():
            comm.trace = recorder

    def close(self) -> None:
        for comm in self.communicators():
            comm.close()
        self.watchdog.close()

    def free_requests(self) -> None:
        """Local (no collective): free every group's persistent MPI requests, so that MPI_Finalize on an
        error path finds none left (MPICH says "freeing inactive persistent request" for each)."""
        for comm in self.communicators():
            for op in comm.recurring:
                op.free()

