"""Recordings: a time series of every source's readings, written by ``hyperagent record`` and
replayed through the agent as if the sources were live.

The format is JSON lines: a header, then one line per collection cycle. A cycle holds each
source's values in the order of that source's series (name, labels, kind), and the series
themselves only when they differ from the source's previous cycle, so a day at 1 Hz stores the
labels once rather than 86,400 times::

    {"format": "hyperagent-recording", "version": 2, "node": "gpu-017", "interval_s": 1.0}
    {"ts": 1790000000.5, "series": {"nvml": [[name, labels, kind], ...]},
     "sources": {"nvml": [value, ...]}}
    {"ts": 1790000001.5, "sources": {"nvml": [value, ...]}}

(one line each). A value that is not a number (NaN) is written as null and read back as NaN.

Version 1 recordings (each reading as ``[name, labels, value, kind]`` on every line) load too.

Replay follows a clock (wall time scaled by ``speed``, or a virtual clock in tests): the frame
shown is the last one whose recorded time has passed. At the end the recording plays again
from its first frame, which takes the last frame's place: every recorded interval is played
once per loop, and counters carry on from where the loop left them (each grows by what it grew
over the recording, per loop), so energy keeps pace with the power shown and no counter resets.
A recording of one frame holds it.
"""

from __future__ import annotations

import bisect
import math
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Kind, Reading

FORMAT = "hyperagent-recording"
VERSION = 2
"""The version ``Recorder`` writes; ``load_recording`` reads it and version 1."""
RECORDING_FILE = "recording.jsonl"


class RecordingError(SourceError):
    """A recording is missing, malformed or of an unknown version."""


_KINDS = {kind.value: kind for kind in Kind}

Series = tuple[str, Mapping[str, str], Kind]
"""One recorded series: metric name, labels and kind."""


def _bad(where: str, row: Any) -> RecordingError:
    return RecordingError(f"{where}: bad reading {str(row)[:120]}")


def _labels(labels: Any) -> bool:
    return type(labels) is dict and all(
        type(k) is str and type(v) is str for k, v in labels.items()
    )


def _value(value: Any) -> bool:
    kind = type(value)
    return kind is float or kind is int


def _value_or_null(value: Any) -> bool:
    kind = type(value)
    return kind is float or kind is int or value is None


def decode_readings(rows: Any, where: str) -> list[Reading]:
    """Readings from version 1 rows; raises RecordingError naming ``where`` on bad rows."""
    if not isinstance(rows, list):
        raise RecordingError(f"{where}: readings must be a list")
    out = []
    for row in rows:
        if type(row) is not list or len(row) != 4:
            raise _bad(where, row)
        name, labels, value, kind = row
        found = _KINDS.get(kind) if type(kind) is str else None
        if type(name) is not str or found is None or not _value(value) or not _labels(labels):
            raise _bad(where, row)
        out.append(Reading(name, float(value), labels, found))
    return out


def decode_series(rows: Any, where: str) -> list[Series]:
    """A source's series from version 2 rows ``[name, labels, kind]``."""
    if not isinstance(rows, list):
        raise RecordingError(f"{where}: series must be a list")
    out: list[Series] = []
    for row in rows:
        if type(row) is not list or len(row) != 3:
            raise _bad(where, row)
        name, labels, kind = row
        found = _KINDS.get(kind) if type(kind) is str else None
        if type(name) is not str or found is None or not _labels(labels):
            raise _bad(where, row)
        out.append((name, labels, found))
    return out


def decode_values(series: Sequence[Series], values: Any, where: str) -> array[float]:
    """A version 2 source's values, one per series in order (null as NaN), checked."""
    if not isinstance(values, list) or len(values) != len(series):
        raise RecordingError(
            f"{where}: {len(series)} series but "
            + (f"{len(values)} values" if isinstance(values, list) else "no list of values")
        )
    if not all(map(_value_or_null, values)):
        bad = next(v for v in values if not _value_or_null(v))
        raise RecordingError(f"{where}: bad value {str(bad)[:60]}")
    if None in values:
        values = [math.nan if value is None else value for value in values]
    return array("d", values)


class FrameSources(Mapping[str, list[Reading]]):
    """One frame's readings by source, made when asked for: a recording keeps each frame's
    values (8 bytes each) and its sources' series, not a Reading object per value, so a day
    at 1 Hz of a full node loads in seconds and fits in a few hundred MiB."""

    __slots__ = ("_series", "_values")

    def __init__(
        self, series: Mapping[str, Sequence[Series]], values: Mapping[str, array[float]]
    ) -> None:
        self._series = series
        self._values = values

    def __getitem__(self, name: str) -> list[Reading]:
        values = self._values[name]
        return [
            Reading(metric, value, labels, kind)
            for (metric, labels, kind), value in zip(self._series[name], values, strict=True)
        ]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass(frozen=True)
class Frame:
    """One recorded collection cycle."""

    ts: float
    sources: Mapping[str, list[Reading]]


@dataclass(frozen=True)
class Recording:
    """A parsed recording: header fields and frames in time order."""

    node: str
    interval_s: float
    frames: Sequence[Frame]

    @property
    def source_names(self) -> list[str]:
        names: dict[str, None] = {}
        for frame in self.frames:
            names.update(dict.fromkeys(frame.sources))
        return list(names)

    @property
    def duration_s(self) -> float:
        return self.frames[-1].ts - self.frames[0].ts if self.frames else 0.0


def load_recording(path: Path) -> Recording:
    """Parse a recording file; raises RecordingError with the line number of a bad line."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise RecordingError(f"{path}: {e.strerror}") from e
    if not lines:
        raise RecordingError(f"{path}: empty")
    try:
        header = orjson.loads(lines[0])
    except orjson.JSONDecodeError as e:
        raise RecordingError(f"{path}:1: not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RecordingError(f"{path}:1: not a hyperagent recording")
    version = header.get("version")
    if version not in (1, VERSION):
        raise RecordingError(f"{path}:1: unsupported version {version!r}")
    frames: list[Frame] = []
    layouts: dict[str, list[Series]] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise RecordingError(f"{where}: not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("ts"), int | float):
            raise RecordingError(f"{where}: a frame needs a numeric ts")
        sources = data.get("sources")
        if not isinstance(sources, dict):
            raise RecordingError(f"{where}: a frame needs a sources object")
        decoded: Mapping[str, list[Reading]]
        if version == 1:
            decoded = {
                name: decode_readings(rows, f"{where} {name}") for name, rows in sources.items()
            }
        else:
            decoded = _decode_frame(data, layouts, where)
        frame = Frame(float(data["ts"]), decoded)
        if frames and frame.ts < frames[-1].ts:
            raise RecordingError(f"{where}: frames go back in time")
        frames.append(frame)
    if not frames:
        raise RecordingError(f"{path}: no frames")
    return Recording(str(header.get("node", "")), float(header.get("interval_s", 1.0)), frames)


def _decode_frame(
    data: Mapping[str, Any], layouts: dict[str, list[Series]], where: str
) -> FrameSources:
    series = data.get("series", {})
    if not isinstance(series, dict):
        raise RecordingError(f"{where}: series must be an object")
    for name, rows in series.items():
        layouts[name] = decode_series(rows, f"{where} {name}")
    values: dict[str, array[float]] = {}
    series_now: dict[str, list[Series]] = {}
    for name, rows in data["sources"].items():
        layout = layouts.get(name)
        if layout is None:
            raise RecordingError(f"{where} {name}: values before the series they belong to")
        values[name] = decode_values(layout, rows, f"{where} {name}")
        series_now[name] = layout
    return FrameSources(series_now, values)


class Recorder:
    """Writes a recording, one frame per ``write`` call (flushed, so a crash loses one line)."""

    def __init__(self, out: IO[bytes], node: str, interval_s: float) -> None:
        self.out = out
        self.frames = 0
        self._layouts: dict[str, list[Series]] = {}
        header = {
            "format": FORMAT,
            "version": VERSION,
            "node": node,
            "interval_s": interval_s,
            "started": time.time(),
        }
        out.write(orjson.dumps(header) + b"\n")

    def write(self, ts: float, sources: Mapping[str, Iterable[Reading]]) -> None:
        frame: dict[str, Any] = {"ts": ts}
        changed: dict[str, list[list[Any]]] = {}
        values: dict[str, list[float]] = {}
        for name, readings in sources.items():
            batch = list(readings)
            layout = [(r.name, r.labels, r.kind) for r in batch]
            if self._layouts.get(name) != layout:
                self._layouts[name] = layout
                changed[name] = [[n, dict(labels), kind.value] for n, labels, kind in layout]
            values[name] = [r.value for r in batch]
        if changed:
            frame["series"] = changed
        frame["sources"] = values
        self.out.write(orjson.dumps(frame) + b"\n")
        self.out.flush()
        self.frames += 1


SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


def _series_key(reading: Reading) -> SeriesKey:
    return reading.name, tuple(sorted(reading.labels.items()))


def _counters(readings: Iterable[Reading]) -> dict[SeriesKey, float]:
    return {
        _series_key(r): r.value
        for r in readings
        if r.kind is Kind.COUNTER and math.isfinite(r.value)
    }


class _LoopedSources(Mapping[str, list[Reading]]):
    """A frame's readings in a later loop: each counter raised by its growth per loop."""

    __slots__ = ("_growth", "_loops", "_sources")

    def __init__(
        self,
        sources: Mapping[str, list[Reading]],
        growth: Mapping[str, Mapping[SeriesKey, float]],
        loops: int,
    ) -> None:
        self._sources, self._growth, self._loops = sources, growth, loops

    def __getitem__(self, name: str) -> list[Reading]:
        readings = self._sources[name]
        growth = self._growth.get(name)
        if not growth:
            return readings
        out = []
        for r in readings:
            step = growth.get(_series_key(r)) if r.kind is Kind.COUNTER else None
            if step:
                r = Reading(r.name, r.value + step * self._loops, r.labels, r.kind, r.unit)
            out.append(r)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


class Player:
    """Which frame of a recording is current, by a clock scaled by ``speed``; plays the
    recording in a loop (see the module's docstring)."""

    def __init__(
        self,
        recording: Recording,
        clock: Callable[[], float] = time.monotonic,
        speed: float = 1.0,
    ) -> None:
        self.recording = recording
        self.clock = clock
        self.speed = speed
        self._start = clock()
        self._times = [f.ts for f in recording.frames]
        self._growth: dict[str, dict[SeriesKey, float]] | None = None
        self._shown: tuple[int, int, Frame] | None = None

    @property
    def position_s(self) -> float:
        """Recorded seconds played so far."""
        return (self.clock() - self._start) * self.speed

    @property
    def loops(self) -> int:
        """How many times the recording has been played to its end."""
        duration = self.recording.duration_s
        return int(self.position_s // duration) if duration > 0 else 0

    def frame(self) -> Frame:
        """The current frame; in a later loop, its time and counters moved on by one
        recording's duration and growth per loop."""
        duration = self.recording.duration_s
        position = self.position_s
        loops = int(position // duration) if duration > 0 else 0
        at = self._times[0] + position - loops * duration
        index = max(bisect.bisect_right(self._times, at) - 1, 0)
        if index == len(self._times) - 1 and duration > 0:
            index, loops = 0, loops + 1  # the end of one loop is the start of the next
        frame = self.recording.frames[index]
        if loops == 0:
            return frame
        shown = self._shown
        if shown is not None and shown[0] == index and shown[1] == loops:
            return shown[2]
        looped = Frame(
            frame.ts + loops * duration,
            _LoopedSources(frame.sources, self._counter_growth(), loops),
        )
        self._shown = (index, loops, looped)
        return looped

    def _counter_growth(self) -> dict[str, dict[SeriesKey, float]]:
        """Per source, what each counter grew by from the first frame to the last that hold
        the source (never negative: a counter reset inside the recording adds nothing)."""
        if self._growth is None:
            frames = self.recording.frames
            self._growth = {}
            for name in self.recording.source_names:
                first = next(f for f in frames if name in f.sources)
                last = next(f for f in reversed(frames) if name in f.sources)
                before = _counters(first.sources[name])
                growth = {
                    key: value - before[key]
                    for key, value in _counters(last.sources[name]).items()
                    if key in before and value > before[key]
                }
                if growth:
                    self._growth[name] = growth
        return self._growth


class RecordedSource:
    """Replays one recorded source's readings from the player's current frame."""

    def __init__(self, name: str, player: Player) -> None:
        self.name = name
        self.target = "recording"
        self.player = player

    async def start(self) -> None:
        return None

    async def read(self) -> list[Reading]:
        readings = self.player.frame().sources.get(self.name)
        if readings is None:
            raise SourceUnavailable(f"the recording has no {self.name} readings at this time")
        return list(readings)

    async def close(self) -> None:
        return None


class RecordedNvmlSource:
    """Replays recorded GPU readings through the NVML source over a fake NVML, so a recording
    takes the same code path as live hardware (and a bad recording fails the same way)."""

    name = "nvml"
    target = "recording"

    def __init__(self, player: Player) -> None:
        from hyperagent.capture.fake_nvml import FakeNvml
        from hyperagent.sources.nvml import NvmlSource

        self.player = player
        first = next(f for f in player.recording.frames if "nvml" in f.sources)
        self._now = first.ts
        self._shown: Frame | None = first
        try:
            self.fake = FakeNvml.from_readings(first.sources["nvml"], clock=self._recorded_time)
        except ValueError as e:
            raise RecordingError(f"recorded GPU readings at {first.ts}: {e}") from e
        # every frame's health readings as recorded, not repeated
        self.source = NvmlSource(self.fake, clock=self._recorded_time, health_interval_s=0.0)

    def _recorded_time(self) -> float:
        return self._now

    async def start(self) -> None:
        await self.source.start()

    async def read(self) -> list[Reading]:
        frame = self.player.frame()
        readings = frame.sources.get("nvml")
        if readings is None:
            raise SourceUnavailable("the recording has no GPU readings at this time")
        if frame is not self._shown:
            self._now = frame.ts
            try:
                self.fake.update_from_readings(readings)
            except ValueError as e:
                raise RecordingError(f"recorded GPU readings at {frame.ts}: {e}") from e
            self._shown = frame
        return await self.source.read()

    async def close(self) -> None:
        await self.source.close()
