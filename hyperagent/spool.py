"""A bounded, ordered queue of outgoing messages that survives broker outages and restarts.

Each message is one file (a JSON header line, then the payload bytes), written atomically and
fsynced on the process's writer thread (:mod:`hyperagent.durable`), so ``append`` never waits
for the disk; the message's ``stored`` future is done once its file (and every durable write
submitted before it) is on disk, and only then may it leave. It is deleted once the broker took
it. At start-up the files left by an earlier run are queued again, oldest first. Over the
bound the oldest is dropped and counted. Without a directory the queue lives in memory only,
its messages still waiting for the durable writes submitted before them.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from hyperagent import durable

log = logging.getLogger(__name__)

SUFFIX = ".msg"


@dataclass(frozen=True, slots=True)
class Spooled:
    seq: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    stored: Future[None] | None = field(default=None, compare=False, repr=False)
    """Done once the message may leave (its file is on disk); None: it already was."""


class Spool:
    """Messages waiting for the broker, in order."""

    def __init__(self, directory: Path | None, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self.pending: deque[Spooled] = deque()
        self.dropped = 0
        self._next = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            durable.wait()  # what this process still has to write there comes first
            self._load(directory)

    def _load(self, directory: Path) -> None:
        for path in sorted(directory.glob(f"*{SUFFIX}")):
            try:
                header, _, payload = path.read_bytes().partition(b"\n")
                meta = orjson.loads(header)
                item = Spooled(
                    int(path.stem),
                    str(meta["topic"]),
                    payload,
                    int(meta["qos"]),
                    bool(meta["retain"]),
                )
            except (OSError, ValueError, KeyError, orjson.JSONDecodeError) as e:
                log.error("dropping unreadable spooled message %s: %s", path, e)
                self.dropped += 1
                path.unlink(missing_ok=True)
                continue
            self.pending.append(item)
            self._next = max(self._next, item.seq + 1)
        if self.pending:
            log.info("%d message(s) spooled by an earlier run will be sent", len(self.pending))

    def __len__(self) -> int:
        return len(self.pending)

    def _path(self, seq: int) -> Path:
        assert self.directory is not None
        return self.directory / f"{seq:020d}{SUFFIX}"

    def append(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Queue a message; its file is written on the writer thread (see ``Spooled.stored``)."""
        seq = self._next
        self._next += 1
        if self.directory is not None:
            header = orjson.dumps({"topic": topic, "qos": qos, "retain": retain})
            stored = durable.submit(
                functools.partial(_store, self._path(seq), header + b"\n" + payload)
            )
        else:
            stored = durable.barrier()
        item = Spooled(seq, topic, payload, qos, retain, stored)
        self.pending.append(item)
        while len(self.pending) > self.limit:
            self._forget(self.pending.popleft())
            self.dropped += 1

    def first(self) -> Spooled | None:
        return self.pending[0] if self.pending else None

    def sent(self, item: Spooled) -> None:
        """The broker took ``item`` (the first one): forget it."""
        if self.pending and self.pending[0] is item:
            self.pending.popleft()
        self._forget(item)

    def _forget(self, item: Spooled) -> None:
        if self.directory is not None:
            durable.submit(functools.partial(_remove, self._path(item.seq)))


def _store(path: Path, data: bytes) -> None:
    try:
        durable.write_file(path, data)
    except OSError as e:
        log.error("cannot spool a message to %s (kept in memory only): %s", path, e)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.error("cannot remove the spooled message %s: %s", path, e)
