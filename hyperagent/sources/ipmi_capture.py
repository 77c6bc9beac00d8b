"""BMC captures replayed through the ipmitool backend: a capture directory's SDR and DCMI files.

``ipmitool-sdr.txt`` (or ``ipmiutil-sensor.txt``) holds the output of one SDR listing, or a
*day file*: the listing logged again and again, each table after a ``Timestamp:`` line, as
sites log ``ipmitool sdr`` once a minute::

    Timestamp: 2026-12-01T15:13:01+00:00
    Pwr Consumption  | 208 Watts         | ok
    ...
    Timestamp: 2026-12-01T15:14:01+00:00
    Pwr Consumption  | 212 Watts         | ok

A day file is split into its tables once; replay then answers each SDR command with the table
whose time has come by a clock scaled by ``speed`` (as :class:`hyperagent.replay.Player` plays a
recording), and stays on the last table after the end. A timestamp is ISO 8601, Unix seconds,
or what ``date`` prints (``Tue Dec  1 15:13:01 UTC 2026``; only the differences between
timestamps matter, so the zone name of ``date`` is not read).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from hyperagent.errors import SourceError
from hyperagent.sources import command
from hyperagent.sources.command import CaptureMissing, CommandFailed, RunCommand

SDR_CAPTURE = "ipmitool-sdr.txt"
IPMIUTIL_SENSOR_CAPTURE = "ipmiutil-sensor.txt"
DCMI_CAPTURE = "ipmitool-dcmi.txt"
SDR_CAPTURES = (SDR_CAPTURE, IPMIUTIL_SENSOR_CAPTURE)
"""Files that answer the SDR command, the first present wins."""

_MARK = "Timestamp:"


class DayFileError(SourceError):
    """A day file with a timestamp that cannot be read, or one that goes back in time."""


def parse_timestamp(text: str) -> float:
    """Seconds of a ``Timestamp:`` value: ISO 8601 (naive read as UTC), Unix seconds, or
    ``date`` output (its zone name ignored). Raises ValueError for anything else."""
    value = text.strip()
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        words = value.split()
        if len(words) != 6:
            raise ValueError(f"not a timestamp: {value!r}") from None
        without_zone = " ".join(words[:4] + words[5:])
        parsed = datetime.strptime(without_zone, "%a %b %d %H:%M:%S %Y")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


@dataclass(frozen=True)
class DayFile:
    """The tables of a day file and their times, in file order."""

    times: Sequence[float]
    tables: Sequence[str]


def _timestamp_lines(text: str) -> list[tuple[int, int, str]]:
    """(start, end, value) of each ``Timestamp:`` line (leading blanks allowed), found with
    ``str.find`` rather than a multi-line regex: a day file is megabytes."""
    found: list[tuple[int, int, str]] = []
    at = text.find(_MARK)
    while at >= 0:
        line_start = text.rfind("\n", 0, at) + 1
        end = text.find("\n", at)
        end = len(text) if end < 0 else end + 1
        if not text[line_start:at].strip(" \t"):
            found.append((line_start, end, text[at + len(_MARK) : end].strip()))
        at = text.find(_MARK, end)
    return found


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def split_day_file(text: str, where: str = "day file") -> DayFile | None:
    """The timestamped tables of ``text``; None when it has no ``Timestamp:`` line (one table).

    Text before the first timestamp is ignored. Raises DayFileError naming the line of a
    timestamp that cannot be read or that is earlier than the one before.
    """
    marks = _timestamp_lines(text)
    times: list[float] = []
    tables: list[str] = []
    for i, (start, end, value) in enumerate(marks):
        try:
            ts = parse_timestamp(value)
        except ValueError as e:
            raise DayFileError(f"{where}:{_line_of(text, start)}: {e}") from None
        if times and ts < times[-1]:
            raise DayFileError(f"{where}:{_line_of(text, start)}: timestamp goes back in time")
        times.append(ts)
        tables.append(text[end : marks[i + 1][0] if i + 1 < len(marks) else len(text)])
    return DayFile(times, tables) if marks else None


class SdrCapture:
    """What a capture directory answers to the SDR command.

    A single table is read from the file on every call (as a command would run afresh); a day
    file is read and split once, then each call answers the table current at ``clock()``:
    recorded seconds pass ``speed`` times as fast as the clock's.
    """

    def __init__(
        self, directory: Path, clock: Callable[[], float] = time.monotonic, speed: float = 1.0
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.directory = directory
        self.clock = clock
        self.speed = speed
        self._start = clock()
        self._day: DayFile | None = None

    @property
    def path(self) -> Path:
        """The SDR file of the directory (the first of :data:`SDR_CAPTURES` present)."""
        for name in SDR_CAPTURES:
            path = self.directory / name
            if path.is_file():
                return path
        return self.directory / SDR_CAPTURE

    def table_index(self, day: DayFile) -> int:
        """Index of the table whose time has come."""
        at = day.times[0] + (self.clock() - self._start) * self.speed
        return max(bisect.bisect_right(day.times, at) - 1, 0)

    async def read(self) -> str:
        if self._day is None:
            path = self.path
            try:
                text = await asyncio.to_thread(path.read_text, encoding="utf-8", errors="replace")
            except FileNotFoundError as e:
                raise CaptureMissing(f"no {path.name} in {self.directory}") from e
            except OSError as e:
                raise CommandFailed(f"reading {path} failed: {e}", ["sdr"]) from e
            day = split_day_file(text, str(path))
            if day is None:
                return text
            self._day = day
        return self._day.tables[self.table_index(self._day)]


def capture_file(argv: Sequence[str]) -> str:
    """The file of a capture directory that holds the output of an ipmitool ``argv``."""
    if list(argv[-3:]) == ["dcmi", "power", "reading"]:
        return DCMI_CAPTURE
    if "sdr" in argv:
        return SDR_CAPTURE
    raise CommandFailed(f"no capture answers {' '.join(argv)}", argv)


def capture_runner(
    directory: Path, clock: Callable[[], float] = time.monotonic, speed: float = 1.0
) -> RunCommand:
    """A RunCommand answering ``ipmitool ... sdr ...`` with the directory's SDR capture
    (:class:`SdrCapture`: ``ipmitool-sdr.txt`` or ``ipmiutil-sensor.txt``, one table or a day
    file played by ``clock`` at ``speed``) and ``ipmitool ... dcmi power reading`` with
    ``ipmitool-dcmi.txt``.

    A missing file raises CaptureMissing, a SourceUnavailable (no SDR capture: the source is
    down quietly; no DCMI capture: the backend reads SDR sensors only).
    """
    sdr = SdrCapture(directory, clock, speed)
    other = command.capture_runner(directory, capture_file)

    async def run(argv: Sequence[str]) -> str:
        if capture_file(argv) == SDR_CAPTURE:
            return await sdr.read()
        return await other(argv)

    return run
