"""Prometheus exposition of the latest snapshot: a custom collector doing no I/O in collect().

A scrape's body is prometheus_client's encoding for the Accept header, made once per snapshot
and format and kept for later scrapes of the same snapshot (OpenMetrics, what Prometheus asks
for, rendered by :class:`OpenMetricsText`), served by a small HTTP/1.1 server on an asyncio
event loop (the agent's runs in a thread of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import operator
import re
import socket
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from urllib.parse import parse_qs

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
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class OpenMetricsText:
    """prometheus_client's OpenMetrics 1.0.0 text (underscore escaping) of a collector's
    readings, byte for byte, straight from the readings (no Metric objects) and without its
    per-character name checks. Between renders it keeps each family's text while the family is
    the same Reading objects (a source read at its own interval hands the runner the same
    readings until its next read: the BMC, the PDU, NVML's health batch), and each sample's
    ``name{labels} `` part while the family's label dicts are the same objects (the sources
    build a device's labels once), so that such a family costs one number format per sample;
    a label dict built afresh finds its text by content. Readings whose name or label names
    fall outside the legacy character set render the whole body through prometheus_client."""

    def __init__(self) -> None:
        self._families: dict[str, _RenderedFamily] = {}
        self._texts: dict[tuple[tuple[str, str], ...], str] = {}

    def __call__(self, collector: SnapshotCollector) -> bytes:
        body = self.render(collector.readings())
        return openmetrics_latest(collector) if body is None else body

    def render(self, readings: Sequence[Reading]) -> bytes | None:
        """The body of ``readings`` as :func:`families` makes them; None where a family holds
        what only prometheus_client renders the same (see the class)."""
        out: list[str] = []
        kept: dict[str, _RenderedFamily] = {}
        previous = self._families
        for name, group in by_name(readings).items():
            family = previous.get(name)
            if family is None or not family.holds(group):
                family = self._render_family(name, group, family)
                if family is None:
                    return None
            kept[name] = family
            out.append(family.text)
        out.append("# EOF\n")
        self._families = kept
        if len(self._texts) > 4 * len(readings) + 1024:  # label sets of departed series
            self._texts = {}
        return "".join(out).encode("utf-8")

    def _render_family(
        self, name: str, group: list[Reading], previous: _RenderedFamily | None
    ) -> _RenderedFamily | None:
        kind = group[0].kind
        labels = [r.labels for r in group]
        info = kind is Kind.INFO
        packed = b"" if info else _packed([r.value for r in group])
        if previous is not None and previous.same_labels(kind, labels):
            if packed is not None and packed == previous.packed:  # the very same values
                return _RenderedFamily(
                    group, labels, kind, previous.head, previous.prefixes, packed, previous.text
                )
            head, prefixes = previous.head, previous.prefixes
        else:
            made = self._prefixes(name, kind, group)
            if made is None:
                return None
            head, prefixes = made
        if info:
            text = head + "".join([f"{p}1.0\n" for p in prefixes])
        else:
            values = map(floatToGoString, [r.value for r in group])
            text = head + "".join([f"{p}{v}\n" for p, v in zip(prefixes, values, strict=True)])
        return _RenderedFamily(group, labels, kind, head, prefixes, packed, text)

    def _prefixes(
        self, name: str, kind: Kind, group: list[Reading]
    ) -> tuple[str, list[str]] | None:
        """The family's HELP and TYPE lines and each sample's ``name{labels} ``."""
        suffix = _SUFFIX[kind]
        family = name.removesuffix(suffix) if suffix else name
        if not _LEGACY_NAME.match(family):
            return None
        sample = family + suffix
        head = f"# HELP {family} {_escaped(help_text(name))}\n# TYPE {family} {_TYPE[kind]}\n"
        sets = [_as_dict(r.labels) for r in group] if kind is Kind.INFO else _label_sets(group)
        texts = self._texts
        prefixes = []
        for labels in sets:
            content = tuple(labels.items())
            text = texts.get(content)
            if text is None:
                if not all(_LEGACY_NAME.match(k) for k in labels):
                    return None
                pairs = ",".join(f'{k}="{_escaped(v)}"' for k, v in sorted(labels.items()))
                text = texts[content] = "{" + pairs + "}" if labels else ""
            prefixes.append(f"{sample}{text} ")
        return head, prefixes


def _packed(values: list[float]) -> bytes | None:
    """The values as the doubles they are written from, bit for bit (0.0 and -0.0 differ);
    None where one is not a number a double holds."""
    try:
        return array("d", values).tobytes()
    except (TypeError, OverflowError):
        return None


@dataclass(frozen=True, slots=True)
class _RenderedFamily:
    """One family's text, the readings it was rendered from (kept, so that their ids stay
    theirs while the text is), their labels, each sample's part before its value and the
    values as doubles (:func:`_packed`; empty for info, None where not all are numbers)."""

    readings: list[Reading]
    labels: list[Mapping[str, str]]
    kind: Kind
    head: str
    prefixes: list[str]
    packed: bytes | None
    text: str

    def holds(self, group: list[Reading]) -> bool:
        """``group`` is the very readings this text was rendered from."""
        return len(group) == len(self.readings) and all(map(operator.is_, group, self.readings))

    def same_labels(self, kind: Kind, labels: list[Mapping[str, str]]) -> bool:
        """``labels`` are this family's samples' labels, in order (the same dicts, or equal
        ones), and ``kind`` its kind."""
        return kind is self.kind and labels == self.labels


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
        self._rendered: dict[tuple[str, bool], bytes] = {}
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
        self,
        content_type: str,
        encoder: Callable[[SnapshotCollector], bytes] | None = None,
        gzipped: bool = False,
    ) -> bytes:
        """The body of a scrape in ``content_type``: ``encoder`` (by default prometheus_client's
        for that content type) over this collector, gzipped if asked (``GZIP_LEVEL``), cached
        until the next update."""
        key = (content_type, gzipped)
        with self._lock:
            readings, body = self._readings, self._rendered.get(key)
        if body is None:
            if gzipped:
                body = gzip.compress(self.exposition(content_type, encoder), GZIP_LEVEL)
            else:
                body = (encoder or choose_encoder(content_type)[0])(self)
            with self._lock:
                if self._readings is readings:
                    self._rendered[key] = body
        return body


MAX_REQUEST_BYTES = 8192
"""A request's line and headers at most; a longer one is answered 431 and the connection
closed."""

REQUEST_TIMEOUT_S = 10.0
"""A request's line and headers must arrive within this from its first byte (or from the
connection); else 408, and the connection is closed."""

IDLE_TIMEOUT_S = 120.0
"""A kept-alive connection that sends no new request for this long is closed."""

WRITE_TIMEOUT_S = 30.0
"""A client that takes no bytes of a response it asked for for this long is disconnected."""

MAX_CONNECTIONS = 64
"""Connections served at once; one more is answered 503 and closed."""

GZIP_LEVEL = 1
"""What a scrape asking for gzip gets: the fastest level (a 77 KiB body in 0.2 ms instead of
gzip's default 1.4 ms, 12 KiB instead of 10)."""

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_ALLOW = "GET, HEAD, OPTIONS"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class _Refusal(Exception):
    """A request answered with an error status, after which the connection is closed."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless asked to close; HTTP/1.0 only when asked."""
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.1":
            return "close" not in tokens
        return "keep-alive" in tokens


def _parse_request(head: bytes) -> _Request:
    """A request's line and headers (CRLF line ends, no obsolete line folding), strictly as
    RFC 9112 has them; raises _Refusal."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise _Refusal(400, "malformed request line")
    method, target, version = (p.decode("latin-1") for p in parts)
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if _TOKEN.fullmatch(parts[0]) and version.startswith("HTTP/"):
            raise _Refusal(505, f"{version} is not served; use HTTP/1.1")
        raise _Refusal(400, "malformed request line")
    if not _TOKEN.fullmatch(parts[0]):
        raise _Refusal(400, "malformed method")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise _Refusal(400, "malformed header line")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if version == "HTTP/1.1" and "host" not in headers:
        raise _Refusal(400, "an HTTP/1.1 request needs a Host header")
    length = headers.get("content-length", "0")
    if "transfer-encoding" in headers or not length.isdigit() or int(length):
        raise _Refusal(400, "requests with a body are not served")
    if target.startswith(("http://", "https://")):  # absolute form: the path is what counts
        target = "/" + target.split("/", 3)[3] if target.count("/") >= 3 else "/"
    path, _, query = target.partition("?")
    return _Request(method, path, query, version, headers)


class _Connection(asyncio.Protocol):
    """One client of a :class:`MetricsServer`: requests answered in order as they arrive
    (pipelined ones too), reading paused while a response waits for the client to take it."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server._connections.add(self)
        if len(self.server._connections) > MAX_CONNECTIONS:
            self._fail(503, f"over {MAX_CONNECTIONS} connections")
            return
        self._arm(REQUEST_TIMEOUT_S, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if (
            not self.buffer
            and self.timer is not None
            and self.timer.when() > (asyncio.get_running_loop().time() + REQUEST_TIMEOUT_S)
        ):  # a kept-alive connection's next request began
            self._arm(REQUEST_TIMEOUT_S, self._timed_out)
        self.buffer += data
        self._serve()

    def pause_writing(self) -> None:
        self.paused = True
        assert self.transport is not None
        self.transport.pause_reading()
        self._arm(WRITE_TIMEOUT_S, self._abort)

    def resume_writing(self) -> None:
        self.paused = False
        if self.closing:
            return
        assert self.transport is not None
        self.transport.resume_reading()
        self._arm(REQUEST_TIMEOUT_S if self.buffer else IDLE_TIMEOUT_S, self._timed_out)
        self._serve()

    def _serve(self) -> None:
        while not self.paused and not self.closing:
            self.buffer = self.buffer.lstrip(b"\r\n")  # empty lines before a request
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_REQUEST_BYTES:
                    self._fail(431, f"request line and headers over {MAX_REQUEST_BYTES} bytes")
                return
            if end > MAX_REQUEST_BYTES:
                self._fail(431, f"request line and headers over {MAX_REQUEST_BYTES} bytes")
                return
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            try:
                request = _parse_request(head)
            except _Refusal as e:
                self._fail(e.status, str(e))
                return
            keep = request.keep_alive
            status, headers, body = self.server._answer(request)
            self._send(status, headers, b"" if request.method == "HEAD" else body, keep, len(body))
            if not keep:
                self._close()
                return
            if not self.paused:
                self._arm(REQUEST_TIMEOUT_S if self.buffer else IDLE_TIMEOUT_S, self._timed_out)

    def _send(
        self,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        keep: bool,
        length: int,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Date: {_http_date()}"]
        lines += [f"{k}: {v}" for k, v in headers]
        lines.append(f"Content-Length: {length}")
        lines.append("Connection: keep-alive" if keep else "Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        assert self.transport is not None
        self.transport.write(head + body if body else head)

    def _fail(self, status: int, detail: str) -> None:
        """Answer ``status`` saying why, then close."""
        body = f"{status} {_REASONS[status]}: {detail}\n".encode()
        self._send(status, [("Content-Type", "text/plain; charset=utf-8")], body, False, len(body))
        self._close()

    def _close(self) -> None:
        """Close once what was written is sent (a client that takes none of it is cut off
        after ``WRITE_TIMEOUT_S``)."""
        self.closing = True
        assert self.transport is not None
        self.transport.close()
        self._arm(WRITE_TIMEOUT_S, self._abort)

    def _timed_out(self) -> None:
        if self.buffer:
            self._fail(408, f"request line and headers not received in {REQUEST_TIMEOUT_S:g} s")
        else:  # idle between requests: nothing to answer
            self._close()

    def _abort(self) -> None:
        assert self.transport is not None
        self.transport.abort()

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(delay, callback)


_date: tuple[int, str] = (0, "")


def _http_date() -> str:
    """Now as an HTTP Date header says it (computed once a second)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


class MetricsServer:
    """A private registry with one SnapshotCollector, served over HTTP/1.1 on ``address``.

    GET or HEAD of ``/metrics`` answers the collector's latest snapshot in the format the Accept
    header picks (as prometheus_client's encoders make it: OpenMetrics rendered by
    :class:`OpenMetricsText`, others by prometheus_client), gzipped when Accept-Encoding asks,
    ``?name[]=NAME`` (repeated) keeps the samples of those names; other paths 404, other methods
    405.
    Connections are kept alive (HTTP/1.1) unless asked not to; a request's head is bounded in
    size (``MAX_REQUEST_BYTES``) and time (``REQUEST_TIMEOUT_S``), and a malformed one is
    answered 400 and the connection closed. ``start`` serves from a thread with an event loop
    of its own (the agent's and the coordinator's way: a blocked event loop of theirs leaves
    their last snapshot served); ``listen`` serves on the running event loop."""

    def __init__(self, address: str, collector: SnapshotCollector | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.collector = collector or SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._openmetrics = OpenMetricsText()
        self._encoders: dict[str, tuple[Callable[[SnapshotCollector], bytes], str]] = {}
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._thread_stop: asyncio.Event | None = None

    def _bind(self) -> socket.socket:
        """The listening socket (the first address ``host`` resolves to); raises ConfigError
        naming the address when it cannot be bound."""
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux: a scrape is one wake-up
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 1)
                sock.bind(sockaddr)
                sock.listen(64)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except OSError as e:
            problem = ConfigProblem(
                "agent.metrics_address", f"{self.host}:{self.port}: {e.strerror or e}"
            )
            raise ConfigError([problem]) from e
        self.port = sock.getsockname()[1]
        return sock

    async def listen(self) -> None:
        """Serve on the running event loop until ``close``; raises ConfigError naming the
        address when it cannot be bound."""
        await self._listen(self._bind())

    async def _listen(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    async def close(self) -> None:
        """Stop listening and close every connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.abort()
        await server.wait_closed()

    def start(self) -> None:
        """Serve from a thread with an event loop of its own; raises ConfigError naming the
        address when it cannot be bound."""
        sock = self._bind()
        ready = threading.Event()
        failed: list[BaseException] = []

        async def serve() -> None:
            self._thread_loop = asyncio.get_running_loop()
            self._thread_stop = asyncio.Event()
            try:
                await self._listen(sock)
            except BaseException as e:
                failed.append(e)
                sock.close()
                raise
            finally:
                ready.set()
            await self._thread_stop.wait()
            await self.close()

        self._thread = threading.Thread(target=asyncio.run, args=(serve(),), name="metrics")
        self._thread.daemon = True
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self._thread = None
            raise failed[0]

    def stop(self) -> None:
        """Stop the thread ``start`` began (its connections closed)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._thread_loop is not None and self._thread_stop is not None
        with contextlib.suppress(RuntimeError):  # its loop ended already
            self._thread_loop.call_soon_threadsafe(self._thread_stop.set)
        thread.join()

    def _answer(self, request: _Request) -> tuple[int, list[tuple[str, str]], bytes]:
        """Status, headers and body of ``request`` (a HEAD gets the body's length only)."""
        if request.method == "OPTIONS":
            return 200, [("Allow", _ALLOW)], b""
        if request.method not in ("GET", "HEAD"):
            body = f"# HTTP 405 Method Not Allowed: {request.method}; use GET\n".encode()
            return 405, [("Allow", _ALLOW), ("Content-Type", "text/plain; charset=utf-8")], body
        if request.path != "/metrics":
            return 404, [("Content-Type", "text/plain; charset=utf-8")], b"/metrics is here\n"
        headers = request.headers
        encoder, content_type = self._encoder(headers.get("accept", ""))
        zipped = gzip_accepted(headers.get("accept-encoding", ""))
        names = parse_qs(request.query).get("name[]") if "name[]" in request.query else None
        if names:  # prometheus_client's encoder over the samples of those names
            wanted = set(names)
            chosen = SnapshotCollector()
            chosen.update([r for r in self.collector.readings() if r.name in wanted])
            body = choose_encoder(headers.get("accept", ""))[0](chosen)
            if zipped:
                body = gzip.compress(body, GZIP_LEVEL)
        else:
            body = self.collector.exposition(content_type, encoder, zipped)
        out = [("Content-Type", content_type)]
        if zipped:
            out.append(("Content-Encoding", "gzip"))
        return 200, out, body

    def _encoder(self, accept: str) -> tuple[Callable[[SnapshotCollector], bytes], str]:
        """The encoder and content type prometheus_client chooses for ``accept``, with
        :class:`OpenMetricsText` for the OpenMetrics text it renders the same."""
        found = self._encoders.get(accept)
        if found is None:
            chosen, content_type = choose_encoder(accept)
            encoder: Callable[[SnapshotCollector], bytes] = chosen
            if _is_openmetrics_underscores(chosen):
                encoder = self._openmetrics
            found = (encoder, content_type)
            if len(self._encoders) >= 64:
                self._encoders.clear()
            self._encoders[accept] = found
        return found
