"""The tuning journal: every published settings version and every finished trial, on disk.

Append-only JSON lines, one file per job, each entry flushed and fsynced on the process's writer
thread (:mod:`hyperagent.durable`), in the order appended, so the event loop never waits for
the disk; a message published after an entry leaves only once that entry is on disk, so a
coordinator killed at any point restarts from it without repeating or losing a trial.
Entries::

    {"type": "start", "fingerprint": ..., "space": {...}, "nodes": [...], "ts": ...}
    {"type": "published", "version": 7, "trial": 5, "settings": {...}, "ts": ...}
    {"type": "trial", "index": 5, "version": 7, "settings": {...}, "score": 812.4,
     "status": "ok", "reports": {...}, "seconds": 9.1, "ts": ...}
    {"type": "paused", "trial": 5, "version": 8, "reason": "refused", "nodes": [...], ...}
    {"type": "confirm", "from": 9, "order": [{...}, {...}, {...}, {...}]}
    {"type": "final", "version": 31, "settings": {...}, "score": 840.2, "baseline": 771.0}
    {"type": "ended", "reason": "every rank left"}       (or "failed": true)

A ``start`` begins a round (a new tuning, or a re-tune after drift): what came before it no
longer counts, but for the versions. A ``published`` entry with a trial index but no
``trial`` entry is a trial in flight. A ``paused`` entry says why a run of a trial could not
be measured (not a trial: the same trial runs again); it changes nothing on replay. A
``confirm`` entry says the search is over and which settings the confirmations measure, in
order, from trial index ``from``: a restart goes on confirming, never back to searching.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from hyperagent import durable
from hyperagent.errors import HyperagentError
from hyperagent.tuner.lifecycle import MEASURED

log = logging.getLogger(__name__)


class JournalError(HyperagentError):
    """A journal file that cannot be read or written; names the file and line."""


@dataclass
class JournalState:
    """What a journal says about one job."""

    fingerprint: str | None = None
    owner: int | None = None
    """The uid of the job's owner as the current round's ``start`` says (None: not said)."""
    version: int = 0
    """Highest settings version ever published."""
    trials: list[dict[str, Any]] = field(default_factory=list)
    in_flight: dict[str, Any] | None = None
    """The ``published`` entry of a trial that has no result yet."""
    final: dict[str, Any] | None = None
    rounds: int = 0
    """``start`` entries: rounds of tuning begun."""
    start: dict[str, Any] | None = None
    """The current round's ``start`` entry (its space, nodes and fingerprint)."""
    confirm: dict[str, Any] | None = None
    """The current round's ``confirm`` entry, once its confirmations began."""
    ended: dict[str, Any] | None = None
    """The last ``ended`` entry (the job ended or failed), unless a round began after it."""
    indices: set[int] = field(default_factory=set)
    """Trial indices recorded in the current round."""

    @property
    def measured(self) -> bool:
        """Whether a trial of this round measured its settings (a tuning without one has
        not ended, whatever its ``final`` says)."""
        return any(t.get("status") in MEASURED and not t.get("confirmation") for t in self.trials)


class Journal:
    """One job's journal file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed: JournalError | None = None

    def load(self) -> JournalState:
        """Replay the file (a missing file is an empty journal), once the entries appended so
        far are written. A torn last line, from a crash mid-write, is cut off; any other bad
        line is an error naming it, as is an earlier entry that could not be written."""
        durable.wait()
        self._raise_failed()
        state = JournalState()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return state
        except OSError as e:
            raise JournalError(f"{self.path}: {e.strerror}") from e
        lines = data.splitlines(keepends=True)
        offset = 0
        for number, line in enumerate(lines, start=1):
            try:
                if line.strip():
                    self._apply(state, orjson.loads(line))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                if number == len(lines) and not line.endswith(b"\n"):
                    self._truncate(offset)
                    break
                raise JournalError(f"{self.path}:{number}: {e}") from None
            offset += len(line)
        return state

    def _truncate(self, size: int) -> None:
        try:
            with self.path.open("r+b") as f:
                f.truncate(size)
        except OSError as e:
            raise JournalError(f"{self.path}: {e.strerror}") from e

    @staticmethod
    def _apply(state: JournalState, entry: Mapping[str, Any]) -> None:
        kind = entry["type"]
        if kind == "start":  # a new round of tuning: earlier trials no longer count
            state.fingerprint = entry.get("fingerprint")
            owner = entry.get("owner")
            state.owner = owner if isinstance(owner, int) else None
            state.final = None
            state.trials = []
            state.in_flight = None
            state.rounds += 1
            state.start = dict(entry)
            state.confirm = None
            state.ended = None
            state.indices = set()
        elif kind == "published":
            state.version = max(state.version, int(entry["version"]))
            state.in_flight = dict(entry) if entry.get("trial") is not None else None
        elif kind == "trial":
            index = int(entry["index"])
            if index in state.indices:
                raise ValueError(f"trial {index} recorded twice")
            if state.confirm is not None and not entry.get("confirmation"):
                raise ValueError(f"search trial {index} recorded after the confirmations began")
            state.indices.add(index)
            state.trials.append(dict(entry))
            if state.in_flight is not None and state.in_flight["trial"] == entry["index"]:
                state.in_flight = None
        elif kind == "paused":
            pass
        elif kind == "confirm":
            if not isinstance(entry["order"], list) or not isinstance(entry["from"], int):
                raise ValueError("a confirm entry needs an order list and a from index")
            state.confirm = dict(entry)
        elif kind == "final":
            state.final = dict(entry)
            state.in_flight = None
        elif kind == "ended":
            state.ended = dict(entry)
            state.in_flight = None
        else:
            raise ValueError(f"unknown entry type {kind!r}")

    def append(self, entry: Mapping[str, Any]) -> Future[None]:
        """Queue one entry for the writer thread, which appends, flushes and fsyncs it after
        every durable write submitted before it; returns that write's future (raising
        JournalError if it failed). Messages spooled after this call leave once it is done. An
        entry that could not be written is logged, and raised as JournalError by the next
        ``append`` or ``load``: nothing after it is journaled."""
        self._raise_failed()
        line = orjson.dumps({**entry, "ts": time.time()}) + b"\n"
        return durable.submit(functools.partial(self._write, line))

    def _write(self, line: bytes) -> None:
        if self._failed is not None:
            raise self._failed
        try:
            durable.append_line(self.path, line)
        except OSError as e:
            self._failed = JournalError(f"{self.path}: {e.strerror}")
            log.error("journal entry not written: %s", self._failed)
            raise self._failed from e

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise JournalError(f"{self._failed} (an earlier entry could not be written)")
