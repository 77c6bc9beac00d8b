"""The data model shared by sources, indicators, the exporter and the bus."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Kind(StrEnum):
    """Prometheus metric type of a reading; a name keeps one kind forever."""

    GAUGE = "gauge"
    COUNTER = "counter"
    INFO = "info"


@dataclass(frozen=True, slots=True)
class Reading:
    """One sample: the full exposed metric name (counters end in ``_total``), value and labels."""

    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)
    kind: Kind = Kind.GAUGE
    unit: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one node reported in one collection cycle."""

    ts: float
    node: str
    readings: tuple[Reading, ...]

    def values(self, name: str) -> list[tuple[Mapping[str, str], float]]:
        """All (labels, value) pairs of the metric ``name``."""
        return [(r.labels, r.value) for r in self.readings if r.name == name]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the first reading named ``name`` whose labels include ``labels``."""
        for r in self.readings:
            if r.name == name and all(r.labels.get(k) == v for k, v in labels.items()):
                return r.value
        return None

    def total(self, name: str) -> float | None:
        """Sum of every reading named ``name``, or None when there is none."""
        found = [r.value for r in self.readings if r.name == name]
        return sum(found) if found else None


def by_name(readings: Iterable[Reading]) -> dict[str, list[Reading]]:
    """Group readings by metric name, preserving order."""
    grouped: dict[str, list[Reading]] = {}
    for r in readings:
        grouped.setdefault(r.name, []).append(r)
    return grouped
