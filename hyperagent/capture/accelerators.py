"""Recorded accelerator state, vendor-neutral, and the simulated device a fake library serves.

`AcceleratorRecord` holds what one device's tool output says (amd-smi, rocm-smi, hl-smi), in
base units; the parsers beside it (`amd_smi`, `hl_smi`) turn each tool's text into records.
`SimulatedDevice` is one recorded device as a fake vendor library serves it: a power limit
that holds the draw, an energy counter integrating that draw over the fake's clock, and a load
a simulator may change (the demo's training job).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")


class CaptureFormatError(ValueError):
    """A capture file that does not parse as its name says: the message names the file, the
    line where known and the format expected."""


def read_capture(path: Path, expected: str, parse: Callable[[str], _T]) -> _T:
    """``parse`` of the text of ``path``; a file that does not parse (or is not text) raises
    CaptureFormatError naming ``path`` and the ``expected`` format."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        detail = str(e) if not isinstance(e, KeyError) else f"no {e} field"
        raise CaptureFormatError(f"{path}: {detail} (expected {expected})") from e


@dataclass(frozen=True)
class AcceleratorRecord:
    """One device as its tool reported it; None: the tool did not say."""

    index: int
    vendor: str
    model: str
    uuid: str = ""
    bus_id: str = ""
    driver: str = ""
    util_pct: float | None = None
    mem_util_pct: float | None = None
    power_w: float | None = None
    energy_j: float | None = None
    """The tool's energy counter at the capture, where it has one."""
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    temp_c: float | None = None
    mem_temp_c: float | None = None
    clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    power_cap_w: float | None = None
    min_power_cap_w: float | None = None
    max_power_cap_w: float | None = None
    default_power_cap_w: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    compute_partition: str = ""
    memory_partition: str = ""
    vendor_id: str = ""
    device_id: str = ""
    """The PCI vendor and device ids, where the tool gives them (``0x1002``, ``0x74a1``)."""


def number(text: str | None) -> float | None:
    """A tool's number ("36.0", "N/A", "(300Mhz)", "512 MiB"): the first number in it, else None."""
    if text is None:
        return None
    digits = ""
    for ch in str(text).strip().lstrip("("):
        if ch.isdigit() or ch in ".-" or (ch in "eE" and digits):
            digits += ch
        elif digits:
            break
    try:
        value = float(digits)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class SimulatedDevice:
    """One recorded device, served by a fake library: draw under the limit, energy integrated.

    The draw is the recorded (or `set_load`) power, held under the power cap in force; the
    energy counter starts at the recorded one (0 where the tool has none) and integrates that
    draw over ``clock`` seconds, piecewise at every read and before every change.
    """

    def __init__(self, record: AcceleratorRecord, clock: Callable[[], float]) -> None:
        self.record = record
        self.clock = clock
        self.energy_j = record.energy_j or 0.0
        self.integrated_to = clock()

    def draw_w(self) -> float | None:
        draw, cap = self.record.power_w, self.record.power_cap_w
        if draw is None or cap is None:
            return draw
        return min(draw, cap)

    def integrate(self) -> float:
        """The energy counter now, in joules."""
        now = self.clock()
        draw = self.draw_w()
        if draw is not None:
            self.energy_j += draw * max(0.0, now - self.integrated_to)
        self.integrated_to = max(now, self.integrated_to)
        return self.energy_j

    def set_cap(self, watts: float) -> None:
        self.integrate()
        self.record = replace(self.record, power_cap_w=watts)

    def set_load(self, util_pct: float | None = None, power_w: float | None = None) -> None:
        """What the device reports from now on (None: unchanged)."""
        if util_pct is not None and not 0.0 <= util_pct <= 100.0:
            raise ValueError(f"util_pct must be within [0, 100], got {util_pct}")
        if power_w is not None and power_w < 0:
            raise ValueError(f"power_w must be >= 0, got {power_w}")
        self.integrate()
        if util_pct is not None:
            self.record = replace(self.record, util_pct=util_pct)
        if power_w is not None:
            self.record = replace(self.record, power_w=power_w)


class SimulatedLibrary:
    """What the fake vendor libraries share besides their API: the simulated devices, a lock,
    a count of calls per function, and the controls a test or a replay drives (not vendor API)."""

    devices: list[SimulatedDevice]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()

    def call_counts(self) -> dict[str, int]:
        """How many times each vendor function was called."""
        with self._lock:
            return dict(self._calls)

    def set_load(
        self, index: int, util_pct: float | None = None, power_w: float | None = None
    ) -> None:
        """What device ``index`` reports from now on (None: unchanged)."""
        with self._lock:
            self.devices[index].set_load(util_pct, power_w)

    def power_cap_w(self, index: int) -> float | None:
        """The power cap in force on device ``index``."""
        return self.devices[index].record.power_cap_w
