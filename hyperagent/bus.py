"""MQTT: topics, payload codec and signatures, and a connection loop with a bounded outbox.

Sampling never waits for the broker: ``publish`` only enqueues. Telemetry (QoS 0) beyond the
bound is dropped oldest-first and counted; reports, acks and settings (QoS 1) go through a
spool (on disk when given a directory, written off the event loop) and leave it only once
the broker took them, in order, each after the durable writes submitted before it.
A gated link holds them back until ``open_gate``: an agent opens it when the coordinator says
it is online, so nothing it sends while the coordinator is away falls on the floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import ssl
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomqtt
import orjson
from paho.mqtt.client import MQTT_ERR_SUCCESS

from hyperagent import ticks
from hyperagent.config import Config
from hyperagent.errors import ConfigError, ConfigProblem, PayloadError
from hyperagent.readings import Kind, Reading
from hyperagent.signing import SigningKey, TrustedKeys, verify_signature
from hyperagent.spool import Spool

log = logging.getLogger(__name__)

SCHEMA = 1


class Topics:
    """The topic tree of one cluster: ``hyperagent/v1/<cluster>/...``."""

    def __init__(self, cluster: str) -> None:
        self.root = f"hyperagent/v1/{cluster}"

    def telemetry(self, node: str) -> str:
        return f"{self.root}/node/{node}/telemetry"

    def status(self, node: str) -> str:
        return f"{self.root}/node/{node}/status"

    def report(self, job: str, node: str) -> str:
        """A node's measurements of a job's trials (the broker lets only ``node`` write it)."""
        return f"{self.root}/job/{job}/report/{node}"

    def settings(self, job: str) -> str:
        return f"{self.root}/job/{job}/settings"

    def ack(self, job: str, node: str) -> str:
        """A node's acks of a job's settings (the broker lets only ``node`` write it)."""
        return f"{self.root}/job/{job}/ack/{node}"

    def receipt(self, job: str, node: str) -> str:
        """The coordinator's receipts of ``node``'s reports of a job: a node resends a report
        until its receipt comes (only the coordinator writes it, only ``node`` reads it)."""
        return f"{self.root}/job/{job}/receipt/{node}"

    def coordinator_status(self) -> str:
        """Retained "online"; the coordinator's last will says "offline"."""
        return f"{self.root}/coordinator/status"

    def name_in(self, topic: str) -> str:
        """The node or job name a topic of this tree is about."""
        parts = topic.split("/")
        if len(parts) not in (6, 7) or "/".join(parts[:3]) != self.root:
            raise PayloadError(f"topic {topic!r} is not under {self.root}")
        return parts[4]

    def sender_in(self, topic: str) -> str:
        """The node that wrote a per-node job topic (report or ack)."""
        parts = topic.split("/")
        if len(parts) != 7 or "/".join(parts[:3]) != self.root:
            raise PayloadError(f"topic {topic!r} is not a per-node topic under {self.root}")
        return parts[6]


_Types = type | tuple[type, ...]
_NUMBER: tuple[type, ...] = (int, float)
_OPTIONAL_NUMBER: tuple[type, ...] = (int, float, type(None))

SCHEMAS: dict[str, dict[str, _Types]] = {
    "telemetry": {"node": str, "ts": _NUMBER, "indicators": dict, "sources_up": dict},
    "status": {"node": str, "state": str, "ts": _NUMBER},
    "settings": {
        "job": str,
        "version": int,
        "settings": dict,
        "backend": dict,
        "issued_at": _NUMBER,
    },
    "ack": {"job": str, "node": str, "version": int, "ok": bool},
    "receipt": {"job": str, "node": str, "version": int},
    "report": {
        "job": str,
        "node": str,
        "version": int,
        "samples": int,
        "seconds": _NUMBER,
        "throughput": _NUMBER,
        "windows": list,
        "energy_j": _OPTIONAL_NUMBER,
        "nonfinite_loss": bool,
    },
}


def encode(message: Mapping[str, Any]) -> bytes:
    """JSON bytes with the schema version; non-finite floats are not allowed on the wire."""
    return orjson.dumps({"schema": SCHEMA, **message})


def decode(payload: bytes | bytearray, kind: str) -> dict[str, Any]:
    """Parse and validate a payload of ``kind`` (a SCHEMAS key); raises PayloadError."""
    try:
        message = orjson.loads(payload)
    except orjson.JSONDecodeError as e:
        raise PayloadError(f"{kind}: not JSON: {e}") from None
    if not isinstance(message, dict):
        raise PayloadError(f"{kind}: not a JSON object")
    if message.get("schema") != SCHEMA:
        raise PayloadError(f"{kind}: unsupported schema {message.get('schema')!r}")
    for key, types in SCHEMAS[kind].items():
        value = message.get(key)
        if not isinstance(value, types) or (
            isinstance(value, bool) and bool not in _as_tuple(types)
        ):
            raise PayloadError(f"{kind}: {key} missing or of the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise PayloadError(f"{kind}: {key} is not finite")
    return message


def _as_tuple(types: _Types) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


SIGNATURE = "signature"
"""The field holding a settings message's Ed25519 signature (hex); ``key_id`` names its key."""


def _canonical(message: Mapping[str, Any]) -> bytes:
    return orjson.dumps(
        {k: v for k, v in message.items() if k != SIGNATURE}, option=orjson.OPT_SORT_KEYS
    )


def sign(message: Mapping[str, Any], key: SigningKey) -> dict[str, Any]:
    """A copy of ``message`` naming ``key``'s id and carrying its Ed25519 signature over the
    canonical JSON of everything else (schema and key id included)."""
    body = {"schema": SCHEMA, **message, "key_id": key.key_id}
    body.pop(SIGNATURE, None)
    return {**body, SIGNATURE: key.sign(_canonical(body)).hex()}


def signature_problem(message: Mapping[str, Any], keys: TrustedKeys) -> tuple[str, str] | None:
    """Why ``message`` is not signed by a key of ``keys``, as (reason, detail): ``unsigned``
    (no signature or key id, or not one of the right form), ``unknown_key`` (a key not
    trusted here) or ``bad_signature``; None when the signature holds."""
    kid, tag = message.get("key_id"), message.get(SIGNATURE)
    if not isinstance(kid, str) or not isinstance(tag, str):
        if "hmac" in message:
            return "unsigned", "an HMAC, no Ed25519 signature (a coordinator of an older version?)"
        return "unsigned", "no key_id and signature"
    try:
        signature = bytes.fromhex(tag)
    except ValueError:
        return "unsigned", "the signature is not hex"
    if len(signature) != 64:
        return "unsigned", f"a signature of {len(signature)} bytes, not 64"
    public = keys.get(kid)
    if public is None:
        return "unknown_key", f"signed by key {kid[:32]!r}, not trusted here ({keys.describe()})"
    if not verify_signature(public, signature, _canonical(message)):
        return "bad_signature", f"the signature does not match key {kid}"
    return None


def verify(message: Mapping[str, Any], keys: TrustedKeys) -> bool:
    """True when ``message`` carries a valid signature by a key of ``keys``."""
    return signature_problem(message, keys) is None


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches an MQTT topic filter (``+`` one level, ``#`` the rest, and
    ``$share/<group>/`` ignored), as aiomqtt's ``Topic.matches`` decides."""
    levels = topic_filter.split("/")
    if levels[0] == "$share":
        levels = levels[2:]
    parts = topic.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            return True
        if i >= len(parts) or (level != "+" and level != parts[i]):
            return False
    return len(levels) == len(parts)


ROUTES_CACHED = 100_000
"""Topics whose matching handlers are remembered; past this the memory starts over."""

RECEIVE_BATCH = 1000
"""Queued incoming messages handled in a row before the event loop gets a turn."""

READ_CHUNKS = 4
"""Socket reads (of up to 64 KiB) parsed per turn of the event loop."""

INBOX_HIGH = 10_000
"""Received messages waiting for their handlers past which the socket is not read."""

FOLLOW_BATCH = 100
"""Followed topics subscribed to (or unsubscribed from) per packet."""

STABLE_SESSION_S = 2.0
"""A link with several brokers whose connection drops connects to the next at once, unless it
did so less than this long ago (then it waits, as with one broker: brokers that accept and
drop every connection are not tried in a tight loop)."""

HANDLER_ERRORS_LOGGED = 100
"""Distinct handler errors logged at most per link; past this they are only counted."""


async def _await_mqtt(call: Awaitable[Any]) -> Any:
    """Await an aiomqtt call; re-raise a cancellation it swallowed.

    aiomqtt waits with ``asyncio.wait_for``, which on Python 3.11 can swallow a cancellation
    that races with completion, leaving a stopping daemon waiting forever.
    """
    result = await call
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return result


def _housekeep_on_ticks(client: aiomqtt.Client) -> None:
    """Run paho's once-a-second housekeeping (keepalive pings, timeouts) on whole seconds of
    the event loop's clock (:mod:`hyperagent.ticks`) instead of a second after the connection
    opened, so that it shares a wake-up with other timers on that grid (the agent's
    collection). aiomqtt's own task is replaced where its private attributes are as pinned
    (below 3); it still cancels this one when the socket closes."""
    paho: Any = getattr(client, "_client", None)
    task = getattr(client, "_misc_task", None)
    if not isinstance(task, asyncio.Task) or task.done() or not hasattr(paho, "loop_misc"):
        return

    async def housekeep() -> None:
        while paho.loop_misc() == MQTT_ERR_SUCCESS:
            await ticks.sleep_to_tick(1.0)

    task.cancel()
    client._misc_task = asyncio.create_task(housekeep(), name="mqtt-misc")


def _retrieve_disconnection(client: aiomqtt.Client) -> None:
    """Mark the error that ended ``client``'s connection as seen: aiomqtt sets it on a future
    that nobody awaits when the connection breaks while subscribing or publishing, and asyncio
    would log "Future exception was never retrieved"."""
    disconnected = getattr(client, "_disconnected", None)
    if isinstance(disconnected, asyncio.Future) and disconnected.done():
        if not disconnected.cancelled():
            disconnected.exception()


async def _unless_disconnected(
    client: aiomqtt.Client, call: Coroutine[Any, Any, None], name: str
) -> None:
    """Await ``call``; a connection that breaks meanwhile ends it at once with MqttError (aiomqtt
    would wait for the reply until its time-out)."""
    task = asyncio.create_task(call, name=name)
    disconnected = getattr(client, "_disconnected", None)
    if not isinstance(disconnected, asyncio.Future):
        await task
        return
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is None:
        return
    if disconnected.done():
        error = None if disconnected.cancelled() else disconnected.exception()
        raise aiomqtt.MqttError("Disconnected while subscribing") from error
    task.result()


class _BufferedSocket:
    """The socket paho reads through: paho asks for a packet's fixed header a byte at a time,
    then for its body, each with a ``recv`` system call; here ``fill`` takes what the socket
    holds (up to ``size`` bytes) with one, and paho's ``recv`` is served from that. With
    nothing buffered paho's ``recv`` would block (BlockingIOError, as on a non-blocking socket
    without data); the end of the stream and errors reach paho as the socket gave them.
    Everything else is the wrapped socket's."""

    def __init__(self, sock: Any, size: int = 1 << 16) -> None:
        self._sock = sock
        self._size = size
        self._data = b""
        self._pos = 0
        self._eof = False
        self._error: BaseException | None = None

    def fill(self) -> bool:
        """Read what the socket holds into the (drained) buffer; False when it held nothing."""
        try:
            data = self._sock.recv(self._size)
        except (BlockingIOError, ssl.SSLWantReadError):
            return False
        except OSError as e:  # paho's recv raises it, and paho handles it
            self._error = e
            return True
        if not data:
            self._eof = True
            return True
        self._data, self._pos = data, 0
        return True

    @property
    def unread(self) -> bool:
        """Whether paho has something to read: data, the end of the stream or an error."""
        return self._pos < len(self._data) or self._eof or self._error is not None

    def recv(self, bufsize: int) -> bytes:
        pos = self._pos
        data = self._data
        if pos >= len(data):
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._eof:
                return b""
            raise BlockingIOError
        end = pos + bufsize
        self._pos = end
        return data[pos:end]

    def pending(self) -> int:
        """Bytes the wrapped (TLS) socket decrypted already; none are left in the buffer when
        anyone but paho asks."""
        inner = getattr(self._sock, "pending", None)
        return int(inner()) if inner is not None else 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@dataclass(frozen=True, slots=True)
class Outgoing:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False


Handler = Callable[[str, bytes], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Broker:
    """One address a link may connect to; ``url`` names it in logs and on /metrics."""

    host: str
    port: int
    tls: aiomqtt.TLSParameters | None = None
    url: str = ""

    @property
    def name(self) -> str:
        return self.url or f"mqtt{'s' if self.tls else ''}://{self.host}:{self.port}"


class _Routing:
    """Which handlers an incoming message goes to: the subscriptions made before ``run``, the
    exact topics followed at any time, and the errors the handlers raise."""

    def _init_routing(self) -> None:
        self._handlers: list[tuple[str, int, Handler]] = []
        self._routes: dict[str, tuple[tuple[str, Handler], ...]] = {}
        self._followed: dict[str, tuple[int, Handler]] = {}
        """Exact topic -> (QoS, handler), as ``follow`` asked."""
        self._follow_wake = asyncio.Event()
        self.handler_errors_by_filter: Counter[str] = Counter()
        """Subscription filter -> exceptions its handlers raised."""
        self._errors_logged: set[tuple[str, str, str]] = set()

    def subscribe(self, topic_filter: str, qos: int, handler: Handler) -> None:
        self._handlers.append((topic_filter, qos, handler))
        self._routes.clear()

    def follow(self, topic: str, qos: int, handler: Handler) -> None:
        """Subscribe to the exact ``topic`` (no wildcards), now when connected and in every
        later session, so that its retained message arrives on any broker. Following a topic
        again changes nothing (its first QoS and handler stay)."""
        if "+" in topic or "#" in topic:
            raise ValueError(f"follow takes an exact topic, not the filter {topic!r}")
        if topic in self._followed:
            return
        self._followed[topic] = (qos, handler)
        self._routes.pop(topic, None)
        self._follow_wake.set()

    def unfollow(self, topic: str) -> None:
        """Stop following ``topic`` (unsubscribed when connected); not following it is fine."""
        if self._followed.pop(topic, None) is not None:
            self._routes.pop(topic, None)
            self._follow_wake.set()

    @property
    def followed(self) -> frozenset[str]:
        """The exact topics followed."""
        return frozenset(self._followed)

    def handlers_for(self, topic: str) -> tuple[Handler, ...]:
        """The handlers whose filters match ``topic``, in subscription order."""
        return tuple(handler for _, handler in self._routes_for(topic))

    def _routes_for(self, topic: str) -> tuple[tuple[str, Handler], ...]:
        """(filter, handler) of each subscription matching ``topic``, in subscription order
        (remembered per topic: a daemon sees the same topics over and over)."""
        found = self._routes.get(topic)
        if found is None:
            if len(self._routes) >= ROUTES_CACHED:
                self._routes.clear()
            routes = [(f, h) for f, _, h in self._handlers if topic_matches(f, topic)]
            if topic in self._followed:
                routes.append((topic, self._followed[topic][1]))
            # one call per handler: a followed topic's handler often serves a wildcard too
            found = tuple(
                (f, h) for i, (f, h) in enumerate(routes) if all(h != g for _, g in routes[:i])
            )
            self._routes[topic] = found
        return found

    @property
    def handler_errors(self) -> int:
        """Exceptions raised by this link's handlers, all filters together."""
        return sum(self.handler_errors_by_filter.values())

    def handler_error_readings(self) -> list[Reading]:
        """``hyperagent_mqtt_handler_errors_total{handler}`` per subscription filter (from 0)."""
        return [
            Reading(
                "hyperagent_mqtt_handler_errors_total",
                self.handler_errors_by_filter[topic_filter],
                {"handler": topic_filter},
                Kind.COUNTER,
            )
            for topic_filter in dict.fromkeys(
                [*(f for f, _, _ in self._handlers), *self.handler_errors_by_filter]
            )
        ]

    async def _dispatch(self, topic: str, payload: Any) -> None:
        if type(payload) is not bytes:
            payload = (
                bytes(payload) if isinstance(payload, bytearray) else str(payload or "").encode()
            )
        for topic_filter, handler in self._routes_for(topic):
            try:
                await handler(topic, payload)
            except Exception as e:
                self._handler_failed(topic_filter, topic, e)

    def _handler_failed(self, topic_filter: str, topic: str, error: Exception) -> None:
        """Count the error; log it if it is new (a traceback for the handler's first)."""
        self.handler_errors_by_filter[topic_filter] += 1
        key = (topic_filter, type(error).__qualname__, str(error))
        if key in self._errors_logged or len(self._errors_logged) > HANDLER_ERRORS_LOGGED:
            return
        if len(self._errors_logged) == HANDLER_ERRORS_LOGGED:
            self._errors_logged.add(key)
            log.error(
                "%d distinct handler errors logged; further ones are only counted "
                "(hyperagent_mqtt_handler_errors_total)",
                HANDLER_ERRORS_LOGGED,
            )
            return
        first = all(logged[0] != topic_filter for logged in self._errors_logged)
        self._errors_logged.add(key)
        log.error(
            "handler for %s failed on %s: %s: %s (each distinct error is logged once; "
            'hyperagent_mqtt_handler_errors_total{handler="%s"} counts them all)',
            topic_filter,
            topic,
            type(error).__name__,
            error,
            topic_filter,
            exc_info=error if first else None,
        )


class _Outbox:
    """What the link sends: telemetry (QoS 0) in a bounded queue that drops its oldest, the
    rest through the spool, held back on a gated link until ``open_gate``."""

    def _init_outbox(
        self, outbox_size: int, reliable_size: int, spool_dir: Path | None, gated: bool
    ) -> None:
        self._telemetry: deque[Outgoing] = deque(maxlen=outbox_size)
        self.spool = Spool(spool_dir, reliable_size)
        self.gated = gated
        self._gate_open = not gated
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        if not self.spool:
            self._idle.set()
        self.dropped = 0

    def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        """Enqueue a message; never blocks. A full queue drops its oldest message (counted)."""
        if qos > 0:
            self.spool.append(topic, payload, qos, retain)
        else:
            if len(self._telemetry) == self._telemetry.maxlen:
                self.dropped += 1
            self._telemetry.append(Outgoing(topic, payload, qos, retain))
        self._idle.clear()
        self._wake.set()

    def open_gate(self, is_open: bool) -> None:
        """Let spooled messages go out (or hold them) on a gated link."""
        self._gate_open = is_open or not self.gated
        self._wake.set()

    @property
    def gate_open(self) -> bool:
        """Whether spooled messages may go out (always, on a link that is not gated)."""
        return self._gate_open

    @property
    def queued(self) -> int:
        return len(self._telemetry) + len(self.spool)

    @property
    def dropped_total(self) -> int:
        """Messages dropped for want of room: telemetry and spooled."""
        return self.dropped + self.spool.dropped

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued was handed to the broker; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def _send_loop(self, client: aiomqtt.Client) -> None:
        loop = asyncio.get_running_loop()
        awaited: Future[None] | None = None

        def wake(_: Future[None]) -> None:  # on the writer thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake.set)

        while True:
            spooled = self.spool.first() if self._gate_open else None
            if spooled is not None and spooled.stored is not None and not spooled.stored.done():
                # its file is still being written: telemetry may go meanwhile, it wakes us
                if awaited is not spooled.stored:
                    awaited = spooled.stored
                    awaited.add_done_callback(wake)
                spooled = None
            if spooled is None and not self._telemetry:
                if not self.spool:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            if spooled is not None:
                await _await_mqtt(
                    client.publish(
                        spooled.topic, spooled.payload, spooled.qos, spooled.retain, timeout=10
                    )
                )
                self.spool.sent(spooled)  # only now: a broken connection keeps it queued
                continue
            message = self._telemetry.popleft()
            await _await_mqtt(
                client.publish(
                    message.topic, message.payload, message.qos, message.retain, timeout=10
                )
            )


class _Receiving(_Routing):
    """How the link reads incoming messages off the socket and hands them to their handlers."""

    def _init_receiving(self) -> None:
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._legacy_receive = True
        self._resume_reading: Callable[[], None] | None = None

    def _take_over_receiving(self, client: aiomqtt.Client) -> None:
        """Receive through this link instead of aiomqtt's message machinery.

        aiomqtt reads one packet per turn of the event loop, with about four ``recv`` calls,
        and makes a ``Message`` (with a validated ``Topic``) and a queue entry of every
        incoming message; a coordinator ingesting thousands of telemetry messages a second
        spends most of its time there. Instead, this link's reader takes up to
        ``READ_CHUNKS`` socket reads per turn (``_BufferedSocket``) and lets paho parse all
        of it; paho's ``on_message`` puts (topic, payload) in the inbox, which the receive
        loop hands to the handlers. While the inbox holds ``INBOX_HIGH`` messages the socket
        is not read (the broker's queue, not this process's memory, takes the excess). Called
        right after connecting, before subscribing: what came in before is in aiomqtt's queue
        and is handled first. Without the private attributes this relies on (aiomqtt is pinned
        below 3) aiomqtt's own iterator is used.
        """
        self._inbox.clear()
        self._legacy_receive = True
        self._resume_reading = None
        paho: Any = getattr(client, "_client", None)
        queue = getattr(client, "_queue", None)
        disconnected = getattr(client, "_disconnected", None)
        sock = getattr(paho, "_sock", None)
        if (
            sock is None
            or not isinstance(queue, asyncio.Queue)
            or not isinstance(disconnected, asyncio.Future)
        ):
            return
        buffered = _BufferedSocket(sock)
        fd = sock.fileno()
        loop = asyncio.get_running_loop()
        inbox = self._inbox

        def wake() -> None:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        def on_message(_client: Any, _userdata: Any, message: Any) -> None:
            try:
                topic = message.topic
            except UnicodeDecodeError:
                log.warning("dropped a message whose topic is not UTF-8: %r", message._topic)
                return
            inbox.append((topic, message.payload))
            wake()

        def on_readable() -> None:
            if len(inbox) >= INBOX_HIGH:
                loop.remove_reader(fd)
                self._resume_reading = resume
                return
            try:
                for _ in range(READ_CHUNKS):
                    if paho._sock is not buffered or not buffered.fill():
                        break
                    while paho._sock is buffered and buffered.unread:
                        paho.loop_read()
                if paho._sock is buffered and buffered.pending():
                    loop.call_soon(on_readable)  # decrypted already: no wake-up will say so
            except Exception as exc:  # as aiomqtt's reader: a broken connection
                if not disconnected.done():
                    disconnected.set_exception(exc)

        def resume() -> None:
            self._resume_reading = None
            if paho._sock is buffered:
                loop.add_reader(fd, on_readable)

        paho._sock = buffered
        paho.on_message = on_message
        loop.add_reader(fd, on_readable)  # in place of aiomqtt's; removed when it closes
        disconnected.add_done_callback(lambda _: wake())
        self._legacy_receive = False

    async def _receive_loop(self, client: aiomqtt.Client) -> None:
        if self._legacy_receive:
            await self._receive_messages(client)
            return
        queue: asyncio.Queue[aiomqtt.Message] = client._queue
        while not queue.empty():  # what came before this link took over
            await self._dispatch_message(queue.get_nowait())
        disconnected: asyncio.Future[Any] = client._disconnected
        inbox = self._inbox
        loop = asyncio.get_running_loop()
        while True:
            if not inbox:
                if disconnected.done():
                    raise aiomqtt.MqttError(
                        "Disconnected during message iteration"
                    ) from disconnected.exception()
                self._waiter = loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            for _ in range(RECEIVE_BATCH):
                if not inbox:
                    break
                topic, payload = inbox.popleft()
                await self._dispatch(topic, payload)
            if self._resume_reading is not None and len(inbox) < INBOX_HIGH:
                self._resume_reading()
            await asyncio.sleep(0)  # the event loop gets a turn between batches

    async def _receive_messages(self, client: aiomqtt.Client) -> None:
        # aiomqtt's iterator makes a task and an asyncio.wait per message; what its queue
        # already holds is taken without them, a bounded batch at a time.
        queue = getattr(client, "_queue", None)
        inbox = queue if isinstance(queue, asyncio.Queue) else None
        async for message in client.messages:
            await self._dispatch_message(message)
            for _ in range(RECEIVE_BATCH):
                if inbox is None or inbox.empty():
                    break
                await self._dispatch_message(inbox.get_nowait())

    async def _dispatch_message(self, message: aiomqtt.Message) -> None:
        await self._dispatch(message.topic.value, message.payload)


class MqttLink(_Receiving, _Outbox):
    """One MQTT connection kept up with jittered exponential backoff.

    Given several ``brokers`` (addresses of one clustered broker) it connects to them in turn:
    when a connection drops it connects to the next one at once; when connecting fails it
    tries the next, and waits (the backoff) only after each of them failed in a row.
    Subscribe handlers before ``run``; they are re-subscribed on every reconnect. ``follow``
    subscribes to one exact topic at any time (also kept across reconnects): some brokers
    (RabbitMQ) serve a retained message only to a subscriber of its exact topic, never through
    a wildcard. A message is handed to each matching handler once, though several of its
    subscriptions match; a broker may still deliver it once per matching subscription
    (mosquitto does), so handlers of followed topics must take a repeat calmly. A handler's
    exception is never fatal: it is counted per subscription filter and logged once per
    distinct error (handler, exception type and message), with its traceback the first time
    that handler fails.
    """

    def __init__(
        self,
        host: str,
        port: int,
        client_id: str,
        *,
        will: Outgoing | None = None,
        on_connect: Callable[[], list[Outgoing]] | None = None,
        outbox_size: int = 1000,
        reliable_size: int = 10_000,
        spool_dir: Path | None = None,
        gated: bool = False,
        persistent_session: bool = False,
        username: str | None = None,
        password: str | None = None,
        tls: aiomqtt.TLSParameters | None = None,
        keepalive_s: int = 30,
        backoff_min_s: float = 0.5,
        backoff_max_s: float = 30.0,
        brokers: Sequence[Broker] = (),
    ) -> None:
        self.brokers = tuple(brokers) or (Broker(host, port, tls),)
        self._broker_index = 0
        self.client_id = client_id
        self.will = will
        self.on_connect = on_connect
        self.persistent_session = persistent_session
        self.username, self.password = username, password
        self.keepalive_s = keepalive_s
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self._init_outbox(outbox_size, reliable_size, spool_dir, gated)
        self._init_routing()
        self._init_receiving()
        self._subscribed: set[str] = set()
        """The followed topics subscribed to in this session."""
        self.connected = asyncio.Event()
        self.connects = 0
        self._client: aiomqtt.Client | None = None
        self._was_up = False

    @property
    def broker(self) -> Broker:
        """The broker connected to (or tried next)."""
        return self.brokers[self._broker_index]

    @property
    def host(self) -> str:
        return self.broker.host

    @property
    def port(self) -> int:
        return self.broker.port

    def broker_readings(self) -> list[Reading]:
        """``hyperagent_mqtt_connected``, ``hyperagent_mqtt_gate_open`` on a gated link, and
        ``hyperagent_mqtt_broker_info{url}`` while connected: which of the brokers it is."""
        out = [Reading("hyperagent_mqtt_connected", float(self.connected.is_set()))]
        if self.gated:
            out.append(Reading("hyperagent_mqtt_gate_open", float(self.gate_open)))
        if self.connected.is_set():
            out.append(
                Reading("hyperagent_mqtt_broker_info", 1.0, {"url": self.broker.name}, Kind.INFO)
            )
        return out

    async def run(self) -> None:
        """Connect, serve, and reconnect forever (cancel to stop)."""
        delay = self.backoff_min_s
        failed_in_a_row = 0
        switched_at = -math.inf
        while True:
            self._was_up = False
            broker = self.broker
            try:
                await self._session(broker)
            except aiomqtt.MqttError as e:
                log.warning("mqtt %s: %s", broker.name, e)
            self.connected.clear()
            self._client = None
            several = len(self.brokers) > 1
            self._broker_index = (self._broker_index + 1) % len(self.brokers)
            if self._was_up:
                delay = self.backoff_min_s
                failed_in_a_row = 0
                now = time.monotonic()
                if several and now - switched_at >= STABLE_SESSION_S:
                    switched_at = now
                    continue  # to the next broker at once
            else:
                failed_in_a_row += 1
                if several and failed_in_a_row % len(self.brokers):
                    continue  # the next one, until each of them failed
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, self.backoff_max_s)

    async def _session(self, broker: Broker) -> None:
        will = None
        if self.will is not None:
            will = aiomqtt.Will(self.will.topic, self.will.payload, self.will.qos, self.will.retain)
        async with aiomqtt.Client(
            broker.host,
            broker.port,
            identifier=self.client_id,
            will=will,
            clean_session=not self.persistent_session,
            keepalive=self.keepalive_s,
            username=self.username,
            password=self.password,
            tls_params=broker.tls,
            timeout=10,
            # small QoS 1 packets (acks, PUBACKs) must not wait for the peer's delayed ACK
            socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
        ) as client:
            try:
                await self._serve(client, broker)
            finally:
                _retrieve_disconnection(client)

    async def _serve(self, client: aiomqtt.Client, broker: Broker) -> None:
        """One session on a connected client: subscribe, say online, send and receive."""
        self._client = client
        self._take_over_receiving(client)
        _housekeep_on_ticks(client)
        self.connects += 1
        self.open_gate(False)  # a gated link learns again, in every session, who listens
        log.info("mqtt connected to %s as %s", broker.name, self.client_id)
        await _unless_disconnected(client, self._set_up(client), "mqtt-set-up")
        self._was_up = True  # not before: a broker that drops each new session gets the backoff
        self.connected.set()
        # Not a TaskGroup: on Python 3.11 a failing child leaves the parent task marked as
        # cancelling, which would read as a pending cancellation in the next session.
        loops = {
            asyncio.create_task(self._send_loop(client), name="mqtt-send"),
            asyncio.create_task(self._receive_loop(client), name="mqtt-receive"),
            asyncio.create_task(self._follow_loop(client), name="mqtt-follow"),
        }
        try:
            done, _ = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
        for task in done:
            task.result()  # the MqttError that ended the session

    async def _set_up(self, client: aiomqtt.Client) -> None:
        for topic_filter, qos, _ in self._handlers:
            await _await_mqtt(client.subscribe(topic_filter, qos, timeout=10))
        self._subscribed = set()
        await self._follow_now(client)
        # only now: an "online" status implies this client's subscriptions are in place
        for outgoing in self.on_connect() if self.on_connect else []:
            await _await_mqtt(
                client.publish(
                    outgoing.topic, outgoing.payload, outgoing.qos, outgoing.retain, timeout=10
                )
            )

    async def _follow_now(self, client: aiomqtt.Client) -> None:
        """Unsubscribe from the topics no longer followed, then subscribe to the followed
        topics not subscribed in this session, ``FOLLOW_BATCH`` topics per packet."""
        self._follow_wake.clear()
        gone = [t for t in self._subscribed if t not in self._followed]
        for i in range(0, len(gone), FOLLOW_BATCH):
            batch_gone = gone[i : i + FOLLOW_BATCH]
            await _await_mqtt(client.unsubscribe(batch_gone, timeout=10))
            self._subscribed.difference_update(batch_gone)
        wanted = [(t, q) for t, (q, _) in self._followed.items() if t not in self._subscribed]
        for i in range(0, len(wanted), FOLLOW_BATCH):
            batch = wanted[i : i + FOLLOW_BATCH]
            await _await_mqtt(client.subscribe(batch, timeout=10))
            self._subscribed.update(t for t, _ in batch)

    async def _follow_loop(self, client: aiomqtt.Client) -> None:
        while True:
            await self._follow_wake.wait()
            await self._follow_now(client)

    async def disconnect(self, final: Sequence[Outgoing] = ()) -> None:
        """Publish ``final`` (e.g. an offline status) if connected; the caller then cancels run."""
        client = self._client
        if client is None:
            return
        for outgoing in final:
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                await client.publish(
                    outgoing.topic, outgoing.payload, outgoing.qos, outgoing.retain, timeout=2
                )


def status_message(topics: Topics, node: str, state: str, topic: str | None = None) -> Outgoing:
    """A retained status payload for ``node`` (on its own status topic unless ``topic``)."""
    payload = encode({"node": node, "state": state, "ts": time.time()})
    return Outgoing(topic or topics.status(node), payload, qos=1, retain=True)


def link_from_config(
    config: Config,
    client_id: str,
    status_node: str | None = None,
    persistent_session: bool = False,
    status_topic: str | None = None,
    spool_dir: Path | None = None,
    gated: bool = False,
    username: str | None = None,
) -> MqttLink:
    """An MqttLink as ``config.mqtt`` says; with ``status_node``, an online status and last
    will on its status topic (or on ``status_topic``). ``username`` is the broker user when
    ``mqtt.username`` is not set (the node name on an agent, "coordinator" on the
    coordinator), used only with a ``mqtt.password_file``."""
    m = config.mqtt
    topics = Topics(config.cluster)
    password = None
    if m.password_file is not None:
        try:
            password = m.password_file.read_text().strip()
        except OSError as e:
            problem = ConfigProblem("mqtt.password_file", f"{m.password_file}: {e.strerror}")
            raise ConfigError([problem]) from e
    tls = None
    if any(b.tls for b in m.brokers):
        tls = aiomqtt.TLSParameters(
            ca_certs=str(m.tls_ca_file),
            certfile=str(m.tls_cert_file) if m.tls_cert_file else None,
            keyfile=str(m.tls_key_file) if m.tls_key_file else None,
        )
    brokers = [Broker(b.host, b.port, tls if b.tls else None, b.url) for b in m.brokers]
    will = None
    on_connect = None
    if status_node is not None:
        will = status_message(topics, status_node, "offline", status_topic)

        def on_connect() -> list[Outgoing]:
            return [status_message(topics, status_node, "online", status_topic)]

    return MqttLink(
        brokers[0].host,
        brokers[0].port,
        m.client_id or client_id,
        will=will,
        on_connect=on_connect,
        outbox_size=m.outbox_size,
        spool_dir=spool_dir,
        gated=gated,
        persistent_session=(
            persistent_session if m.persistent_session is None else m.persistent_session
        ),
        username=m.username or (username if password is not None else None),
        password=password,
        keepalive_s=m.keepalive_s,
        backoff_min_s=m.reconnect_min_s,
        backoff_max_s=m.reconnect_max_s,
        brokers=brokers,
    )
