"""Prometheus exposition of the latest snapshot: a custom collector doing no I/O in collect().

A scrape's body is prometheus_client's encoding for the Accept header, made once per snapshot
and format and kept for later scrapes of the same snapshot; ``name[]`` filters and methods other
than GET go to prometheus_client's own app.
"""

from __future__ import annotations

import contextlib
import gzip
import operator
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics.exposition import UNDERSCORES
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
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


_LEGACY_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _escaped(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class OpenMetricsText:
    """prometheus_client's OpenMetrics 1.0.0 text (underscore escaping) of a collector's
    readings, byte for byte, straight from the readings (no Metric objects) and without its
    per-character name checks. Between renders it keeps the label part of each sample while
    its label dict lives on (the sources build a device's labels once), and each family's
    text while the family is the same Reading objects (a source read at its own interval hands
    the runner the same readings until its next read: the BMC, the PDU, NVML's health batch).
    Readings whose name or label names fall outside the legacy character set render the whole
    body through prometheus_client."""

    def __init__(self) -> None:
        self._labels: dict[int, tuple[Mapping[str, str], str]] = {}
        self._families: dict[str, _RenderedFamily] = {}
        self._texts: dict[tuple[tuple[str, str], ...], str] = {}
        self._texts_kept: dict[tuple[tuple[str, str], ...], str] = {}

    def __call__(self, collector: SnapshotCollector) -> bytes:
        body = self.render(collector.readings())
        return openmetrics_latest(collector) if body is None else body

    def render(self, readings: Sequence[Reading]) -> bytes | None:
        """The body of ``readings`` as :func:`families` makes them; None where a family holds
        what only prometheus_client renders the same (see the class)."""
        out: list[str] = []
        labels_kept: dict[int, tuple[Mapping[str, str], str]] = {}
        families_kept: dict[str, _RenderedFamily] = {}
        self._texts_kept = {}
        for name, group in by_name(readings).items():
            family = self._families.get(name)
            if family is None or not family.holds(group):
                family = self._render_family(name, group)
                if family is None:
                    return None
            labels_kept.update(family.labels)
            families_kept[name] = family
            out.append(family.text)
        out.append("# EOF\n")
        self._labels = labels_kept
        self._families = families_kept
        self._texts = self._texts_kept
        return "".join(out).encode("utf-8")

    def _render_family(self, name: str, group: list[Reading]) -> _RenderedFamily | None:
        kind = group[0].kind
        suffix = _SUFFIX[kind]
        family = name.removesuffix(suffix) if suffix else name
        if not _LEGACY_NAME.match(family):
            return None
        sample = family + suffix
        out = [f"# HELP {family} {_escaped(help_text(name))}\n# TYPE {family} {_TYPE[kind]}\n"]
        info = kind is Kind.INFO
        sets = [_as_dict(r.labels) for r in group] if info else _label_sets(group)
        cache = self._labels
        texts = self._texts_kept
        kept: dict[int, tuple[Mapping[str, str], str]] = {}
        for r, labels in zip(group, sets, strict=True):
            found = cache.get(id(labels))
            if found is not None and found[0] is labels:
                text = found[1]
            else:
                content = tuple(labels.items())
                text = texts.get(content) or self._texts.get(content) or ""
                if not text and labels:
                    if not all(_LEGACY_NAME.match(k) for k in labels):
                        return None
                    pairs = ",".join(f'{k}="{_escaped(v)}"' for k, v in sorted(labels.items()))
                    text = "{" + pairs + "}"
                texts[content] = text
            kept[id(labels)] = (labels, text)
            out.append(f"{sample}{text} {floatToGoString(1.0 if info else r.value)}\n")
        return _RenderedFamily(group, "".join(out), kept)


@dataclass(frozen=True, slots=True)
class _RenderedFamily:
    """One family's text and the readings it was rendered from (kept, so that their ids stay
    theirs while the text is)."""

    readings: list[Reading]
    text: str
    labels: dict[int, tuple[Mapping[str, str], str]]

    def holds(self, group: list[Reading]) -> bool:
        """``group`` is the very readings this text was rendered from."""
        return len(group) == len(self.readings) and all(map(operator.is_, group, self.readings))


def _is_openmetrics_underscores(encoder: Callable[..., bytes]) -> bool:
    """Whether ``encoder`` (from choose_encoder) is prometheus_client's OpenMetrics text with
    underscore escaping, which :class:`OpenMetricsText` renders the same."""
    keywords = getattr(encoder, "keywords", {})
    return (
        getattr(encoder, "func", None) is openmetrics_latest
        and keywords.get("escaping") == UNDERSCORES
        and str(keywords.get("version", "1.0.0")).startswith("1.")
    )


class SnapshotCollector:
    """Exposes whatever readings were last handed to ``update``; thread-safe swap.

    The families, and each exposition format asked for, are built on the first scrape after an
    update and kept for later scrapes of the same readings.
    """

    def __init__(self) -> None:
        self._readings: tuple[Reading, ...] = ()
        self._families: list[Metric] | None = []
        self._rendered: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def update(self, readings: Sequence[Reading]) -> None:
        readings = tuple(readings)
        with self._lock:
            self._readings = readings
            self._families = None
            self._rendered = {}

    def collect(self) -> Iterator[Metric]:
        return iter(self._built()[1])

    def readings(self) -> tuple[Reading, ...]:
        """The readings of the last update."""
        with self._lock:
            return self._readings

    def _built(self) -> tuple[tuple[Reading, ...], list[Metric]]:
        with self._lock:
            readings, built = self._readings, self._families
        if built is None:
            built = families(readings)
            with self._lock:
                if self._readings is readings:
                    self._families = built
        return readings, built

    def exposition(
        self, content_type: str, encoder: Callable[[SnapshotCollector], bytes] | None = None
    ) -> bytes:
        """The body of a scrape in ``content_type``: ``encoder`` (by default prometheus_client's
        for that content type) over this collector, cached until the next update."""
        with self._lock:
            readings, body = self._readings, self._rendered.get(content_type)
        if body is None:
            body = (encoder or choose_encoder(content_type)[0])(self)
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
        self._openmetrics = OpenMetricsText()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The WSGI app: /metrics of the collector, as prometheus_client's app serves it."""
        if (
            environ["REQUEST_METHOD"] == "GET"
            and environ.get("PATH_INFO") != "/favicon.ico"
            and "name[]" not in environ.get("QUERY_STRING", "")
        ):
            chosen, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
            encoder: Callable[[SnapshotCollector], bytes] = chosen
            if _is_openmetrics_underscores(chosen):
                encoder = self._openmetrics
            body = self.collector.exposition(content_type, encoder)
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
