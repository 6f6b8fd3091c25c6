"""Collectives of a group that spans nodes: shared memory on each node, MPI between nodes (issue #21).

``HierarchicalCollectives`` serves a group (the dp group) of G = N x L ranks, L on each of N nodes, in
node-major order (group rank g = n*L + l: node n, position l on it), through two sub-groups from
``ProcessGrid.node_split``: ``intra`` (the L members on this node: a ``ShmCollectives`` window) and
``inter`` (the N members at position l, one per node: raw MPI). Per portion (``PORTION_BYTES`` per rank):

- ``allreduce(x)``: every rank copies x into its slot; rank l sums slice l (balanced, any length) of
  its node's slots in local order 0..L-1, MPI ``Allreduce`` over ``inter`` adds the N node sums and
  writes the total straight into rank l's slot (no staging copy), then every rank copies every
  slice out of the slots. 2(N-1)/N x x/L bytes per rank cross the network, not 2(G-1)/G x x.
- ``reduce_scatter(out[m], in[G*m])``: in viewed as [N, L, m]; rank l sums in[:, l, :] over its node
  (local order) into a private [N, m] buffer; MPI ``Reduce_scatter_block`` over ``inter`` puts the
  sum of block n*L + l straight into ``out``.
- ``allgather(out[G*m], in[m])``: the inverse: MPI ``Allgather`` over ``inter`` of this rank's block
  straight into its slot ([N, m]: the blocks of ranks n'*L + l), then every rank copies every node
  peer's slot into out[:, j, :].

Order of summation, per element: the node sum in local order, then MPI's order over the N nodes (one
algorithm per message size: the same every call). The allreduce result is bit-identical on every
rank when MPI's allreduce gives its ranks the same bits, as its standard algorithms do (at N = 2
always: a + b == b + a). Calls are made by the group's ``Communicator`` through its ``ShmRoute``: it
registers each as ONE collective of the group on the watchdog; the inner MPI calls on ``inter`` go
to mpi4py directly, unregistered, so a hang report names the group's call, never ``inter``.
Duck-types ``ShmCollectives``'s private API (``size``, ``rank``, ``_array``, ``_allreduce``, ...).
"""
from __future__ import annotations

import numpy as np

from hpctrain.comm.shm import ShmCollectives, ShmUnavailable, _slice

HIERARCHICAL = "shm-hierarchical"  # grid.intra_node / hpctrain info: how the dp group reduces CPU floats
PORTION_BYTES = 1 << 20  # per rank per window half: 16 MiB allreduce across 2 emulated hosts, 4 ranks:
# 256 KiB portions 64-83 ms, 1 MiB 25-37 ms, 4 MiB 28-36 ms (MPI 39-70 ms; docs/benchmarks.md)


class HierarchicalCollectives:
    """Allreduce / reduce_scatter / allgather over ``shm`` (this node's members, local rank l) and
    ``inter_mpi`` (an mpi4py communicator: one member per node, rank = node index). Collective to close."""

    kind = HIERARCHICAL

    def __init__(self, shm: ShmCollectives, inter_mpi, group_rank: int):
        from mpi4py import MPI

        self.shm, self.inter, self.sum = shm, inter_mpi, MPI.SUM
        self.nodes, self.local_size, self.local = inter_mpi.Get_size(), shm.size, shm.rank
        self.size, self.rank = self.nodes * self.local_size, group_rank
        self._scratch = np.empty(shm.capacity, dtype=np.uint8)  # reduce_scatter's node sums ([N, portion])
        self._array = shm._array

    def _allreduce(self, flat: np.ndarray) -> None:
        shm, local_size, l = self.shm, self.local_size, self.local
        step = shm._elements(flat)
        for off in range(0, flat.size, step):
            x = flat[off:off + step]
            views = shm._views(x.dtype, x.size)
            np.copyto(views[l], x)
            shm._sync()
            lo, hi = _slice(x.size, local_size, l)
            if hi > lo:  # the same on every rank at position l: every inter member calls or none does
                mine = x[lo:hi]
                np.add(views[0][lo:hi], views[1][lo:hi], out=mine)
                for j in range(2, local_size):
                    np.add(mine, views[j][lo:hi], out=mine)
                self.inter.Allreduce(mine, views[l][lo:hi], op=self.sum)  # lands in the window
            shm._sync()
            for j in range(local_size):
                lo, hi = _slice(x.size, local_size, j)
                np.copyto(x[lo:hi], views[j][lo:hi])

    def _reduce_scatter(self, output: np.ndarray, input: np.ndarray) -> None:
        shm, nodes, local_size, l = self.shm, self.nodes, self.local_size, self.local
        m = output.size
        blocks = input.reshape(nodes, local_size, m)
        scratch = self._scratch.view(input.dtype)
        step = max(1, shm._elements(input) // self.size)
        for off in range(0, m, step):
            c = min(step, m - off)
            views = [v.reshape(nodes, local_size, c) for v in shm._views(input.dtype, self.size * c)]
            np.copyto(views[l], blocks[:, :, off:off + c])
            shm._sync()
            node_sum = scratch[:nodes * c].reshape(nodes, c)
            np.add(views[0][:, l], views[1][:, l], out=node_sum)
            for j in range(2, local_size):
                np.add(node_sum, views[j][:, l], out=node_sum)
            self.inter.Reduce_scatter_block(node_sum, output[off:off + c], op=self.sum)

    def _allgather(self, blocks: np.ndarray, source: np.ndarray, in_place: bool) -> None:
        """``blocks``: the output as [G, m]; ``source``: this rank's block (m; a row of ``blocks`` in place)."""
        shm, nodes, local_size, l = self.shm, self.nodes, self.local_size, self.local
        m = blocks.shape[1]
        grid = blocks.reshape(nodes, local_size, m)
        step = max(1, shm._elements(source) // nodes)
        for off in range(0, m, step):
            c = min(step, m - off)
            views = [v.reshape(nodes, c) for v in shm._views(source.dtype, nodes * c)]
            self.inter.Allgather(source[off:off + c], views[l])  # straight into the window
            shm._sync()
            for j in range(local_size):
                np.copyto(grid[:, j, off:off + c], views[j])

    def close(self) -> None:
        self.shm.close()


def hierarchical_collectives(comm, node_split, spans: str, capacity_bytes: int = PORTION_BYTES):
    """Collective over ``comm`` (a group that spans nodes; ``spans``: the reason flat shm refused it):
    ``(HierarchicalCollectives, "")``, or ``(None, reason)`` alike on every member when the scheme
    cannot serve it. ``node_split()``: ``ProcessGrid.node_split``'s ((intra, inter), None) | (None, why);
    None (no grid) gives ``spans``."""
    if node_split is None:
        return None, spans
    head = (f"shared-memory collectives on group '{comm.name}' (world ranks {list(comm.members)}): the group "
            f"spans nodes")
    pair, problem = node_split()
    if pair is None:
        return None, (f"{head} and {problem}; the hierarchical scheme (shared memory on each node, MPI between "
                      f"nodes) needs the same number on every node")
    intra, inter = pair
    if intra.size == 1:
        return None, f"{head} with one of its ranks on each: there is nothing to reduce in shared memory"
    from mpi4py import MPI

    node_major = comm.rank == inter.rank * intra.size + intra.rank
    if comm.mpi.allreduce(int(not node_major), op=MPI.MAX):
        return None, (f"{head} and its ranks are not in node-major order (group rank = node x {intra.size} + "
                      f"position on the node), which the hierarchical scheme needs")
    try:
        shm = ShmCollectives(intra, capacity_bytes)  # collective over intra; refuses alike on its members
    except ShmUnavailable as e:
        reason = str(e)
    else:
        reason = ""
    if comm.mpi.allreduce(int(bool(reason)), op=MPI.MAX):  # one node failed: the whole group falls back
        if not reason:
            shm.close()
        return None, reason or (f"{head} and a shared window could not be allocated on another of its nodes")
    return HierarchicalCollectives(shm, inter.mpi, comm.rank), ""
