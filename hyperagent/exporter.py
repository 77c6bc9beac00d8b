"""Prometheus exposition of the latest snapshot: a custom collector doing no I/O in collect().

The HTTP server renders the two formats Prometheus asks for (OpenMetrics 1.0.0 and text 0.0.4)
itself, once per snapshot and byte for byte as prometheus_client would; anything else (another
format or escaping, ``name[]`` filters, other methods) goes to prometheus_client's own app.
"""

from __future__ import annotations

import contextlib
import gzip
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from hyperagent.catalog import help_text
from hyperagent.errors import ConfigError, ConfigProblem
from hyperagent.readings import Kind, Reading, by_name

_TYPE = {Kind.GAUGE: "gauge", Kind.COUNTER: "counter", Kind.INFO: "info"}
_SUFFIX = {Kind.GAUGE: "", Kind.COUNTER: "_total", Kind.INFO: "_info"}


def _as_dict(labels: Mapping[str, str]) -> dict[str, str]:
    return labels if isinstance(labels, dict) else dict(labels)


def _label_sets(group: list[Reading]) -> list[dict[str, str]]:
    """Each reading's labels; where the readings of one name disagree on label names, every
    set is completed with empty values so that the family has one set of label names."""
    first = group[0].labels.keys()
    if all(r.labels.keys() == first for r in group):
        return [_as_dict(r.labels) for r in group]
    names = sorted(set().union(*(r.labels for r in group)))
    return [{k: r.labels.get(k, "") for k in names} for r in group]


def families(readings: Sequence[Reading]) -> list[Metric]:
    """One metric family per name, its samples built directly from the readings (their label
    dicts are shared, not copied). A name keeps the kind of its first reading."""
    out = []
    for name, group in by_name(readings).items():
        kind = group[0].kind
        suffix = _SUFFIX[kind]
        family = Metric(name.removesuffix(suffix) if suffix else name, help_text(name), _TYPE[kind])
        sample_name = family.name + suffix
        if kind is Kind.INFO:  # each info sample keeps its own labels
            family.samples = [Sample(sample_name, _as_dict(r.labels), 1.0) for r in group]
        else:
            family.samples = [
                Sample(sample_name, labels, r.value)
                for r, labels in zip(group, _label_sets(group), strict=True)
            ]
        out.append(family)
    return out


OPENMETRICS = openmetrics.CONTENT_TYPE_LATEST
"""What prometheus_client answers an Accept header naming OpenMetrics without a version."""
OPENMETRICS_1_0_0 = f"{OPENMETRICS}; escaping={openmetrics.UNDERSCORES}"
"""... and one naming version 1.0.0 (as Prometheus sends) with the default escaping."""
_PLAIN_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_plain_names: set[str] = set()


def _plain(name: str) -> bool:
    """Whether every escaping scheme leaves ``name`` as it is (a legacy name without colons)."""
    if name in _plain_names:
        return True
    if _PLAIN_NAME.fullmatch(name) is None:
        return False
    _plain_names.add(name)
    return True


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def render(metrics: Iterable[Metric], content_type: str) -> bytes | None:
    """The exposition prometheus_client's encoder for ``content_type`` (text 0.0.4 or
    OpenMetrics 1.0.0) would produce for ``metrics``; None for another format, or a name that
    an escaping scheme would change (prometheus_client then renders it)."""
    om = content_type in (OPENMETRICS, OPENMETRICS_1_0_0)
    if not om and content_type != CONTENT_TYPE_PLAIN_0_0_4:
        return None
    out: list[str] = []
    for metric in metrics:
        name, kind = metric.name, metric.type
        if not _plain(name) or metric.unit or kind not in ("gauge", "counter", "info"):
            return None
        if om:
            out.append(f"# HELP {name} {_escape_value(metric.documentation)}\n")
            out.append(f"# TYPE {name} {kind}\n")
        else:
            shown = name + _SUFFIX[Kind(kind)]
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {shown} {doc}\n")
            out.append(f"# TYPE {shown} {'gauge' if kind == 'info' else kind}\n")
        for sample in metric.samples:
            if sample.timestamp is not None or sample.exemplar or sample.native_histogram:
                return None
            if sample.labels:
                pairs = sorted(sample.labels.items())
                if not all(_plain(k) for k, _ in pairs):
                    return None
                labels = ",".join(f'{k}="{_escape_value(v)}"' for k, v in pairs)
                out.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n")
            else:
                out.append(f"{sample.name} {floatToGoString(sample.value)}\n")
    if om:
        out.append("# EOF\n")
    return "".join(out).encode()


class SnapshotCollector:
    """Exposes whatever readings were last handed to ``update``; thread-safe swap.

    The families, and each exposition format asked for, are built on the first scrape after an
    update and kept for later scrapes of the same readings.
    """

    def __init__(self) -> None:
        self._readings: tuple[Reading, ...] = ()
        self._families: list[Metric] | None = []
        self._rendered: dict[str, bytes | None] = {}
        self._lock = threading.Lock()

    def update(self, readings: Sequence[Reading]) -> None:
        readings = tuple(readings)
        with self._lock:
            self._readings = readings
            self._families = None
            self._rendered = {}

    def collect(self) -> Iterator[Metric]:
        return iter(self._built()[1])

    def _built(self) -> tuple[tuple[Reading, ...], list[Metric]]:
        with self._lock:
            readings, built = self._readings, self._families
        if built is None:
            built = families(readings)
            with self._lock:
                if self._readings is readings:
                    self._families = built
        return readings, built

    def exposition(self, content_type: str) -> bytes | None:
        """The body of a scrape in ``content_type`` (see :func:`render`), cached per update."""
        with self._lock:
            if content_type in self._rendered:
                return self._rendered[content_type]
        readings, built = self._built()
        body = render(built, content_type)
        with self._lock:
            if self._readings is readings:
                self._rendered[content_type] = body
        return body


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


IDLE_POLL_S = 3600.0
"""How often the idle HTTP server looks for a shutdown request on its own (``stop`` wakes it):
socketserver's default of 0.5 s costs two thread wake-ups a second for nothing."""

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class MetricsServer:
    """A private registry with one SnapshotCollector, served over HTTP on ``address``."""

    def __init__(self, address: str, collector: SnapshotCollector | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.collector = collector or SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._fallback = make_wsgi_app(self.registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The WSGI app: /metrics of the collector, as prometheus_client's app serves it."""
        if (
            environ["REQUEST_METHOD"] == "GET"
            and environ.get("PATH_INFO") != "/favicon.ico"
            and "name[]" not in environ.get("QUERY_STRING", "")
        ):
            _, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
            body = self.collector.exposition(content_type)
            if body is not None:
                headers = [("Content-Type", content_type)]
                if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
                    body = gzip.compress(body)
                    headers.append(("Content-Encoding", "gzip"))
                start_response("200 OK", headers)
                return [body]
        response: Iterable[bytes] = self._fallback(environ, start_response)
        return response

    def start(self) -> None:
        """Start serving; raises ConfigError naming the address when it cannot be bound."""

        class Server(_ThreadingServer):
            pass

        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            Server.address_family = family
            server = make_server(
                str(sockaddr[0]), self.port, self.app, Server, handler_class=_QuietHandler
            )
        except OSError as e:
            problem = ConfigProblem(
                "agent.metrics_address", f"{self.host}:{self.port}: {e.strerror or e}"
            )
            raise ConfigError([problem]) from e
        self._server = server
        self.port = server.server_port
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": IDLE_POLL_S},
            name="metrics",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving: the server is asked to shut down and woken by a connection (it does
        not poll while idle)."""
        server, self._server = self._server, None
        if server is None:
            return
        stopping = threading.Thread(target=server.shutdown, name="metrics-stop", daemon=True)
        stopping.start()
        host = self.host
        if host in ("", "0.0.0.0", "::"):
            host = "::1" if server.address_family == socket.AF_INET6 else "127.0.0.1"
        while stopping.is_alive():
            with contextlib.suppress(OSError):
                socket.create_connection((host, self.port), timeout=1.0).close()
            stopping.join(0.05)
        server.server_close()
