"""The Prometheus sink (rank 0 only): every ``METRICS`` entry in a registry of its own, served by
``prometheus_client``'s HTTP server thread (``monitor.prometheus_port``) and/or written to a node_exporter
textfile (``monitor.prometheus_textfile``; ``prometheus_client.write_to_textfile`` writes a temporary file and
renames it, so node_exporter never reads half a file). Setting a value takes a lock and nothing else: a
scrape renders in the server's thread, never in the training step."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hpctrain.errors import HpcTrainError
from hpctrain.config.metric_names import METRICS

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


class PrometheusSink:
    """``constant``: the run's constant labels (name -> value), on every series."""

    name = "prometheus"

    def __init__(self, constant: dict[str, str], port: int = 0, addr: str = "127.0.0.1", textfile: str = ""):
        try:
            import prometheus_client as pc
        except ImportError:
            key = "monitor.prometheus_port" if port else "monitor.prometheus_textfile"
            raise HpcTrainError(f"{key}: needs the prometheus_client package (pip install prometheus-client, or "
                                f"the hpctrain[monitor] extra)") from None
        self._pc, self.port, self.addr, self.textfile = pc, port, addr, textfile
        self.constant = dict(constant)
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, pc.Counter | pc.Gauge] = {}
        self._totals: dict[tuple, float] = {}  # (counter, its labels) -> the running total set last
        self.server: WSGIServer | None = None
        for m in METRICS.values():
            labelnames = (*self.constant, *m.labels)
            metric: pc.Counter | pc.Gauge
            if m.kind == "counter":  # prometheus_client appends _total itself
                metric = pc.Counter(m.name.removesuffix("_total"), m.help, labelnames, registry=self.registry)
            else:
                metric = pc.Gauge(m.name, m.help, labelnames, registry=self.registry)
            self._metrics[m.name] = metric

    def start(self) -> None:
        """Serve ``/metrics`` and write the textfile once; HpcTrainError naming the key when either fails."""
        if self.port:
            try:
                self.server, _ = self._pc.start_http_server(self.port, addr=self.addr, registry=self.registry)
            except OSError as exc:
                raise HpcTrainError(f"monitor.prometheus_port: cannot serve on {self.addr}:{self.port}: "
                                    f"{exc.strerror or exc}") from None
        if self.textfile:
            try:
                self.write_textfile()
            except OSError as exc:
                raise HpcTrainError(f"monitor.prometheus_textfile: cannot write {self.textfile}: "
                                    f"{exc.strerror or exc}") from None

    def _child(self, name: str, labels: dict):
        return self._metrics[name].labels(**self.constant, **labels)

    def set(self, name: str, labels: dict, value: float, step: int) -> None:
        """A gauge's value; a counter's running total (it only grows: the difference is added)."""
        if METRICS[name].kind == "counter":  # the series exists from the start, at 0
            key, child = (name, tuple(sorted(labels.items()))), self._child(name, labels)
            delta = value - self._totals.get(key, 0)
            if delta > 0:
                child.inc(delta)
                self._totals[key] = value
            return
        self._child(name, labels).set(value)

    def clear(self, name: str) -> None:
        """Drop every labelled series of ``name`` (the slowest rank changed: its old series must go)."""
        self._metrics[name].clear()

    def flush(self, step: int) -> None:
        if self.textfile:
            self.write_textfile()

    def write_textfile(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.textfile))
        os.makedirs(directory, exist_ok=True)
        self._pc.write_to_textfile(self.textfile, self.registry)

    def close(self) -> None:
        if self.textfile:
            self.write_textfile()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics" if self.port else ""
