"""Prometheus exposition of the latest snapshot: a custom collector doing no I/O in collect()."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from hyperagent.catalog import help_text
from hyperagent.errors import ConfigError, ConfigProblem
from hyperagent.readings import Kind, Reading, by_name


def _families(readings: Sequence[Reading]) -> Iterator[Metric]:
    for name, group in by_name(readings).items():
        kind = group[0].kind
        if kind is Kind.INFO:
            info = InfoMetricFamily(name.removesuffix("_info"), help_text(name))
            for r in group:
                info.add_metric([], dict(r.labels))
            yield info
            continue
        labelnames = sorted(set().union(*(r.labels for r in group)))
        family: CounterMetricFamily | GaugeMetricFamily
        if kind is Kind.COUNTER:
            family = CounterMetricFamily(
                name.removesuffix("_total"), help_text(name), labels=labelnames
            )
        else:
            family = GaugeMetricFamily(name, help_text(name), labels=labelnames)
        for r in group:
            family.add_metric([r.labels.get(k, "") for k in labelnames], r.value)
        yield family


class SnapshotCollector:
    """Exposes whatever readings were last handed to ``update``; thread-safe swap."""

    def __init__(self) -> None:
        self._readings: tuple[Reading, ...] = ()
        self._lock = threading.Lock()

    def update(self, readings: Sequence[Reading]) -> None:
        with self._lock:
            self._readings = tuple(readings)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            readings = self._readings
        yield from _families(readings)


class MetricsServer:
    """A private registry with one SnapshotCollector, served over HTTP on ``address``."""

    def __init__(self, address: str, collector: SnapshotCollector | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.collector = collector or SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start serving; raises ConfigError naming the address when it cannot be bound."""
        try:
            self._server, self._thread = start_http_server(
                self.port, addr=self.host, registry=self.registry
            )
        except OSError as e:
            problem = ConfigProblem(
                "agent.metrics_address", f"{self.host}:{self.port}: {e.strerror}"
            )
            raise ConfigError([problem]) from e
        self.port = self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
