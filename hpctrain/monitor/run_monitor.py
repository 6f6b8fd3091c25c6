"""What the training loop calls: ``RunMonitor`` feeds every step, evaluation and checkpoint to the sinks of
``[monitor]`` (Prometheus server and/or textfile, TensorBoard) on rank 0, and gathers the per-rank step
times every ``monitor.interval`` steps (collective over the world: every rank calls ``on_step`` for every
step). A run without any sink does nothing at all (no gathers).

Rank 0's step only queues samples: the sinks' thread (``fanout.py``) applies them. Failures: a sink that
cannot start (a port in use, an unwritable textfile or log directory, a missing package) stops the run
before its first step, on every rank, with one line naming the key; a sink that fails later is dropped with
one warning and training goes on. ``<run_dir>/monitor.json`` (rank 0) says where the
run publishes (for a centre's file-based service discovery, docs/monitoring.md).
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections import defaultdict
from collections.abc import Sequence

from hpctrain.errors import HpcTrainError, everywhere
from hpctrain.monitor.fanout import SinkWorker
from hpctrain.config.metric_names import layout_label, parse_labels, step_samples
from hpctrain.monitor.ranks import RankWindow
from hpctrain.runtime import env

ENDPOINT_FILE = "monitor.json"


class RunMonitor:
    """``cfg``: the run's Config; ``world``: the world Communicator; ``sizes``: the grid's axis sizes."""

    def __init__(self, cfg, world, sizes: dict, run_dir: str):
        mon = cfg.monitor
        self.cfg, self.world, self.run_dir = mon, world, run_dir
        self.enabled = bool(mon.prometheus_port or mon.prometheus_textfile or mon.tensorboard)
        self.interval = mon.interval or cfg.train.log_interval
        self.is_root = world.rank == 0
        self.constant = {"run": os.path.basename(os.path.abspath(run_dir)), "job_id": env.batch_job_id(),
                         "layout": layout_label(sizes), **parse_labels(mon.labels)}
        self.window, self.skipped, self.last_saved = RankWindow(), 0, None
        self.sinks: list = []  # rank 0 until start hands them to the worker: PrometheusSink, TensorBoardSink
        self.comm_totals: defaultdict[str, int] = defaultdict(int)  # bytes sent by all ranks, by group, since the start
        self.worker: SinkWorker | None = None  # rank 0: the sinks' thread (fanout.py), once started
        self.restarts = env.slurm_restart_count()

    def start(self, step: int) -> None:
        """Collective: start the sinks on rank 0; a failure is raised on every rank (nothing has trained)."""
        if not self.enabled:
            return
        problem = None
        if self.is_root:
            try:
                self.sinks = self._make_sinks()
                for sink in self.sinks:
                    sink.start()
                self._write_endpoint()
                self.worker, self.sinks = SinkWorker(self.sinks), []
            except (HpcTrainError, OSError) as exc:
                problem = str(exc)
                self.close(clean=False)
        problems = [p for p in self.world.allgather_object(problem) if p]
        if problems:
            raise everywhere(HpcTrainError(problems[0]))
        self._emit([("hpctrain_up", {}, 1), ("hpctrain_step", {}, step),
                    ("hpctrain_restarts_total", {}, self.restarts)], step, flush=True)

    def _make_sinks(self) -> list:
        mon = self.cfg
        sinks: list = []
        if mon.prometheus_port or mon.prometheus_textfile:
            from hpctrain.monitor.prometheus import PrometheusSink

            sinks.append(PrometheusSink(self.constant, mon.prometheus_port, mon.prometheus_addr, mon.prometheus_textfile))
        if mon.tensorboard:
            from hpctrain.monitor.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(os.path.join(self.run_dir, "tensorboard")))
        return sinks

    def _write_endpoint(self) -> None:
        """``<run_dir>/monitor.json``: host, port, url, textfile, job id, run, pid (written atomically)."""
        mon = self.cfg
        host = socket.gethostname()
        url = f"http://{host if mon.prometheus_addr in ('0.0.0.0', '::') else mon.prometheus_addr}:" \
              f"{mon.prometheus_port}/metrics" if mon.prometheus_port else ""
        record = {"host": host, "addr": mon.prometheus_addr, "port": mon.prometheus_port, "url": url,
                  "textfile": os.path.abspath(mon.prometheus_textfile) if mon.prometheus_textfile else "",
                  "tensorboard": os.path.join(os.path.abspath(self.run_dir), "tensorboard") if mon.tensorboard else "",
                  "labels": self.constant, "job_id": self.constant["job_id"], "run": self.constant["run"],
                  "pid": os.getpid(), "started": time.time()}
        path = os.path.join(self.run_dir, ENDPOINT_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(path + ".tmp", path)

    def on_step(self, record: dict, saved_steps: Sequence[int] = (), save_phases: dict | None = None) -> None:
        """Every rank, after every step (``record``: the step's metrics, ``val_loss`` when it evaluated;
        ``saved_steps``/``save_phases``: the checkpoint manager's published steps and the last save's phases).
        Collective every ``interval`` steps."""
        if not self.enabled:
            return
        step = record["step"]
        self.window.add(record)
        gathered = step % self.interval == 0 and self.window.gather(self.world)
        if not self.is_root:
            return
        self.skipped += bool(record.get("skipped"))
        samples = step_samples(record) + [("hpctrain_last_step_timestamp_seconds", {}, time.time()),
                                          ("hpctrain_skipped_steps_total", {}, self.skipped)]
        samples += self._saved_samples(saved_steps, save_phases)
        if "checkpoint" in (record.get("time_s") or {}):
            samples.append(("hpctrain_checkpoint_seconds", {"phase": "stall"}, record["time_s"]["checkpoint"]))
        if gathered:
            samples += [("hpctrain_rank_step_seconds", {"rank": str(gathered.slowest_rank), "which": "slowest"},
                         gathered.slowest_s),
                        ("hpctrain_rank_step_seconds", {"rank": str(gathered.median_rank), "which": "median"},
                         gathered.median_s),
                        ("hpctrain_straggler_ratio", {}, gathered.ratio)]
            for group, sent in gathered.bytes_by_group.items():
                self.comm_totals[group] += sent
            samples += [("hpctrain_comm_bytes_total", {"group": g}, n) for g, n in self.comm_totals.items()]
        self._emit(samples, step, flush=bool(gathered), clear=("hpctrain_rank_step_seconds",) if gathered else ())

    def on_saved(self, step: int, saved_steps: list[int], save_phases: dict | None) -> None:
        """Rank 0 (others: nothing), after a save outside the step loop (the final one): its gauges."""
        if self.enabled and self.is_root:
            self._emit(self._saved_samples(saved_steps, save_phases), step, flush=True)

    def _saved_samples(self, saved_steps, save_phases) -> list:
        """The checkpoint gauges when a new checkpoint was published since the last call."""
        if not saved_steps or saved_steps[-1] == self.last_saved:
            return []
        self.last_saved = saved_steps[-1]
        return ([("hpctrain_last_checkpoint_step", {}, self.last_saved),
                 ("hpctrain_last_checkpoint_timestamp_seconds", {}, time.time())]
                + [("hpctrain_checkpoint_seconds", {"phase": p}, s) for p, s in (save_phases or {}).items()])

    def _emit(self, samples, step: int, flush: bool = False, clear: tuple[str, ...] = ()) -> None:
        if self.worker is not None:
            self.worker.emit(samples, step, flush, clear)

    def close(self, clean: bool = True) -> None:
        """Rank 0: ``hpctrain_up`` 0, the last textfile, the server and writers stopped. Never raises."""
        if self.worker is not None:
            self.worker.close(clean)
            self.worker = None
        for sink in self.sinks:  # started before a failure at start-up, never handed to a worker
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - the start-up error is what the user sees
                pass
        self.sinks = []
