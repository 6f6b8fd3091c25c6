"""The machine the performance model plans for: devices, link levels, and the link profile loader.

Units: FLOP/s in TFLOP/s (1e12), memory in GiB (2**30 bytes), HBM bandwidth in GB/s (1e9 bytes/s),
link bandwidths given on the command line in Gbit/s (1e9 bits/s, the ``gbps`` of ``--intra-gbps``),
latencies ``alpha_s`` in seconds and inverse bandwidths ``beta_s_per_byte`` in seconds per byte.

Link model (the one ``hpctrain bench comm --profile`` fits, hpctrain/bench/profile.py): a collective
on a group of ``p`` ranks costs ``alpha + beta * w``, where ``w`` is the bytes one rank puts on the wire
under the bandwidth-optimal algorithms: allreduce ``2(p-1)/p n``; reduce_scatter, allgather, broadcast
``(p-1)/p n``; sendrecv ``n``. Two levels: ``intra`` (ranks on one node) and ``inter`` (between nodes,
each rank's share of its node's network when every rank of the node communicates at once).

The profile JSON (``hpctrain bench comm --profile OUT.json``; keys the planner reads)::

    {"levels": {"intra": {"alpha_s": float, "beta_s_per_byte": float, "fit_error": float, "ranks": int},
                "inter": {...}},
     "collectives": {"allreduce": {"intra": {"alpha_s": .., "beta_s_per_byte": ..}, "inter": {...}},
                     "reduce_scatter": {...}, "allgather": {...}, "sendrecv": {...}, ...},
     "device": {"name": "a100", "peak_tflops": float, "memory_gib": float, "efficiency": float,
                "hbm_gbps": float}}

``levels`` is required with at least one level; each level and each per-collective entry needs
``alpha_s`` and ``beta_s_per_byte`` (``fit_error``, ``ranks`` and other keys are optional). The planner
uses a collective's own fit where the profile has one for that level, else the level's pooled fit.
``collectives`` and ``device`` (every key of it optional) may be absent.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

from hpctrain.plan.devices import DEVICES, DTYPE_BYTES, Device, PlanError, device_preset  # noqa: F401 (re-exported)

LEVELS = ("intra", "inter")
DEFAULT_ALPHA_S = {"intra": 5e-6, "inter": 1e-5}  # per collective; NCCL/MPI small-message latencies


@dataclass(frozen=True)
class Link:
    """``t = alpha_s + beta_s_per_byte * wire_bytes`` (seconds)."""

    alpha_s: float
    beta_s_per_byte: float


@dataclass(frozen=True)
class LinkProfile:
    """Link fits per level, and per collective where measured; ``device``: the profile's device hints."""

    levels: dict[str, Link]
    collectives: dict[str, dict[str, Link]] = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    source: str = ""

    def link(self, op: str, level: str) -> Link:
        """The fit for ``op`` on ``level``: the collective's own where measured, else the level's."""
        own = self.collectives.get(op, {}).get(level)
        if own is not None:
            return own
        if level not in self.levels:
            raise PlanError(f"{self.source or 'the link profile'} has no {level!r} level (it has "
                            f"{', '.join(self.levels)}); profile on a machine with that level or give --{level}-gbps")
        return self.levels[level]


def gbps_to_beta(gbps: float) -> float:
    """Gbit/s -> seconds per byte."""
    if not gbps > 0:
        raise PlanError(f"link bandwidth must be > 0 Gbit/s, got {gbps}")
    return 8.0 / (gbps * 1e9)


def links_from_bandwidth(intra_gbps: float, inter_gbps: float | None, intra_alpha_s: float = DEFAULT_ALPHA_S["intra"],
                         inter_alpha_s: float = DEFAULT_ALPHA_S["inter"]) -> LinkProfile:
    """Levels from per-rank unidirectional bandwidths in Gbit/s (``inter_gbps`` None: one node only)."""
    levels = {"intra": Link(intra_alpha_s, gbps_to_beta(intra_gbps))}
    if inter_gbps is not None:
        levels["inter"] = Link(inter_alpha_s, gbps_to_beta(inter_gbps))
    return LinkProfile(levels, source="--intra-gbps/--inter-gbps")


def _number(where: str, entry: dict, key: str) -> float:
    if key not in entry:
        raise PlanError(f"{where}: missing key {key!r} (have: {', '.join(entry) or 'none'})")
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _link(where: str, entry) -> Link:
    if not isinstance(entry, dict):
        raise PlanError(f"{where}: expected an object with alpha_s and beta_s_per_byte, got {entry!r}")
    return Link(_number(where, entry, "alpha_s"), _number(where, entry, "beta_s_per_byte"))


def parse_profile(doc, source: str = "profile") -> LinkProfile:
    """Validate a profile document (the JSON above) into a LinkProfile; errors name the missing key."""
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    if "levels" not in doc:
        raise PlanError(f"{source}: missing key 'levels' (write it with `hpctrain bench comm --profile OUT.json`)")
    raw_levels = doc["levels"]
    if not isinstance(raw_levels, dict) or not raw_levels:
        raise PlanError(f"{source}: levels: expected an object with 'intra' and/or 'inter', got {raw_levels!r}")
    levels = {}
    for name, entry in raw_levels.items():
        if name not in LEVELS:
            raise PlanError(f"{source}: levels: unknown level {name!r}; expected {' or '.join(LEVELS)}")
        levels[name] = _link(f"{source}: levels.{name}", entry)
    collectives: dict[str, dict[str, Link]] = {}
    raw_coll = doc.get("collectives", {})
    if not isinstance(raw_coll, dict):
        raise PlanError(f"{source}: collectives: expected an object, got {raw_coll!r}")
    for op, per_level in raw_coll.items():
        if not isinstance(per_level, dict):
            raise PlanError(f"{source}: collectives.{op}: expected an object of levels, got {per_level!r}")
        collectives[op] = {lv: _link(f"{source}: collectives.{op}.{lv}", e) for lv, e in per_level.items()
                           if lv in LEVELS}
    device = doc.get("device") or {}
    if not isinstance(device, dict):
        raise PlanError(f"{source}: device: expected an object, got {device!r}")
    return LinkProfile(levels, collectives, dict(device), source)


def load_profile(path: str) -> LinkProfile:
    """Read and validate a link profile JSON (schema in the module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise PlanError(f"cannot read link profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"link profile {path} is not valid JSON: {exc}") from None
    return parse_profile(doc, f"profile {path}")


def device_from_profile(profile: LinkProfile, name: str = "", ranks_per_node: int = 0) -> Device:
    """The device named by ``name`` (else the profile's ``device.name``), with the profile's overrides.

    A CPU profile measures each rank's rate with its ``ranks_per_node`` ranks busy on ``cores_per_node``
    cores; for ``ranks_per_node`` other ranks per node the rate is rescaled: ranks beyond the cores
    share them (a rank gets ``cores / ranks`` of a core)."""
    hints = dict(profile.device)
    measured, cores = hints.get("ranks_per_node"), hints.get("cores_per_node")
    if ranks_per_node and measured and cores and hints.get("peak_tflops"):
        share = measured / min(measured, cores) * min(1.0, cores / ranks_per_node)  # > 1: fewer ranks, more core
        hints["peak_tflops"] = hints["peak_tflops"] * share
        if hints.get("hbm_gbps"):
            hints["hbm_gbps"] = hints["hbm_gbps"] * share
        if hints.get("optimizer_s_per_param"):
            hints["optimizer_s_per_param"] = hints["optimizer_s_per_param"] / share
    chosen = name or hints.get("name", "")
    if not chosen:
        raise PlanError(f"{profile.source}: no device.name in the profile; give --device NAME "
                        f"({', '.join(DEVICES)})")
    nums = {k: _number(f"{profile.source}: device", hints, k) if hints.get(k) is not None else 0.0
            for k in ("peak_tflops", "memory_gib", "efficiency", "hbm_gbps", "optimizer_s_per_param")}
    d = device_preset(str(chosen).lower(), nums["peak_tflops"], nums["memory_gib"], nums["efficiency"],
                      nums["optimizer_s_per_param"])
    if nums["efficiency"] > 0:  # measured on the profile's own block: no GEMM-size curve on top of it
        d = replace(d, gemm_half_dim=0.0)
    return replace(d, hbm_gbps=nums["hbm_gbps"]) if nums["hbm_gbps"] > 0 else d


def host_memory_gib() -> float:
    """This host's physical memory in GiB (0.0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


@dataclass(frozen=True)
class GroupPlacement:
    """Where one kind of group (tp, cp, pp, dp or dp x cp) lies: ``level`` ``intra`` when every group of that axis
    is inside one node, else ``inter``; ``per_node``: the fewest members a group has on a node it spans
    (they share that node's network, so an inter-node collective moves ``1/per_node`` of its bytes per NIC)."""

    level: str
    per_node: int


@dataclass(frozen=True)
class Machine:
    """``nodes`` x ``gpus_per_node`` ranks of ``device`` joined by ``links``.

    Placement is hpctrain's grid (hpctrain/comm/grid.py): ranks ordered by (node, local rank), grid
    coordinates assigned along that order with tp fastest, then cp, then pp, then dp. So a tp group is
    ``tp`` consecutive ranks, a cp group ``cp`` ranks ``tp`` apart (cp x tp inside a node when it fits,
    like tp), a pp group ``pp`` ranks ``tp * cp`` apart, a dp group ``dp`` ranks ``tp * cp * pp`` apart.
    """

    device: Device
    links: LinkProfile
    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise PlanError(f"--nodes and --gpus-per-node must be >= 1, got {self.nodes} and {self.gpus_per_node}")
        if self.nodes > 1 and "inter" not in self.links.levels:
            raise PlanError(f"{self.nodes} nodes need an inter-node link: {self.links.source} has only "
                            f"{', '.join(self.links.levels)} (give --inter-gbps, or a profile measured on >= 2 nodes)")
        if "intra" not in self.links.levels and self.gpus_per_node > 1:
            raise PlanError(f"{self.gpus_per_node} ranks per node need an intra-node link: {self.links.source} "
                            f"has only {', '.join(self.links.levels)} (give --intra-gbps)")

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def memory_gib(self) -> float:
        """Capacity per rank in GiB (``cpu``: this host's memory over the ranks per node)."""
        if self.device.memory_gib is not None:
            return self.device.memory_gib
        return host_memory_gib() / self.gpus_per_node

    def placement(self, stride: int, size: int) -> GroupPlacement:
        """Placement of the groups of ``size`` ranks ``stride`` apart (the grid's order, see above)."""
        g = self.gpus_per_node
        if size <= 1:
            return GroupPlacement("intra", 1)
        span = stride * size  # positions covered by one block of groups
        if g % span == 0:  # whole blocks of groups tile each node
            return GroupPlacement("intra", size)
        if stride % g == 0:  # every member on its own node
            return GroupPlacement("inter", 1)
        if g % stride == 0 and span % g == 0:  # g / stride members on each node spanned
            return GroupPlacement("inter", g // stride)
        period = span * g // math.gcd(span, g)  # the node pattern repeats after lcm(span, g) positions
        level, fewest = "intra", size
        for block in range(0, min(period, self.devices), span):
            for inner in range(stride):
                counts: dict[int, int] = {}
                for i in range(size):
                    node = (block + inner + i * stride) // g
                    counts[node] = counts.get(node, 0) + 1
                if len(counts) > 1:
                    level, fewest = "inter", min(fewest, min(counts.values()))
        return GroupPlacement(level, fewest if level == "inter" else size)

    def group_placement(self, outer: tuple[int, int], inner: tuple[int, int]) -> GroupPlacement:
        """Placement of the groups whose members differ along two axes, (stride, size) each: the dp x cp
        group (``dp_cp``) is outer (tp cp pp, dp) x inner (tp, cp)."""
        (so, no), (si, ni) = outer, inner
        if no == 1 or ni == 1 or so == si * ni:  # one axis, or two that are one contiguous axis
            return self.placement(so if ni == 1 else si, no * ni)
        g = self.gpus_per_node
        if so % g == 0:  # the outer members on distinct nodes
            p = self.placement(si, ni)
            return GroupPlacement("inter", ni if p.level == "intra" else p.per_node)
        if g % (so * no) == 0:  # whole groups tile each node
            return GroupPlacement("intra", no * ni)
        level, fewest, seen = "intra", no * ni, set()
        for base in range(self.devices):  # a group's node pattern depends on its first member's node offset
            if base % g in seen or (base // si) % ni or (base // so) % no:
                continue
            seen.add(base % g)
            counts: dict[int, int] = {}
            for node in ((base + i * si + j * so) // g for i in range(ni) for j in range(no)):
                counts[node] = counts.get(node, 0) + 1
            if len(counts) > 1:
                level, fewest = "inter", min(fewest, min(counts.values()))
        return GroupPlacement(level, fewest if level == "inter" else no * ni)

    def groups_placement(self, groups) -> GroupPlacement:
        """Placement of explicit groups of grid positions (ranks in the grid's order, see above): ``inter``
        when one spans nodes, with the fewest members a spanning group has on a node; the irregular groups
        (an ep group that is neither inside nor a multiple of the cp axis) that ``placement`` cannot describe."""
        g, level, fewest, size = self.gpus_per_node, "intra", 0, 1
        for members in groups:
            counts: dict[int, int] = {}
            for position in members:
                counts[position // g] = counts.get(position // g, 0) + 1
            size = max(size, len(members))
            if len(counts) > 1:
                level, fewest = "inter", min(fewest or size, min(counts.values()))
        return GroupPlacement(level, fewest if level == "inter" else size)

    def collective_s(self, op: str, nbytes: float, size: int, where: GroupPlacement) -> float:
        """Seconds for ``op`` on ``nbytes`` (the full buffer) over a group of ``size`` ranks placed ``where``.

        Inside a node: ``alpha + beta_intra * w``. Across nodes: ``alpha_inter + w * max(beta_intra,
        beta_inter / per_node)``: a group with k members per node spreads its crossings over k NICs
        (NCCL's rings per NIC, MPI's hierarchical algorithms), but is never faster than the node's own links;
        a point-to-point ``sendrecv`` uses one rank's share, ``beta_inter``.
        """
        if size <= 1 or nbytes <= 0:
            return 0.0
        w = wire_bytes(op, nbytes, size)
        if where.level == "intra":
            link = self.links.link(op, "intra")
            return link.alpha_s + link.beta_s_per_byte * w
        inter = self.links.link(op, "inter")
        shared = 1 if op == "sendrecv" else where.per_node  # a point-to-point message uses one rank's share
        beta = inter.beta_s_per_byte / shared
        if shared > 1 and "intra" in self.links.levels:
            beta = max(beta, self.links.link(op, "intra").beta_s_per_byte)
        return inter.alpha_s + beta * w


    def layer_collective_s(self, op: str, nbytes: float, size: int, where: GroupPlacement) -> float:
        """Seconds for a layer's tensor-parallel collective (``op`` on ``nbytes`` over ``size`` ranks placed
        ``where``): ``collective_s`` inside a node. Across nodes (planned only with ``--allow-tp-across-nodes``)
        it is charged what makes practitioners keep tp inside the NVLink domain: the ring leaves each node
        through one rank's NIC (``beta_inter``, not spread over the node's NICs as a bucketed dp reduction is),
        and each of its steps (``2(p-1)`` for allreduce, ``p-1`` otherwise) waits for the inter-node latency,
        a cost paid by every one of the layers' collectives (about 770 a step for GPT-3 175B).
        """
        if size <= 1 or nbytes <= 0 or where.level == "intra":
            return self.collective_s(op, nbytes, size, where)
        inter = self.links.link(op, "inter")
        beta = inter.beta_s_per_byte
        if "intra" in self.links.levels:
            beta = max(beta, self.links.link(op, "intra").beta_s_per_byte)
        steps = 2 * (size - 1) if op == "allreduce" else size - 1
        return steps * inter.alpha_s + beta * wire_bytes(op, nbytes, size)

def wire_bytes(op: str, nbytes: float, p: int) -> float:
    """Bytes one rank of a group of ``p`` sends for ``op`` on ``nbytes`` under the bandwidth-optimal algorithms
    (the Communicator's count, hpctrain/comm/collectives.py; ``bench comm --profile`` fits with it)."""
    if op == "allreduce":
        return 2 * (p - 1) / p * nbytes
    if op == "sendrecv":
        return float(nbytes)
    return (p - 1) / p * nbytes
