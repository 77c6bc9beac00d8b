"""The /metrics HTTP server on the event loop: what Prometheus relies on, and what a bad or
slow client gets, over real connections on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import socket
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from hyperagent import exporter
from hyperagent.errors import ConfigError
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.readings import Kind, Reading

from conftest import REPO, free_port

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
READINGS = [
    *(Reading("hyperagent_gpu_power_watts", 100.0 + i, {"gpu": str(i)}) for i in range(64)),
    Reading("hyperagent_gpu_energy_joules_total", 1e12, {"gpu": "0"}, Kind.COUNTER),
    Reading("hyperagent_gpu_info", 1.0, {"gpu": "0", "model": 'A "B"'}, Kind.INFO),
]


@pytest.fixture
async def server() -> AsyncIterator[MetricsServer]:
    served = MetricsServer("127.0.0.1:0")
    served.collector.update(READINGS)
    await served.listen()
    try:
        yield served
    finally:
        await served.close()


def collected(readings: list[Reading]) -> SnapshotCollector:
    collector = SnapshotCollector()
    collector.update(readings)
    return collector


class Client:
    """A raw HTTP connection: what is sent is sent as is; responses are read one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def to(cls, port: int) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        """One response: status, headers (lower-case names), body (``Content-Length`` of it,
        none when ``head_only``, as for HEAD)."""
        async with asyncio.timeout(10):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            assert lines[0].startswith("HTTP/1.1 ")
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.lower()] = value.strip()
            length = 0 if head_only else int(headers["content-length"])
            body = await self.reader.readexactly(length)
        return status, headers, body

    async def closed(self) -> bool:
        """The server closed the connection (nothing more comes)."""
        async with asyncio.timeout(10):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


def get(path: str = "/metrics", *extra: str, version: str = "HTTP/1.1") -> bytes:
    lines = [f"GET {path} {version}", "Host: 127.0.0.1", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_a_scrape_gets_the_format_its_accept_header_picks(server: MetricsServer) -> None:
    client = await Client.to(server.port)
    await client.send(get("/metrics", f"Accept: {PROMETHEUS_ACCEPT}"))
    status, headers, body = await client.response()
    assert status == 200 and headers["content-type"] == OPENMETRICS
    assert body == openmetrics_latest(server.registry)
    assert headers["connection"] == "keep-alive" and "date" in headers
    await client.send(get("/metrics", "Accept: text/plain"))  # the same connection, kept alive
    status, headers, body = await client.response()
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert body == generate_latest(server.registry)
    await client.send(get("/metrics", f"Accept: {PROMETHEUS_ACCEPT}", "Accept-Encoding: gzip"))
    status, headers, body = await client.response()
    assert headers["content-encoding"] == "gzip"
    assert gzip.decompress(body) == openmetrics_latest(server.registry)
    await client.send(get("/metrics?name[]=hyperagent_gpu_info", "Accept: text/plain"))
    _, _, body = await client.response()
    assert body == generate_latest(collected(READINGS[-1:]))
    names = "name[]=hyperagent_gpu_info&name[]=hyperagent_gpu_energy_joules_total"
    await client.send(get(f"/metrics?{names}", f"Accept: {PROMETHEUS_ACCEPT}"))
    _, headers, body = await client.response()
    assert headers["content-type"] == OPENMETRICS
    assert body == openmetrics_latest(collected(READINGS[-2:]))
    assert b"hyperagent_gpu_power" not in body and b'hyperagent_gpu_info{gpu="0"' in body
    client.close()


async def test_head_options_other_paths_and_methods(server: MetricsServer) -> None:
    client = await Client.to(server.port)
    await client.send(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n")
    status, headers, _ = await client.response(head_only=True)
    assert status == 200 and int(headers["content-length"]) == len(generate_latest(server.registry))
    await client.send(b"OPTIONS /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await client.response()
    assert status == 200 and headers["allow"] == "GET, HEAD, OPTIONS" and body == b""
    await client.send(get("/"))
    status, _, body = await client.response()
    assert status == 404 and b"/metrics" in body
    await client.send(b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await client.response()
    assert status == 405 and headers["allow"] == "GET, HEAD, OPTIONS" and b"DELETE" in body
    await client.send(get("http://127.0.0.1/metrics", "Accept: text/plain"))  # absolute form
    status, _, body = await client.response()
    assert status == 200 and body == generate_latest(server.registry)
    client.close()


async def test_pipelined_requests_are_answered_in_order(server: MetricsServer) -> None:
    client = await Client.to(server.port)
    await client.send(get("/nothing") + get("/metrics", "Accept: text/plain") + get("/other"))
    assert [(await client.response())[0] for _ in range(3)] == [404, 200, 404]
    client.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics\r\n\r\n", 400),  # no version
        (b"GET  /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # two spaces
        (b"GET /metrics HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", 400),
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # TLS to a plain port
    ],
)
async def test_a_malformed_request_is_answered_and_the_connection_closed(
    server: MetricsServer, request_bytes: bytes, status: int
) -> None:
    client = await Client.to(server.port)
    await client.send(request_bytes)
    answered, headers, body = await client.response()
    assert answered == status and headers["connection"] == "close"
    assert body.startswith(f"{status} ".encode())
    assert await client.closed()


async def test_a_request_head_is_bounded_in_size_and_time(
    server: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await Client.to(server.port)
    await client.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000)
    status, _, _ = await client.response()
    assert status == 431 and await client.closed()
    monkeypatch.setattr(exporter, "REQUEST_TIMEOUT_S", 0.3)
    slow = await Client.to(server.port)
    began = time.monotonic()
    await slow.send(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
    status, _, body = await slow.response()
    assert status == 408 and b"not received" in body and await slow.closed()
    assert time.monotonic() - began < 5
    silent = await Client.to(server.port)  # a connection that says nothing at all
    assert await silent.closed()


async def test_http_1_0_and_connection_close_end_the_connection(server: MetricsServer) -> None:
    for request in (get(version="HTTP/1.0"), get("/metrics", "Connection: close")):
        client = await Client.to(server.port)
        await client.send(request)
        status, headers, _ = await client.response()
        assert status == 200 and headers["connection"] == "close"
        assert await client.closed()
    client = await Client.to(server.port)
    await client.send(get("/metrics", "Connection: keep-alive", version="HTTP/1.0"))
    _, headers, _ = await client.response()
    assert headers["connection"] == "keep-alive"
    await client.send(get(version="HTTP/1.0"))
    assert (await client.response())[0] == 200 and await client.closed()


async def test_an_idle_kept_alive_connection_is_closed(
    server: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exporter, "IDLE_TIMEOUT_S", 0.3)
    client = await Client.to(server.port)
    await client.send(get())
    assert (await client.response())[0] == 200
    assert await client.closed()


async def test_a_client_that_reads_nothing_stalls_neither_the_loop_nor_other_scrapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One client asks for a large body again and again and never reads: its connection stops
    being read once its responses back up, other scrapes are answered meanwhile, the event
    loop keeps its timers, and the stuck client is cut off after ``WRITE_TIMEOUT_S``."""
    monkeypatch.setattr(exporter, "WRITE_TIMEOUT_S", 1.0)
    big = [Reading("hyperagent_x", float(i), {"i": str(i), "pad": "p" * 200}) for i in range(4000)]
    server = MetricsServer("127.0.0.1:0")
    server.collector.update(big)
    await server.listen()
    stuck = socket.create_connection(("127.0.0.1", server.port))
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        stuck.sendall(get() * 200)
        ticks = 0
        began = time.monotonic()
        while time.monotonic() - began < 0.5:
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks > 20  # the loop ran its timers
        other = await Client.to(server.port)
        await other.send(get("/metrics", "Accept: text/plain"))
        status, _, body = await other.response()
        assert status == 200 and body == generate_latest(server.registry)
        other.close()
        pending = [c for c in server._connections if c.paused]
        assert len(pending) == 1  # the stuck client, its reading paused
        async with asyncio.timeout(10):
            while pending[0] in server._connections:
                await asyncio.sleep(0.05)  # cut off after WRITE_TIMEOUT_S
    finally:
        stuck.close()
        await server.close()


async def test_concurrent_scrapes_each_get_the_whole_body(server: MetricsServer) -> None:
    clients = [await Client.to(server.port) for _ in range(20)]
    for client in clients:
        await client.send(get("/metrics", f"Accept: {PROMETHEUS_ACCEPT}"))
    answers = await asyncio.gather(*(client.response() for client in clients))
    expected = openmetrics_latest(server.registry)
    assert all(status == 200 and body == expected for status, _, body in answers)
    for client in clients:
        client.close()


async def test_connections_over_the_bound_are_refused(
    server: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exporter, "MAX_CONNECTIONS", 2)
    kept = [await Client.to(server.port) for _ in range(2)]
    for client in kept:
        await client.send(get())
        assert (await client.response())[0] == 200
    refused = await Client.to(server.port)
    status, _, body = await refused.response()
    assert status == 503 and b"connections" in body and await refused.closed()
    for client in kept:
        client.close()


def test_served_from_a_thread_for_callers_outside_an_event_loop() -> None:
    """``start``/``stop`` (the coordinator's command line, synchronous callers): a server on a
    thread of its own, scraped concurrently from other threads."""
    server = MetricsServer("127.0.0.1:0")
    server.collector.update(READINGS)
    server.start()
    bodies: list[bytes] = []

    def scrape() -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            bodies.append(response.read())

    try:
        threads = [threading.Thread(target=scrape) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    finally:
        server.stop()
    assert bodies == [openmetrics_latest(server.registry)] * 8
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


async def test_an_address_in_use_is_a_config_error(server: MetricsServer) -> None:
    with pytest.raises(ConfigError, match=f"127.0.0.1:{server.port}"):
        await MetricsServer(f"127.0.0.1:{server.port}").listen()
    with pytest.raises(ConfigError, match=f"127.0.0.1:{server.port}"):
        MetricsServer(f"127.0.0.1:{server.port}").start()


async def test_an_agent_whose_event_loop_is_blocked_still_answers_with_its_last_snapshot(
    tmp_path: Path,
) -> None:
    """The agent serves /metrics from a thread of its own: a blocked event loop leaves the
    last snapshot served, its collection timestamp growing old (HyperagentCollectionStalled,
    rules/RUNBOOK.md), rather than a scrape target gone silent."""
    from hyperagent.agent import LAST_COLLECTION, Agent
    from hyperagent.capture.directory import capture_sources
    from hyperagent.config import build_config

    port = free_port()
    config = build_config(
        {
            "node": "n",
            "mqtt": {"enabled": False},
            "agent": {
                "interval_s": 0.2,
                "metrics_address": f"127.0.0.1:{port}",
                "state_dir": str(tmp_path),
            },
            "sources": {"job": {"socket": str(tmp_path / "job.sock")}},
        }
    )
    sources, hardware = capture_sources(REPO / "fixtures" / "replay" / "full-node", config)
    agent = Agent.from_config(config, hardware, sources=sources)
    task = asyncio.create_task(agent.run())
    answers: list[tuple[float, bytes]] = []

    def scrape() -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            answers.append((time.monotonic(), response.read()))

    try:
        async with asyncio.timeout(20):
            await agent.ready.wait()
        scraping = threading.Thread(target=scrape)
        scraping.start()
        time.sleep(1.0)  # noqa: ASYNC251 (the event loop blocked for a second, on purpose)
        unblocked = time.monotonic()
        scraping.join(timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    [(answered, body)] = answers
    assert answered < unblocked and f"{LAST_COLLECTION} ".encode() in body
