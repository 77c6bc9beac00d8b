"""Simulated MQTT peers for the benchmarks: a small MQTT 3.1.1 client over asyncio streams, the
packet encoders it uses, and a mosquitto broker on a loopback port.

The client is deliberately thin (no reconnection, no session state beyond QoS 1 in flight) so
that thousands of simulated agents cost little next to the processes being measured; what a
simulated agent does with a message (decode, verify a signature, encode an answer) is the
package's own code, called by the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14


def remaining_length(n: int) -> bytes:
    """MQTT's variable-length encoding of a packet's remaining length."""
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("!H", len(data)) + data


def connect_packet(client_id: str, keepalive_s: int = 0, clean: bool = True) -> bytes:
    body = _string("MQTT") + bytes([4, 0x02 if clean else 0]) + struct.pack("!H", keepalive_s)
    body += _string(client_id)
    return bytes([CONNECT << 4]) + remaining_length(len(body)) + body


def publish_packet(
    topic: str | bytes, payload: bytes, qos: int = 0, retain: bool = False, packet_id: int = 0
) -> bytes:
    """A PUBLISH packet; ``packet_id`` is required (non-zero) for QoS 1."""
    body = _string(topic) + (struct.pack("!H", packet_id) if qos else b"") + payload
    header = (PUBLISH << 4) | (qos << 1) | int(retain)
    return bytes([header]) + remaining_length(len(body)) + body


def subscribe_packet(packet_id: int, topic_filter: str, qos: int) -> bytes:
    body = struct.pack("!H", packet_id) + _string(topic_filter) + bytes([qos])
    return bytes([(SUBSCRIBE << 4) | 0x02]) + remaining_length(len(body)) + body


def puback_packet(packet_id: int) -> bytes:
    return bytes([PUBACK << 4, 2]) + struct.pack("!H", packet_id)


class MqttError(Exception):
    """The broker refused or broke a simulated client's connection."""


OnMessage = Callable[["SimClient", str, bytes], Awaitable[None] | None]


class SimClient:
    """One simulated MQTT client: connect, subscribe, publish at QoS 0 or 1, receive.

    Incoming PUBLISH packets go to ``on_message`` (a plain or async callable) after a QoS 1
    one is acknowledged; ``unacked`` counts this client's QoS 1 publishes the broker has not
    acknowledged yet.
    """

    def __init__(self, client_id: str, on_message: OnMessage | None = None) -> None:
        self.client_id = client_id
        self.on_message = on_message
        self.unacked = 0
        self.received = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._next_id = 0
        self._subacks: dict[int, asyncio.Future[None]] = {}
        self._receiving: asyncio.Task[None] | None = None

    async def connect(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            self._reader, self._writer = await asyncio.open_connection(host, port)
            self._writer.write(connect_packet(self.client_id))
            header, body = await self._read_packet()
        if header >> 4 != CONNACK or len(body) != 2 or body[1] != 0:
            raise MqttError(f"{self.client_id}: connection refused ({body!r})")
        self._receiving = asyncio.create_task(self._receive(), name=f"sim-{self.client_id}")

    def _packet_id(self) -> int:
        self._next_id = self._next_id % 65535 + 1
        return self._next_id

    async def subscribe(self, topic_filter: str, qos: int = 1, timeout_s: float = 10.0) -> None:
        assert self._writer is not None
        packet_id = self._packet_id()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._subacks[packet_id] = done
        self._writer.write(subscribe_packet(packet_id, topic_filter, qos))
        async with asyncio.timeout(timeout_s):
            await done

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        """Queue a PUBLISH on the connection (call ``drain`` to wait for the socket)."""
        assert self._writer is not None
        packet_id = self._packet_id() if qos else 0
        if qos:
            self.unacked += 1
        self._writer.write(publish_packet(topic, payload, qos, retain, packet_id))

    async def drain(self) -> None:
        assert self._writer is not None
        await self._writer.drain()

    async def _read_packet(self) -> tuple[int, bytes]:
        assert self._reader is not None
        first = await self._reader.readexactly(1)
        length, shift = 0, 0
        while True:
            byte = (await self._reader.readexactly(1))[0]
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        body = await self._reader.readexactly(length) if length else b""
        return first[0], body

    async def _receive(self) -> None:
        while True:
            try:
                header, body = await self._read_packet()
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            kind = header >> 4
            if kind == PUBLISH:
                await self._on_publish(header, body)
            elif kind == PUBACK:
                self.unacked -= 1
            elif kind == SUBACK:
                (packet_id,) = struct.unpack_from("!H", body)
                future = self._subacks.pop(packet_id, None)
                if future is not None and not future.done():
                    future.set_result(None)

    async def _on_publish(self, header: int, body: bytes) -> None:
        qos = (header >> 1) & 0x03
        (topic_length,) = struct.unpack_from("!H", body)
        topic = body[2 : 2 + topic_length].decode()
        at = 2 + topic_length
        if qos:
            (packet_id,) = struct.unpack_from("!H", body, at)
            at += 2
            assert self._writer is not None
            self._writer.write(puback_packet(packet_id))
        self.received += 1
        if self.on_message is not None:
            result = self.on_message(self, topic, body[at:])
            if result is not None:
                await result

    async def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._writer.write(bytes([DISCONNECT << 4, 0]))
                await self._writer.drain()
            self._writer.close()
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self._writer.wait_closed()
            self._writer = None
        if self._receiving is not None:
            self._receiving.cancel()
            await asyncio.gather(self._receiving, return_exceptions=True)
            self._receiving = None


async def connect_all(
    clients: list[SimClient], host: str, port: int, concurrency: int = 200
) -> None:
    """Connect ``clients`` with at most ``concurrency`` handshakes in flight (a burst of
    thousands would overflow the broker's listen backlog)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: SimClient) -> None:
        async with gate:
            await client.connect(host, port)

    await asyncio.gather(*(one(c) for c in clients))


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards ``wanted`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"mosquitto did not listen on 127.0.0.1:{port} within {timeout_s:g}s")


class Mosquitto:
    """A mosquitto broker on a free loopback port, in ``workdir``; a context manager.

    Its settings are those of the shipped ``systemd/mosquitto/hyperagent.conf`` that matter
    here (``max_queued_messages``; mosquitto's defaults otherwise) without TLS, passwords or
    persistence; ``extra`` adds configuration lines.
    """

    def __init__(self, workdir: Path, max_connections: int = 20_000, extra: str = "") -> None:
        binary = shutil.which("mosquitto") or next(
            (str(p) for p in (Path("/usr/sbin/mosquitto"),) if p.exists()), None
        )
        if binary is None:
            raise RuntimeError("mosquitto is not installed: apt-get install -y mosquitto")
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.max_connections = max_connections
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> None:
        conf = self.workdir / "mosquitto.conf"
        keep_user = "user root\n" if os.geteuid() == 0 else ""
        conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"{keep_user}max_queued_messages 100000\n{self.extra}"
        )
        limit = self.max_connections + 100
        self.process = subprocess.Popen(
            [self.binary, "-c", str(conf)],
            stdout=(self.workdir / "mosquitto.log").open("ab"),
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(raise_fd_limit, limit),
        )
        _wait_for_port(self.port, 10.0)

    def cpu_seconds(self) -> float:
        """User plus system CPU time the broker used so far (from /proc)."""
        assert self.process is not None
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None

    def __enter__(self) -> Mosquitto:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` in seconds, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks
