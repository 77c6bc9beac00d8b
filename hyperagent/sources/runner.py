"""Runs every source under a time bound and reports failures as data, never as crashes.

Staleness is visible: ``hyperagent_source_last_success_timestamp_seconds`` stops advancing
while a source fails, and ``hyperagent_source_up`` is 0 while a read is overdue (in flight past
its timeout, or no success for ``STALE_INTERVALS`` of a source's interval). Every log line names
the source and its target in its text.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from hyperagent.errors import SourceError, SourceTimeout, SourceUnavailable
from hyperagent.readings import Kind, Reading
from hyperagent.sources.base import Source

log = logging.getLogger(__name__)

UP = "hyperagent_source_up"
DURATION = "hyperagent_source_duration_seconds"
ERRORS = "hyperagent_source_errors_total"
LAST_SUCCESS = "hyperagent_source_last_success_timestamp_seconds"


@dataclass
class _Health:
    labels: dict[str, str]
    up: bool = False
    started: bool = False
    errors: int = 0
    duration_s: float = 0.0
    last_success: float = 0.0
    last_problem: str = field(default="")
    hung_since: float | None = None
    """Monotonic time the source's reads began to time out (a hang), None while they do not:
    a hang is logged once, when it begins, and its duration when it ends."""
    cached: dict[str, Reading] = field(default_factory=dict)
    """The last up and errors readings, reused while their values stay the same."""
    read_at: float = -math.inf
    """Monotonic time the last read began."""
    readings: list[Reading] = field(default_factory=list)
    """What the last successful read returned."""
    succeeded_at: float = -math.inf
    """Monotonic time of the last successful read."""
    task: asyncio.Task[list[Reading] | None] | None = None
    """The read in progress, kept until it ends even when the cycle stopped waiting for it."""
    task_began: float = 0.0

    def reading(self, name: str, value: float, kind: Kind = Kind.GAUGE) -> Reading:
        found = self.cached.get(name)
        if found is None or found.value != value:
            found = self.cached[name] = Reading(name, value, self.labels, kind)
        return found


DUE_FRACTION = 0.95
"""A source with an interval is read again once this fraction of it has passed (cycles jitter)."""

STALE_INTERVALS = 3.0
"""A source with an interval and no successful read for this many intervals is down (up 0)."""

GRACE_S = 0.5
"""How long past its timeout a cycle waits for a read that ignores cancellation (a source that
blocks in a call its cancellation cannot reach) before it goes on without it."""


class SourceRunner:
    """Starts, reads and closes a set of sources; each read is bounded by ``timeout_s``.

    ``intervals`` (seconds, by source name) slows a source down below the collection rate: a
    BMC or a PDU updates its readings about once a second, so an agent collecting at 10 Hz
    reads them at most that often and repeats the last readings (and health) in between.
    """

    def __init__(
        self,
        sources: list[Source],
        timeout_s: float,
        intervals: Mapping[str, float] | None = None,
    ) -> None:
        self.sources = sources
        self.timeout_s = timeout_s
        self.intervals = dict(intervals or {})
        self._health = {id(s): _Health({"source": s.name, "target": s.target}) for s in sources}

    async def start(self) -> None:
        """Start every source; one that fails to start is retried on each read."""
        await asyncio.gather(*(self._start(s) for s in self.sources))

    async def _start(self, source: Source) -> bool:
        health = self._health[id(source)]
        if health.started:
            return True
        try:
            async with asyncio.timeout(self.timeout_s):
                await source.start()
        except Exception as e:
            self._note_failure(source, e, "start")
            return False
        health.started = True
        return True

    async def read_by_source(self) -> dict[str, list[Reading]]:
        """One collection cycle: the readings of every source that succeeded, by source name."""
        results = await asyncio.gather(*(self._read(s) for s in self.sources))
        by_source: dict[str, list[Reading]] = {}
        for source, batch in zip(self.sources, results, strict=True):
            if batch is None:
                continue
            found = by_source.get(source.name)
            by_source[source.name] = batch if found is None else [*found, *batch]
        return by_source

    async def read_all(self) -> list[Reading]:
        """One collection cycle: every source's readings plus per-source health readings."""
        readings = [r for batch in (await self.read_by_source()).values() for r in batch]
        readings.extend(self.health_readings())
        return readings

    async def _read(self, source: Source) -> list[Reading] | None:
        """The source's readings, or None when it failed; never waits much past the timeout."""
        health = self._health[id(source)]
        interval = self.intervals.get(source.name)
        now = time.monotonic()
        if health.task is not None and not health.task.done():
            self._note_failure(source, self._stuck(), "read")
            return None
        if interval is not None:
            if now - health.read_at < DUE_FRACTION * interval:
                return health.readings if health.up else None
            health.read_at = now
        task = asyncio.get_running_loop().create_task(
            self._bounded_read(source), name=f"read-{source.name}-{source.target}"
        )
        health.task, health.task_began = task, now
        task.add_done_callback(partial(self._read_ended, health))
        bound = self.timeout_s * (1 if health.started else 2) + GRACE_S  # a start comes first
        try:
            done, _ = await asyncio.wait({task}, timeout=bound)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            self._note_failure(source, self._stuck(), "read")
            return None
        return task.result()

    def _stuck(self) -> SourceTimeout:
        return SourceTimeout(f"still in flight past its {self.timeout_s:g}s timeout")

    @staticmethod
    def _read_ended(health: _Health, task: asyncio.Task[list[Reading] | None]) -> None:
        if health.task is task:
            health.task = None
        if not task.cancelled():
            task.exception()  # seen: a read the cycle left behind fails quietly

    async def _bounded_read(self, source: Source) -> list[Reading] | None:
        health = self._health[id(source)]
        interval = self.intervals.get(source.name)
        began = time.perf_counter()
        try:
            if not health.started and not await self._start(source):
                return None
            async with asyncio.timeout(self.timeout_s):
                readings = await source.read()
        except Exception as e:
            health.duration_s = time.perf_counter() - began
            self._note_failure(source, e, "read")
            return None
        health.duration_s = time.perf_counter() - began
        health.last_success = time.time()
        health.succeeded_at = time.monotonic()
        if not health.up:
            if health.hung_since is not None:
                log.warning(
                    "source %s (%s) recovered after hanging for %.1f s",
                    source.name,
                    source.target,
                    health.succeeded_at - health.hung_since,
                )
            elif health.last_problem:
                log.info("source %s (%s) recovered", source.name, source.target)
            health.up = True
            health.last_problem = ""
        health.hung_since = None
        if interval is not None:
            health.readings = readings
        return readings

    def _note_failure(self, source: Source, error: BaseException, stage: str) -> None:
        health = self._health[id(source)]
        health.up = False
        if isinstance(error, TimeoutError):
            problem = f"{stage} timed out after {self.timeout_s:g}s"
        else:
            problem = f"{stage}: {error}" if str(error) else f"{stage}: {type(error).__name__}"
        unavailable = isinstance(error, SourceUnavailable)
        if not unavailable:
            health.errors += 1
        timed_out = isinstance(error, (SourceTimeout, TimeoutError))
        if not timed_out:
            health.hung_since = None
        elif health.hung_since is None:
            health.hung_since = time.monotonic()
        elif health.last_problem:
            return  # the same hang: its calls time out, then the library is busy, for N s
        if problem != health.last_problem:
            level = logging.DEBUG if unavailable else logging.WARNING
            if not isinstance(error, (SourceError, TimeoutError)):
                level = logging.ERROR
            log.log(level, "source %s (%s) down: %s", source.name, source.target, problem)
        health.last_problem = problem

    def overdue(self, source: Source, now: float | None = None) -> bool:
        """A read of ``source`` has been in flight past its timeout, or (a source with an
        interval) no read succeeded for ``STALE_INTERVALS`` intervals."""
        h = self._health[id(source)]
        now = time.monotonic() if now is None else now
        if h.task is not None and now - h.task_began > self.timeout_s:
            return True
        interval = self.intervals.get(source.name)
        return (
            interval is not None
            and h.succeeded_at > -math.inf
            and now - h.succeeded_at > STALE_INTERVALS * max(interval, self.timeout_s)
        )

    def health_readings(self) -> list[Reading]:
        """up (0 while overdue), duration, errors and last success time of every source."""
        out = []
        now = time.monotonic()
        for source in self.sources:
            h = self._health[id(source)]
            up = h.up and not self.overdue(source, now)
            out.append(h.reading(UP, 1.0 if up else 0.0))
            out.append(Reading(DURATION, h.duration_s, h.labels, unit="s"))
            out.append(h.reading(ERRORS, h.errors, Kind.COUNTER))
            if h.last_success:
                out.append(Reading(LAST_SUCCESS, h.last_success, h.labels))
        return out

    async def close(self) -> None:
        """Close every started source (a read still in flight is cancelled first); errors are
        logged."""
        for source in self.sources:
            health = self._health[id(source)]
            if health.task is not None:
                health.task.cancel()
            if not health.started:
                continue
            try:
                async with asyncio.timeout(self.timeout_s):
                    await source.close()
            except Exception as e:
                problem = str(e) or type(e).__name__
                log.warning(
                    "closing source %s (%s) failed: %s", source.name, source.target, problem
                )
