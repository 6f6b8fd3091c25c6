"""The node-local checkpoint tier (``checkpoint.local_dir``): saving every rank's piece in the background,
sending it to partner ranks on other nodes, and resuming from it (docs/fault-tolerance.md).

Directory (one per run and node): ``<local_dir>/hpctrain-<run key>/step-NNNNNNNN/`` with ``rank-RRRRR.{bin,json}``
(a rank's own piece, local_piece.py) and ``replica-RRRRR.{bin,json}`` (rank RRRRR's piece, kept for it by a
partner). The run key is a hash of the run directory's real path, so runs sharing a node's /dev/shm never
meet. Once a step is written on every rank (agreed in the background), the older steps go: a node
holds (1 + replicas) pieces per rank of its own, two while the next step is being written.

Partners: the j-th replica (j = 1..``checkpoint.replicas``) of the rank with node-local index l on node n is
kept by the rank of local index l (mod that node's size) on node (n + j) mod nodes: always another node.

Resume (``resume``, collective on the tier's own communicator): every rank lists what it holds; from that
one allgathered inventory every rank computes the same plan: the newest step at least as new as the
newest global checkpoint for which every rank's piece exists, its own or a replica. A rank reads its own
piece, or receives it from the partner that keeps it (point-to-point); checksums and layout are checked;
the problems are agreed. A bad piece is named in one line and its next source is tried; a rank with no
source left sends the whole run to the global tier. The plan only shrinks, so this never loops.

A background save that raises on some ranks (the copy from the device, the checksum: a CUDA error) is agreed
before any piece is sent: every rank's thread ends with the same ``NodeFailure`` naming the ranks and hosts,
``failed`` turns true, and the training loop stops every rank at the same step (the ``"local checkpoint
failed"`` stop request) and raises it there: exit 5 within a step or two, never a partner left waiting.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid

import torch

from hpctrain.checkpoint.background import BackgroundJob
from hpctrain.checkpoint.contract import Resumed, TrainState
from hpctrain.checkpoint.format import layout_differences
from hpctrain.checkpoint.items import CheckpointError
from hpctrain.checkpoint.local_piece import (Piece, SnapshotBuffer, apply_piece, checksum, piece_from, problems_of,
                                             read_index, read_piece, write_piece)
from hpctrain.comm.collectives import Communicator
from hpctrain.comm.shm_memory import container_shm_fix
from hpctrain.config import config_to_dict
from hpctrain.errors import NodeFailure, everywhere
from hpctrain.runtime import env
from hpctrain.runtime.launcher import missing_thread_multiple

STEP_PREFIX = "step-"
CHUNK = 256 << 20  # bytes per point-to-point message (MPI counts are ints)


def expand(local_dir: str) -> str:
    """``checkpoint.local_dir`` on this node: environment variables and ``{hostname}`` expanded."""
    return os.path.expandvars(os.path.expanduser(local_dir)).replace("{hostname}", socket.gethostname())


def run_key(run_dir: str) -> str:
    return hashlib.sha1(os.path.realpath(run_dir).encode()).hexdigest()[:12]


def partners(rank: int, replicas: int, node_of_rank, local_rank_of_rank) -> list[int]:
    """The ranks that keep ``rank``'s piece, one per replica, each on another node (fewer when the job has
    fewer nodes than ``replicas`` + 1)."""
    nodes = max(node_of_rank) + 1
    by_node: dict[int, list[int]] = {}
    for r, n in enumerate(node_of_rank):
        by_node.setdefault(n, []).append(r)
    for members in by_node.values():
        members.sort(key=lambda r: local_rank_of_rank[r])
    node, local = node_of_rank[rank], local_rank_of_rank[rank]
    out = []
    for j in range(1, min(replicas, nodes - 1) + 1):
        members = by_node[(node + j) % nodes]
        out.append(members[local % len(members)])
    return out


def tier_root(local_dir: str, run_dir: str) -> str:
    """This node's tier directory of the run in ``run_dir``."""
    return os.path.join(expand(local_dir), f"hpctrain-{run_key(run_dir)}")


def newest_held(local_dir: str, run_dir: str) -> int | None:
    """The newest step of which this node's tier holds a piece of the run (any rank's, own or replica), or
    None: what a start looks at before deciding to resume (train/run_dir.py)."""
    root = tier_root(local_dir, run_dir)
    held = [step for step in _steps_in(root)
            if any(name.endswith(".json") for name in _names(step_dir(root, step)))]
    return max(held, default=None)


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{step:08d}")


def own_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def replica_name(rank: int) -> str:
    return f"replica-{rank:05d}"


class LocalTier:
    """One run's node-local tier on this rank. Collective to build (it duplicates the world communicator);
    ``enabled`` False (no ``checkpoint.local_dir``) makes every method a no-op."""

    def __init__(self, ckpt_cfg, grid, run_dir: str, faults=None):
        self.enabled = bool(ckpt_cfg.local_dir)
        self.faults = faults  # test-only FaultInjector: phase "copy" of the background save
        self.interval = ckpt_cfg.local_interval
        self.rank = grid.info.rank
        self.last_block_s: float | None = None  # the step's stall of the last local save
        self.last_write_s: float | None = None  # its background part (checksums, write, replicas)
        self.saved_steps: list[int] = []
        self._job = BackgroundJob("hpctrain-local-ckpt")  # the local save in flight
        self._buffer = SnapshotBuffer()
        self._warned = False  # a local write failed on this rank (said once)
        self.offered = False  # resume() found pieces of this run at least as new as the global tier
        self.other_layout = False  # ... and some of them were written for another layout
        if not self.enabled:
            return
        self.root = tier_root(ckpt_cfg.local_dir, run_dir)
        self.run_dir = os.path.realpath(run_dir)
        info = grid.info
        self.holders = partners(self.rank, ckpt_cfg.replicas, info.node_of_rank, info.local_rank_of_rank)
        self.sources = [r for r in range(info.size)
                        if self.rank in partners(r, ckpt_cfg.replicas, info.node_of_rank, info.local_rank_of_rank)]
        if ckpt_cfg.replicas and len(self.holders) < ckpt_cfg.replicas:  # the same on every rank
            too_many = (f"checkpoint.replicas={ckpt_cfg.replicas} needs {ckpt_cfg.replicas + 1} nodes; this job has "
                        f"{info.num_nodes}")
            if not env.earlier_steps_ended():  # a first launch: the keys are wrong for this job
                raise everywhere(CheckpointError(f"{too_many}: set checkpoint.replicas <= {info.num_nodes - 1} "
                                                 f"(nodes - 1), or run on more nodes"))
            if self.rank == 0:  # a relaunch shrunk onto fewer nodes (slurm/train.sbatch --restarts) goes on
                print(f"hpctrain: WARNING: {too_many} (relaunched on fewer nodes): {len(self.holders)} replica(s) "
                      f"per piece", file=sys.stderr, flush=True)
        problem = missing_thread_multiple("checkpoint.local_dir (pieces are written and sent on a thread)")
        if problem:  # the same on every rank: refused without communication
            raise everywhere(CheckpointError(problem + "; or leave checkpoint.local_dir empty"))
        world = grid.world
        host = socket.gethostname()
        start = world.broadcast_object(uuid.uuid4().hex[:12] if self.rank == 0 else None, root=0)
        found = [(p, h) for p, h in world.allgather_object((self._unusable(start), host)) if p]
        if not found:  # every probe is written: may a node see another's? (a shared file system)
            seen = world.allgather_object(self._probes_of_other_nodes(start, host))
            self._remove_probe(start)
            shared = sorted({h for hosts in seen for h in hosts})
            if shared:
                raise everywhere(CheckpointError(
                    f"checkpoint.local_dir={ckpt_cfg.local_dir!r} is shared between nodes ({', '.join(shared[:4])}"
                    + (f" and {len(shared) - 4} more" if len(shared) > 4 else "") + f" see each other's files in "
                    f"{self.root}): the node-local tier needs each node's own disk or memory (/dev/shm, a local "
                    f"NVMe, $TMPDIR), or {{hostname}} in the path"))
        if found:  # a missing, read-only or full local disk on any node: said before the first step, on every rank
            self._remove_probe(start)
            problems = [p for p, _ in found]
            raise everywhere(NodeFailure(f"checkpoint.local_dir={ckpt_cfg.local_dir!r} is not usable: "
                                         + "; ".join(problems[:3])
                                         + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
                                         + "; the node is the problem: exit 5, a relaunch without it can go on",
                                         hosts=[host for _, host in found]))
        with world.watched("local checkpoint communicator (Dup)"):
            duplicate = world.mpi.Dup()
        self.comm = Communicator(duplicate, "local-checkpoint", world.members, grid.watchdog, grid.stats,
                                 check=world.check)

    def _probe(self, start: str, host: str | None = None) -> str:
        return os.path.join(self.root, f".probe-{start}-{self.rank}-{host or socket.gethostname()}")

    def _unusable(self, start: str) -> str | None:
        """Why this rank cannot write into its tier directory (created here), or None; the probe written stays
        until ``_remove_probe``, for ``_probes_of_other_nodes`` (``start``: this start's token, the same on
        every rank)."""
        probe = self._probe(start)
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(probe, "wb") as f:
                f.write(b"hpctrain")
        except OSError as exc:
            try:
                os.remove(probe)
            except OSError:
                pass
            return f"{exc.filename or self.root}: {exc.strerror or exc} (rank {self.rank} on {socket.gethostname()})"
        return None

    def _probes_of_other_nodes(self, start: str, host: str) -> list[str]:
        """The hosts whose probes of this start this rank sees in its tier directory, other than its own."""
        prefix = f".probe-{start}-"
        return sorted({name[len(prefix):].split("-", 1)[1] for name in _names(self.root)
                       if name.startswith(prefix) and name.count("-") >= 3} - {host})

    def _remove_probe(self, start: str) -> None:
        try:
            os.remove(self._probe(start))
        except OSError:
            pass

    # ------------------------------------------------------------------ saving
    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    def save(self, state: TrainState) -> None:
        """Take this rank's piece at the current step (collective only in the background: the replicas). The
        step blocks for waiting on the previous local save and the copy of the small tensors (``checkpoint``
        phase); parameters and optimizer state are copied by the background thread while the next forward and
        backward run, and the next update waits for that copy (``TrainState.before_next_update``)."""
        if not self.enabled:
            return
        started = time.perf_counter()
        with state.timer.phase("checkpoint"):
            self.wait()
            root = state.root_state()
            meta = {"step": root.step, "rank": self.rank, "world_size": state.world_size,
                    "layout": dict(state.layout), "run_dir": self.run_dir,
                    "root": {"step": root.step, "optimizer_step": root.optimizer_step, "sampler": root.sampler,
                             "loss_scaler": root.loss_scaler},
                    "signature": json.loads(json.dumps(state.reducer.signature())),
                    "base_reference": state.base_reference, "hostname": socket.gethostname(),
                    "config": config_to_dict(state.config)}
            piece, copy_rest = self._buffer.take(state, meta)
            copied = threading.Event()
            self._job.start(self._background, piece, copy_rest, copied)
            # the next update waits for the copy; the forward and backward before it do not
            state.before_next_update(lambda: None if copied.wait() else None)
        self.last_block_s = time.perf_counter() - started

    def _background(self, piece: Piece, copy_rest, copied: threading.Event) -> None:
        """Copy, checksum, write the own piece, exchange with the partners, write their pieces, prune. A file
        that cannot be written (a full /dev/shm, a missing disk) costs that piece only: one warning per rank,
        and the exchange still runs (the partners wait for it); errors of the copy or the exchange are
        raised by ``wait``."""
        started = time.perf_counter()
        step = piece.meta["step"]
        error = None
        try:
            try:
                if self.faults:
                    self.faults.hit("copy", step)
                copy_rest()  # parameters and optimizer state: they change only at the next update
            finally:
                copied.set()
            checksum(piece)
        except Exception as exc:  # noqa: BLE001 - agreed below, before any rank waits for this one's piece
            error = (f"rank {self.rank} on {socket.gethostname()}: {type(exc).__name__}: {exc}", socket.gethostname())
        failures = [e for e in self.comm.allgather_object(error) if e]
        if failures:  # every rank raises the same, so no partner waits in the exchange
            raise everywhere(NodeFailure(
                f"the node-local checkpoint of step {step} failed in the background: "
                + "; ".join(text for text, _ in failures[:3])
                + (f" (and {len(failures) - 3} more rank(s))" if len(failures) > 3 else "")
                + "; the node is the problem: exit 5, a relaunch without it can go on",
                hosts=[host for _, host in failures]))
        failed = self._write(piece, step, own_name(self.rank))
        for source, received in self._exchange(piece):
            failed = self._write(received, step, replica_name(source)) or failed
        everywhere_written = all(self.comm.allgather_object(not failed))  # the step is whole on every node
        if everywhere_written:  # only now may the previous step go: a crash mid-save leaves it in place
            self._remove_steps([older for older in _steps_in(self.root) if older < step])
            self.saved_steps.append(step)
        self.last_write_s = time.perf_counter() - started

    def _write(self, piece: Piece, step: int, name: str) -> bool:
        """Write one piece; on an OS error remove what it left, warn (once per run on this rank), return True."""
        directory = step_dir(self.root, step)
        try:
            write_piece(piece, directory, name)
            return False
        except OSError as exc:
            for suffix in (".json", ".bin", ".json.tmp", ".bin.tmp"):
                try:
                    os.remove(os.path.join(directory, name + suffix))
                except OSError:
                    pass
            if not self._warned:
                self._warned = True
                fix = container_shm_fix() if directory.startswith("/dev/shm") else ""
                print(f"hpctrain: WARNING: rank {self.rank}: local checkpoint of step {step} not written "
                      f"({exc.filename or os.path.join(directory, name + '.bin')}: {exc.strerror or exc}); training "
                      f"goes on, the global tier (checkpoint.interval) still saves"
                      + (f"; a container's /dev/shm: {fix}" if fix else ""), file=sys.stderr, flush=True)
            return True

    def _exchange(self, piece: Piece) -> list[tuple[int, Piece]]:
        """Send ``piece`` to every holder and receive the pieces of every source (collective between partners)."""
        if not self.holders and not self.sources:
            return []
        header, mine = _on_the_wire(piece)
        headers = {s: torch.zeros(2, dtype=torch.int64) for s in self.sources}
        self.comm.exchange([(header, h, 1) for h in self.holders],
                           [(headers[s], s, 1) for s in self.sources]).wait()
        blobs = {s: (torch.empty(int(headers[s][0]), dtype=torch.uint8), torch.empty(int(headers[s][1]), dtype=torch.uint8))
                 for s in self.sources}
        sends = [(chunk, h, 2) for h in self.holders for chunk in _chunks(piece.data)] + \
                [(mine, h, 3) for h in self.holders]
        recvs = [(chunk, s, 2) for s in self.sources for chunk in _chunks(blobs[s][0])] + \
                [(blobs[s][1], s, 3) for s in self.sources]
        self.comm.exchange(sends, recvs).wait()
        return [(s, piece_from(json.loads(bytes(blobs[s][1].numpy())), blobs[s][0])) for s in self.sources]

    def _remove_steps(self, steps) -> None:
        """Delete this node's directories of ``steps`` whole, whoever wrote into them (also a replica kept for a
        rank that is no partner any more, after ``checkpoint.replicas`` changed). Every rank of the node may do
        it at once: a file already gone is no error. Called only when every piece there is obsolete: once a
        newer step is written on every rank, or at a start that did not resume from the tier."""
        for step in list(steps):
            shutil.rmtree(step_dir(self.root, step), ignore_errors=True)

    @property
    def failed(self) -> bool:
        """The last background save ended with an error (agreed: true on every rank within seconds)."""
        return self.enabled and self._job.failed

    def wait(self) -> None:
        """Block until the previous local save is written and sent; re-raise its error."""
        try:
            self._job.wait()
        except NodeFailure:
            raise  # agreed in the background, the same text on every rank
        except Exception as error:
            raise everywhere(CheckpointError(f"local checkpoint in {self.root} failed: {error}")) from error

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            self.wait()
        finally:
            self.comm.mpi.Free()

    def set_aside(self) -> str:
        """Collective on the tier's communicator: move this run's step directories on every node into
        ``<tier>/unusable-<UTC time>/`` (kept, never deleted: a start-over over pieces none could use); returns
        that path (the same name on every node)."""
        stamp = self.comm.broadcast_object(time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) if self.rank == 0
                                           else None, root=0)
        aside = os.path.join(self.root, f"unusable-{stamp}")
        os.makedirs(aside, exist_ok=True)
        for step in _steps_in(self.root):
            try:
                os.rename(step_dir(self.root, step), os.path.join(aside, os.path.basename(step_dir(self.root, step))))
            except FileNotFoundError:
                pass  # another rank of this node moved it
        self.comm.allgather_object(None)  # every node's pieces are aside before anything new is written
        return aside

    def clear(self) -> None:
        """Remove this run's tier on this node (a start that did not resume from it: another lineage). Safe on
        every rank at once: no rank writes a piece before every rank has passed its first step."""
        if self.enabled:
            self._remove_steps(_steps_in(self.root))

    # ------------------------------------------------------------------ resuming
    def inventory(self, layout: dict, world_size: int) -> dict:
        """What this rank holds of this run: {"own": {step: path}, "replicas": {source: {step: path}}} for this
        layout, and "other_layout": {step: layout} for pieces written for another one."""
        own: dict[int, str] = {}
        replicas: dict[int, dict[int, str]] = {}
        other: dict[int, dict | None] = {}
        damaged: list[tuple[int, str, str]] = []  # (step, path, why): unreadable, named by resume(), never absent
        for step in _steps_in(self.root):
            directory = step_dir(self.root, step)
            try:
                names = os.listdir(directory) if os.path.isdir(directory) else []
            except OSError as exc:
                damaged.append((step, directory, exc.strerror or str(exc)))
                continue
            for name in names:
                if not name.endswith(".json"):
                    continue
                path = os.path.join(directory, name)
                try:
                    doc = read_index(path)
                except (OSError, ValueError) as exc:
                    damaged.append((step, path, f"{type(exc).__name__}: {exc}"))
                    continue
                if doc.get("run_dir") != self.run_dir or doc.get("step") != step:
                    continue
                written = {"ep": 1, **(doc.get("layout") or {})}  # pieces from before ep was recorded: ep 1
                if written != {"ep": 1, **layout} or doc.get("world_size") != world_size:
                    other[step] = doc.get("layout")
                elif name == own_name(self.rank) + ".json":
                    own[step] = path
                elif name.startswith("replica-") and doc.get("rank") in self.sources:
                    replicas.setdefault(int(doc["rank"]), {})[step] = path
        return {"own": own, "replicas": replicas, "other_layout": other, "damaged": damaged,
                "hostname": socket.gethostname()}

    def resume(self, state: TrainState, newest_global: int | None) -> Resumed | None:
        """Collective on the tier's communicator: load the newest local step >= ``newest_global`` (None: no
        global checkpoint) of which every rank can get its piece (its own or a replica), falling back piece by
        piece to the replicas; returns what was loaded (``Resumed``, tier "local"), or None (the global tier is next).
        Every rank returns the same. Steps some rank lacks (a save cut short by the failure) are skipped."""
        if not self.enabled:
            return None
        everyone = self.comm.allgather_object(self.inventory(dict(state.layout), state.world_size))

        def options(r: int, step: int) -> list[tuple[int, str]]:
            own = [(r, everyone[r]["own"][step])] if step in everyone[r]["own"] else []
            return own + [(h, inv["replicas"][r][step]) for h, inv in enumerate(everyone)
                          if r in inv["replicas"] and step in inv["replicas"][r]]
        held = {s for inv in everyone for s in inv["own"]} | \
               {s for inv in everyone for kept in inv["replicas"].values() for s in kept}
        recent = sorted((s for s in held if newest_global is None or s >= newest_global), reverse=True)
        whole = [s for s in recent if all(options(r, s) for r in range(self.comm.size))]
        other = sorted({s for inv in everyone for s in inv["other_layout"]
                        if newest_global is None or s >= newest_global})
        damaged = sorted({(inv["hostname"], step, path, why) for inv in everyone for step, path, why in inv["damaged"]
                          if newest_global is None or step >= newest_global})  # a node's ranks see the same files
        if self.rank == 0:
            for host, step, path, why in damaged:
                print(f"hpctrain: WARNING: local tier: {host}:{path} (step {step}) cannot be read: {why}; its piece "
                      f"is not offered", file=sys.stderr, flush=True)
        self.offered = bool(recent or other or damaged)  # the same on every rank (from the allgathered inventory)
        self.other_layout = bool(other)  # usable by a resume in the layout that wrote them: never started over
        if not whole:
            if self.rank == 0 and (recent or other):
                why = (f"step {recent[0]} lacks the pieces of rank(s) "
                       f"{_ranks([r for r in range(self.comm.size) if not options(r, recent[0])])}" if recent else
                       f"step {other[-1]} was written for another layout: " + layout_differences(
                           next(inv['other_layout'][other[-1]] for inv in everyone if other[-1] in inv['other_layout']),
                           dict(state.layout)))
                print(f"hpctrain: local tier: nothing to resume from ({why}); resuming from the global tier",
                      file=sys.stderr, flush=True)
            return None
        step = whole[0]
        sources = {r: options(r, step) for r in range(self.comm.size)}
        while True:
            plan = {r: found[0] for r, found in sources.items()}
            piece, error = self._fetch(plan)
            if error is None and piece is not None:
                try:
                    error = problems_of(piece, state)
                except Exception as exc:  # noqa: BLE001 - a damaged but parseable index: agreed like any problem
                    error = f"{type(exc).__name__}: {exc}"
            errors = self.comm.allgather_object(error)
            bad = {r: e for r, e in enumerate(errors) if e}
            if not bad:
                assert piece is not None
                apply_piece(piece, state)
                # steps after this one are another lineage now (a crashed attempt's): never mixed with new pieces
                self._remove_steps([later for later in _steps_in(self.root) if later > step])
                rebuilt = tuple(r for r, (holder, _) in plan.items() if holder != r)
                return Resumed("local", step_dir(self.root, step), step, rebuilt)
            for r, problem in bad.items():
                holder, path = plan[r]
                sources[r] = sources[r][1:]
                if self.rank == 0:
                    print(f"hpctrain: WARNING: local tier: the piece of rank {r} at step {step} "
                          f"({everyone[holder]['hostname']}:{path}, kept by rank {holder}) is unusable: {problem}; "
                          + ("trying its replica" if sources[r] else "no replica left: resuming from the global tier"),
                          file=sys.stderr, flush=True)
            if not all(sources.values()):
                return None

    def _fetch(self, plan: dict[int, tuple[int, str]]) -> tuple[Piece | None, str | None]:
        """Every rank gets its piece from the rank the plan names (itself: read from disk; another: that rank
        reads its replica file and sends it). Returns (piece, None) or (None, why)."""
        serve = {r: path for r, (holder, path) in plan.items() if holder == self.rank and r != self.rank}
        holder, path = plan[self.rank]
        loaded: dict[int, tuple[Piece | None, str | None]] = {}
        for r, p in list(serve.items()) + ([(self.rank, path)] if holder == self.rank else []):
            try:
                loaded[r] = (read_piece(p), None)
            except Exception as exc:  # noqa: BLE001 - sent to its owner and agreed there, never raised here
                loaded[r] = (None, f"unreadable: {type(exc).__name__}: {exc}")
        # headers: [bin bytes, json bytes] or [-1, message bytes]
        sends, recvs, payload = [], [], {}
        for r in serve:
            piece, error = loaded[r]
            if piece is None:  # the header says so; the "index" is the reason
                reason = _bytes_tensor((error or "unreadable").encode())
                payload[r] = (torch.zeros(0, dtype=torch.uint8), reason)
                sends.append((torch.tensor([-1, reason.numel()], dtype=torch.int64), r, 4))
            else:
                header, index = _on_the_wire(piece)
                payload[r] = (piece.data, index)
                sends.append((header, r, 4))
        header = torch.zeros(2, dtype=torch.int64)
        if holder != self.rank:
            recvs.append((header, holder, 4))
        if sends or recvs:
            self.comm.exchange(sends, recvs).wait()
        sends, recvs = [], []
        for r, (data, index) in payload.items():
            sends += [(chunk, r, 5) for chunk in _chunks(data)] + [(index, r, 6)]
        got_data = torch.empty(max(int(header[0]), 0), dtype=torch.uint8)
        got_index = torch.empty(int(header[1]), dtype=torch.uint8)
        if holder != self.rank:
            recvs += [(chunk, holder, 5) for chunk in _chunks(got_data)] + [(got_index, holder, 6)]
        if sends or recvs:
            self.comm.exchange(sends, recvs).wait()
        if holder == self.rank:
            return loaded[self.rank]
        text = bytes(got_index.numpy())
        if int(header[0]) < 0:
            return None, f"unreadable on rank {holder}: {text.decode(errors='replace')}"
        try:
            return piece_from(json.loads(text), got_data), None
        except (ValueError, KeyError) as exc:
            return None, f"damaged index: {exc}"


def _on_the_wire(piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    """What is sent ahead of a piece's bytes: its header [data bytes, index bytes] and its index (uint8)."""
    index = _bytes_tensor(json.dumps(piece.index()).encode())
    return torch.tensor([piece.data.numel(), index.numel()], dtype=torch.int64), index


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data or b" "), dtype=torch.uint8)


def _chunks(data: torch.Tensor) -> list[torch.Tensor]:
    return [data[i:i + CHUNK] for i in range(0, data.numel(), CHUNK)]


def _steps_in(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith(STEP_PREFIX):
            try:
                steps.append(int(name[len(STEP_PREFIX):]))
            except ValueError:
                continue
    return sorted(steps)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")

