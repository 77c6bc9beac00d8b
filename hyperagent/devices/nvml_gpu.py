"""What the telemetry keeps per GPU between reads: labels built once, NVLinks, MIG devices,
the field batches and what the GPU refused of them, GPM samples and the repeated readings."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hyperagent.devices.nvml_api import GpuIdentity
from hyperagent.readings import Kind, Reading


@dataclass
class GpmState:
    """A GPU's two GPM samples, the metrics request over them, and which one is the latest."""

    samples: tuple[Any, Any]
    request: Any
    latest: int | None = None


@dataclass(frozen=True)
class Link:
    """One NVLink of a GPU and the label sets of its readings."""

    number: int
    labels: dict[str, str]
    errors: dict[str, dict[str, str]]


@dataclass(frozen=True)
class MigDevice:
    """A MIG device's info labels and the labels of its other readings."""

    info: dict[str, str]
    labels: dict[str, str]


@dataclass(frozen=True)
class Field:
    """One value of an nvmlDeviceGetFieldValues batch and the reading it becomes."""

    key: tuple[int, int]
    """(field id, scope id): the scope is the link for NVLink fields, the power scope for power
    fields (0: the GPU alone), 0 for the rest."""
    name: str
    labels: Mapping[str, str]
    kind: Kind = Kind.GAUGE
    per: float = 1.0
    """NVML's units (mW, mJ, ns, KiB, ...) per unit of the metric: the value is divided by it."""
    legacy: Callable[[Any], Any] | None = None
    """The older call that gives the same value in the same unit from the device handle, for a
    driver that does not know the field id."""
    what: str = "field"
    """What the value is, for error messages."""


@dataclass
class Batch:
    """Fields read together in one nvmlDeviceGetFieldValues, and what the GPU's answers so far
    leave to ask: the fields it did not refuse, and the legacy calls of those it did not know
    (kept until its ``GpuState.epoch`` moves)."""

    fields: list[Field]
    asked: list[Field] = field(default_factory=list)
    keys: list[tuple[int, int]] = field(default_factory=list)
    legacy: list[Field] = field(default_factory=list)
    epoch: int = -1


@dataclass
class GpuState:
    """What the read thread keeps per GPU: labels built once, links, and sampling state."""

    identity: GpuIdentity
    labels: dict[str, str]
    info: dict[str, str]
    by_label: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    links: tuple[Link, ...] = ()
    fast: Batch = field(default_factory=lambda: Batch([]))
    """Fields read every cycle, in one nvmlDeviceGetFieldValues."""
    health_fields: Batch = field(default_factory=lambda: Batch([]))
    """Fields read every health interval, in one nvmlDeviceGetFieldValues."""
    violations: tuple[tuple[str, tuple[int, int]], ...] = ()
    """(reason, field key) of the throttle reasons NVML counts itself."""
    unknown: set[tuple[int, int]] = field(default_factory=set)
    """Fields the GPU answered "not supported" (or whose id the driver does not know): left
    out of the batch, read through their legacy call if they have one, asked again every
    ``UNSUPPORTED_RETRY_READS`` reads (a driver update or a MIG change may add them)."""
    no_legacy: set[tuple[int, int]] = field(default_factory=set)
    """Unknown fields whose legacy call is not supported either."""
    epoch: int = 0
    """Moves on whenever ``unknown`` or ``no_legacy`` change."""
    refused_counters: set[tuple[int, int]] = field(default_factory=set)
    """(link, NVML_NVLINK_ERROR_*) NVLink error counters the GPU does not support."""
    gpm: GpmState | None = None
    reasons_seen_at: float | None = None
    integrated_s: dict[str, float] = field(default_factory=dict)
    mig_slots: int | None = None
    mig: dict[tuple[int, str], MigDevice] = field(default_factory=dict)
    mig_unsupported: bool = False
    """The GPU answered "not supported" to nvmlDeviceGetMigMode (a GPU without MIG): not asked
    again until the retry read."""
    slow: list[Reading] = field(default_factory=list)
    """The last slow readings, repeated until ``slow_at`` + the slow interval."""
    slow_at: float = -math.inf
    health: list[Reading] = field(default_factory=list)
    """The last health readings, repeated until ``health_at`` + the health interval."""
    health_at: float = -math.inf
    reads: int = 0

    def labelled(self, key: str, value: str) -> dict[str, str]:
        """The GPU's labels plus ``key=value``, built once and shared by every reading."""
        values = self.by_label.get(key)
        if values is None:
            values = self.by_label[key] = {}
        found = values.get(value)
        if found is None:
            found = values[value] = {**self.labels, key: value}
        return found

    def refused(self, key: tuple[int, int], legacy_too: bool = False) -> None:
        """The GPU does not support (or know) field ``key``; with ``legacy_too``, nor the
        field's legacy call."""
        (self.no_legacy if legacy_too else self.unknown).add(key)
        self.epoch += 1

    def retry_refused(self) -> None:
        """Ask again everything the GPU refused."""
        self.unknown.clear()
        self.no_legacy.clear()
        self.refused_counters.clear()
        self.mig_unsupported = False
        self.epoch += 1

    def forget_sampling(self) -> None:
        """Drop two-sample and repeated state after a failed read, so an outage is not
        integrated and the next read asks everything again."""
        self.reasons_seen_at = None
        self.health_at = self.slow_at = -math.inf
        if self.gpm is not None:
            self.gpm.latest = None


def refresh(batch: Batch, state: GpuState) -> None:
    """Bring ``batch``'s asked fields and legacy calls up to what ``state`` knows."""
    if batch.epoch == state.epoch:
        return
    unknown, no_legacy = state.unknown, state.no_legacy
    batch.asked = [f for f in batch.fields if f.key not in unknown]
    batch.keys = [f.key for f in batch.asked]
    batch.legacy = [
        f
        for f in batch.fields
        if f.legacy is not None and f.key in unknown and f.key not in no_legacy
    ]
    batch.epoch = state.epoch
