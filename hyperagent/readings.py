"""The data model shared by sources, indicators, the exporter and the bus."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Kind(StrEnum):
    """Prometheus metric type of a reading; a name keeps one kind forever."""

    GAUGE = "gauge"
    COUNTER = "counter"
    INFO = "info"


@dataclass(frozen=True, slots=True, init=False)
class Reading:
    """One sample: the full exposed metric name (counters end in ``_total``), value and labels.

    Immutable like any frozen dataclass; ``labels`` defaults to a new empty dict.
    """

    name: str
    value: float
    labels: Mapping[str, str]
    kind: Kind
    unit: str

    def __init__(
        self,
        name: str,
        value: float,
        labels: Mapping[str, str] | None = None,
        kind: Kind = Kind.GAUGE,
        unit: str = "",
    ) -> None:
        # Sources make hundreds of readings per cycle: the slots are set through their
        # descriptors, about twice as fast as the object.__setattr__ calls dataclass generates.
        _set_name(self, name)
        _set_value(self, value)
        _set_labels(self, {} if labels is None else labels)
        _set_kind(self, kind)
        _set_unit(self, unit)


_set_name, _set_value, _set_labels, _set_kind, _set_unit = (
    Reading.__dict__[slot].__set__ for slot in ("name", "value", "labels", "kind", "unit")
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one node reported in one collection cycle.

    Lookups by name go through an index built on the first lookup.
    """

    ts: float
    node: str
    readings: tuple[Reading, ...]
    _index: dict[str, list[Reading]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def named(self, name: str) -> Sequence[Reading]:
        """The readings named ``name``, in order (empty when there is none)."""
        index = self._index
        if index is None:
            index = by_name(self.readings)
            object.__setattr__(self, "_index", index)
        return index.get(name, ())

    def extended(self, extra: Sequence[Reading]) -> Snapshot:
        """This snapshot with ``extra`` readings after its own; a name index already built is
        carried over (its lists shared, those of the names in ``extra`` copied)."""
        out = Snapshot(self.ts, self.node, (*self.readings, *extra))
        index = self._index
        if index is not None:
            grown = dict(index)
            for reading in extra:
                found = grown.get(reading.name)
                if found is None:
                    grown[reading.name] = [reading]
                elif found is index.get(reading.name):
                    grown[reading.name] = [*found, reading]
                else:
                    found.append(reading)
            object.__setattr__(out, "_index", grown)
        return out

    def values(self, name: str) -> list[tuple[Mapping[str, str], float]]:
        """All (labels, value) pairs of the metric ``name``."""
        return [(r.labels, r.value) for r in self.named(name)]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the first reading named ``name`` whose labels include ``labels``."""
        for r in self.named(name):
            if all(r.labels.get(k) == v for k, v in labels.items()):
                return r.value
        return None

    def total(self, name: str) -> float | None:
        """Sum of every reading named ``name``, or None when there is none."""
        found = self.named(name)
        return sum(r.value for r in found) if found else None


def by_name(readings: Iterable[Reading]) -> dict[str, list[Reading]]:
    """Group readings by metric name, preserving order."""
    grouped: dict[str, list[Reading]] = {}
    for r in readings:
        group = grouped.get(r.name)
        if group is None:
            grouped[r.name] = [r]
        else:
            group.append(r)
    return grouped
