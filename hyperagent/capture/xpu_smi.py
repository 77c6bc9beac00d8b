"""Intel Data Center GPU Max through ``xpu-smi`` captures, and the fake ``xpu-smi`` replaying
them.

A capture directory holds ``xpu-smi-dump.csv`` (``xpu-smi dump -d -1 -m 0,1,2,3,4,8,17,18 -n
1``) and ``xpu-smi-discovery.json`` (``xpu-smi discovery -j``); ``xpu-smi-power-limits.json``
(``{"min_w", "max_w", "limit_w"}``) where the power limit was not recorded. `FakeXpuSmi`
answers both commands from the recorded devices as the tool prints them, under the load a
replay or the demo sets (draw under the limit, the energy counter integrating it), so the text
source reads the fake through its own parser. xpu-smi is read for telemetry only: nothing
sets a power limit through it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hyperagent.capture.accelerators import (
    AcceleratorRecord,
    SimulatedDevice,
    SimulatedLibrary,
    read_capture,
)
from hyperagent.devices import metrics
from hyperagent.readings import Reading
from hyperagent.sources import smi_text

DUMP_FILE = smi_text.CAPTURE_FILES["xpu_smi"]
DISCOVERY_FILE = smi_text.IDENTITY_FILES["xpu_smi"]
LIMITS_FILE = "xpu-smi-power-limits.json"
MIB = 1024 * 1024
_DUMP_HEADER = (
    "Timestamp, DeviceId, GPU Utilization (%), GPU Power (W), GPU Frequency (MHz),"
    " GPU Core Temperature (Celsius Degree), GPU Memory Temperature (Celsius Degree),"
    " GPU Energy Consumed (J), GPU Memory Bandwidth Utilization (%), GPU Memory Used (MiB)"
)


def _records(readings: Sequence[Reading]) -> list[AcceleratorRecord]:
    """The devices the text source's parser read, as records."""
    by_gpu: dict[str, dict[str, Any]] = {}
    for r in readings:
        found = by_gpu.setdefault(r.labels["gpu"], {})
        found["info" if r.name == metrics.GPU_INFO else r.name] = (
            r.labels if r.name == metrics.GPU_INFO else r.value
        )
    out = []
    for gpu, found in sorted(by_gpu.items(), key=lambda item: int(item[0])):
        info = found.get("info", {})

        def get(name: str, scale: float = 1.0, found: dict[str, Any] = found) -> float | None:
            value = found.get(name)
            return None if value is None else value / scale

        out.append(
            AcceleratorRecord(
                index=int(gpu),
                vendor="intel",
                model=info.get("model", ""),
                uuid=info.get("uuid", ""),
                bus_id=info.get("bus_id", ""),
                driver=info.get("driver", ""),
                util_pct=get(metrics.UTILIZATION, 0.01),
                mem_util_pct=get(metrics.MEMORY_UTILIZATION, 0.01),
                power_w=get(metrics.POWER),
                energy_j=get(metrics.ENERGY),
                mem_used_bytes=get(metrics.MEMORY_USED),
                mem_total_bytes=get(metrics.MEMORY_TOTAL),
                temp_c=get(metrics.TEMPERATURE),
                mem_temp_c=get(metrics.MEMORY_TEMPERATURE),
                clock_mhz=get(metrics.SM_CLOCK, 1e6),
            )
        )
    return out


def load_capture(directory: Path) -> list[AcceleratorRecord]:
    """The devices of an xpu-smi capture directory; [] where it holds no dump."""
    dump = directory / DUMP_FILE
    if not dump.is_file():
        return []
    discovery_path = directory / DISCOVERY_FILE
    discovery = None
    if discovery_path.is_file():
        read_capture(discovery_path, "xpu-smi discovery -j", smi_text.parse_xpu_smi_discovery)
        discovery = discovery_path.read_text(encoding="utf-8")
    readings = read_capture(
        dump, "xpu-smi dump ... CSV", lambda text: smi_text.parse_xpu_smi_dump(text, discovery)
    )
    records = _records(readings)
    limits_path = directory / LIMITS_FILE
    if not limits_path.is_file():
        return records
    limits = read_capture(limits_path, "a JSON object of min_w, max_w, limit_w", json.loads)
    return [
        replace(
            r,
            min_power_cap_w=float(limits["min_w"]),
            max_power_cap_w=float(limits["max_w"]),
            power_cap_w=float(limits["limit_w"]),
            default_power_cap_w=float(limits["limit_w"]),
        )
        for r in records
    ]


def _cell(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


class FakeXpuSmi(SimulatedLibrary):
    """``xpu-smi discovery -j`` and ``xpu-smi dump`` over recorded devices, as the tool
    prints them (`run` is a RunCommand for the text source); telemetry only."""

    def __init__(
        self, records: list[AcceleratorRecord], clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.clock = clock
        self.devices = [SimulatedDevice(r, clock) for r in records]

    @classmethod
    def from_capture(cls, directory: Path, **kwargs: Any) -> FakeXpuSmi:
        records = load_capture(directory)
        if not records:
            raise ValueError(f"{directory}: no {DUMP_FILE}")
        return cls(records, **kwargs)

    async def run(self, argv: Sequence[str]) -> str:
        """What ``xpu-smi`` prints for ``argv`` (``discovery -j``, or ``dump ...``)."""
        command = argv[1] if len(argv) > 1 else ""
        with self._lock:
            self._calls[command] += 1
            if command == "discovery":
                return self._discovery()
            if command == "dump":
                return self._dump()
        raise ValueError(f"xpu-smi {command}: not a command this fake answers")

    def _discovery(self) -> str:
        devices = [
            {
                "device_function_type": "physical",
                "device_id": d.record.index,
                "device_name": d.record.model,
                "device_type": "GPU",
                "pci_bdf_address": d.record.bus_id,
                "uuid": d.record.uuid,
                "vendor_name": "Intel(R) Corporation",
                **(
                    {"memory_physical_size_byte": str(int(d.record.mem_total_bytes))}
                    if d.record.mem_total_bytes is not None
                    else {}
                ),
            }
            for d in self.devices
        ]
        return json.dumps({"device_list": devices}, indent=4)

    def _dump(self) -> str:
        stamp = time.strftime("%H:%M:%S.000", time.gmtime(self.clock()))
        rows = [_DUMP_HEADER]
        for d in self.devices:
            r = d.record
            used = None if r.mem_used_bytes is None else r.mem_used_bytes / MIB
            rows.append(
                ", ".join(
                    (
                        stamp,
                        f"{r.index:4d}",
                        _cell(r.util_pct),
                        _cell(d.draw_w()),
                        _cell(r.clock_mhz, 0),
                        _cell(r.temp_c),
                        _cell(r.mem_temp_c),
                        _cell(d.integrate()),
                        _cell(r.mem_util_pct),
                        _cell(used),
                    )
                )
            )
        return "\n".join(rows) + "\n"
