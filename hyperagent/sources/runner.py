"""Runs every source under a time bound and reports failures as data, never as crashes."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading
from hyperagent.sources.base import Source

log = logging.getLogger(__name__)


@dataclass
class _Health:
    up: bool = False
    started: bool = False
    errors: int = 0
    duration_s: float = 0.0
    last_success: float = 0.0
    last_problem: str = field(default="")


class SourceRunner:
    """Starts, reads and closes a set of sources; each read is bounded by ``timeout_s``."""

    def __init__(self, sources: list[Source], timeout_s: float) -> None:
        self.sources = sources
        self.timeout_s = timeout_s
        self._health = {id(s): _Health() for s in sources}

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
            if self._health[id(source)].up:
                by_source.setdefault(source.name, []).extend(batch)
        return by_source

    async def read_all(self) -> list[Reading]:
        """One collection cycle: every source's readings plus per-source health readings."""
        readings = [r for batch in (await self.read_by_source()).values() for r in batch]
        readings.extend(self.health_readings())
        return readings

    async def _read(self, source: Source) -> list[Reading]:
        health = self._health[id(source)]
        began = time.perf_counter()
        try:
            if not await self._start(source):
                return []
            async with asyncio.timeout(self.timeout_s):
                readings = await source.read()
        except Exception as e:
            health.duration_s = time.perf_counter() - began
            self._note_failure(source, e, "read")
            return []
        health.duration_s = time.perf_counter() - began
        health.last_success = time.time()
        if not health.up and health.last_problem:
            log.info("source recovered", extra={"source": source.name, "target": source.target})
        health.up = True
        health.last_problem = ""
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
        if problem != health.last_problem:
            level = logging.DEBUG if unavailable else logging.WARNING
            if not isinstance(error, (SourceError, TimeoutError)):
                level = logging.ERROR
            log.log(level, "source %s (%s) down: %s", source.name, source.target, problem)
        health.last_problem = problem

    def health_readings(self) -> list[Reading]:
        """up, duration, errors and last success time of every source."""
        out = []
        for source in self.sources:
            h = self._health[id(source)]
            labels = {"source": source.name, "target": source.target}
            out.append(Reading("hyperagent_source_up", 1.0 if h.up else 0.0, labels))
            out.append(
                Reading("hyperagent_source_duration_seconds", h.duration_s, labels, unit="s")
            )
            out.append(Reading("hyperagent_source_errors_total", h.errors, labels, Kind.COUNTER))
            if h.last_success:
                out.append(
                    Reading(
                        "hyperagent_source_last_success_timestamp_seconds", h.last_success, labels
                    )
                )
        return out

    async def close(self) -> None:
        """Close every started source; errors are logged."""
        for source in self.sources:
            if not self._health[id(source)].started:
                continue
            try:
                async with asyncio.timeout(self.timeout_s):
                    await source.close()
            except Exception as e:
                log.warning("closing source %s failed: %s", source.name, e)
