"""Huawei Ascend (``npu-smi info``), Cambricon (``cnmon``) and Intel Data Center GPU Max
(``xpu-smi``) read from their tools' output: telemetry only.

Neither vendor ships a Python binding the agent could call without its SDK, and their tools
print no energy counter and set no power cap here: these sources give instant power,
utilisation, memory, temperature and identity (``hyperagent_gpu_*`` with ``vendor="huawei"``
or ``"cambricon"``), and the power-cap actuator leaves such nodes alone.

``parse_npu_smi_info`` reads the two-line-per-chip table of ``npu-smi info`` (NPU id and name,
health, power W, temperature C, then chip, bus id, AICore %, memory and HBM usage in MB);
``parse_cnmon`` the two-line-per-card table of ``cnmon`` (card, name, firmware, bus id,
utilisation, then fan, temperature, power usage/cap in W, memory usage in MiB);
``parse_xpu_smi_dump`` the CSV of ``xpu-smi dump`` (a ``DeviceId`` column and one per metric,
named as xpu-smi names them: ``GPU Utilization (%)``, ``GPU Power (W)``, ``GPU Frequency
(MHz)``, ``GPU Core Temperature (Celsius Degree)``, ``GPU Memory Temperature (Celsius
Degree)``, ``GPU Energy Consumed (J)``, ``GPU Memory Bandwidth Utilization (%)``, ``GPU Memory
Used (MiB)``; an empty cell is a metric the device does not give), with each device's
identity (name, UUID, PCI address, memory size) from ``xpu-smi discovery -j``, run once.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import hyperagent.sources.command as command
from hyperagent.devices.metrics import (
    ENERGY,
    GPU_INFO,
    MEMORY_TEMPERATURE,
    MEMORY_TOTAL,
    MEMORY_USED,
    MEMORY_UTILIZATION,
    POWER,
    POWER_LIMIT,
    SM_CLOCK,
    TEMPERATURE,
    UTILIZATION,
)
from hyperagent.errors import SourceError
from hyperagent.readings import Kind, Reading

log = logging.getLogger(__name__)

MIB = 1024 * 1024
COMMANDS = {
    "npu_smi": ("npu-smi", "info"),
    "cnmon": ("cnmon",),
    "xpu_smi": ("xpu-smi", "dump", "-d", "-1", "-m", "0,1,2,3,4,8,17,18", "-n", "1"),
}
"""Each text source's default command line."""
CAPTURE_FILES = {"npu_smi": "npu-smi-info.txt", "cnmon": "cnmon.txt", "xpu_smi": "xpu-smi-dump.csv"}
"""A capture directory's file of each tool's output."""
ENERGY_TOOLS = frozenset({"xpu_smi"})
"""The tools whose output holds each device's energy counter."""
IDENTITY_COMMANDS = {"xpu_smi": ("xpu-smi", "discovery", "-j")}
"""The command naming a tool's devices, run once, where its readings do not name them."""
IDENTITY_FILES = {"xpu_smi": "xpu-smi-discovery.json"}
"""A capture directory's file of that command's output."""
_ROW = re.compile(r"^\|(.*)\|$")


def _cells(line: str) -> list[str] | None:
    """The ``|``-separated cells of a table row, or None for a rule or other line."""
    found = _ROW.match(line.strip())
    if found is None or set(found.group(1)) <= set("=-+ "):
        return None
    return [cell.strip() for cell in found.group(1).split("|")]


def _used_total(text: str) -> tuple[float, float] | None:
    """``"3317 / 65536"`` or ``"0 MiB/ 23374 MiB"`` as (used, total)."""
    numbers = re.findall(r"\d+(?:\.\d+)?", text)
    if len(numbers) < 2:
        return None
    return float(numbers[0]), float(numbers[1])


def _device_readings(
    index: int,
    uuid: str,
    vendor: str,
    model: str,
    driver: str,
    values: dict[str, float | None],
) -> list[Reading]:
    labels = {"gpu": str(index), "uuid": uuid}
    info = {**labels, "model": model, "driver": driver, "vendor": vendor, "bus_id": uuid}
    out = [Reading(GPU_INFO, 1.0, info, Kind.INFO)]
    for name, value in values.items():
        if value is not None:
            out.append(Reading(name, value, labels))
    return out


def parse_npu_smi_info(text: str) -> list[Reading]:
    """Readings of every chip of an ``npu-smi info`` table (see the module docstring)."""
    version = re.search(r"Version:\s*(\S+)", text)
    driver = version.group(1) if version else ""
    rows = [cells for cells in map(_cells, text.splitlines()) if cells and len(cells) == 3]
    out: list[Reading] = []
    first: list[str] | None = None
    index = 0
    for cells in rows:
        head = cells[0].split()
        if first is None:
            if len(head) >= 2 and head[0].isdigit():
                first = cells
            continue
        first_row, first = first, None
        if ":" not in cells[1]:
            continue
        head = first_row[0].split()
        power_temp = first_row[2].split()
        usage = cells[2]
        pairs = re.findall(r"\d+(?:\.\d+)?\s*/\s*\d+(?:\.\d+)?", usage)
        hbm = _used_total(pairs[-1]) if pairs else None
        aicore = re.match(r"\s*(\d+(?:\.\d+)?)", usage)
        out += _device_readings(
            index,
            cells[1],
            "huawei",
            f"Ascend {head[1]}",
            driver,
            {
                POWER: _float(power_temp[0]) if power_temp else None,
                TEMPERATURE: _float(power_temp[1]) if len(power_temp) > 1 else None,
                UTILIZATION: None if aicore is None else float(aicore.group(1)) / 100,
                MEMORY_USED: None if hbm is None else hbm[0] * MIB,
                MEMORY_TOTAL: None if hbm is None else hbm[1] * MIB,
            },
        )
        index += 1
    return out


def parse_cnmon(text: str) -> list[Reading]:
    """Readings of every card of a ``cnmon`` table (see the module docstring)."""
    version = re.search(r"Driver\s+v(\S+)", text)
    driver = version.group(1) if version else ""
    rows = [cells for cells in map(_cells, text.splitlines()) if cells and len(cells) == 3]
    out: list[Reading] = []
    first: list[str] | None = None
    for cells in rows:
        head = cells[0].split()
        if first is None:
            if head and head[0].isdigit() and ":" in cells[1]:
                first = cells
            continue
        first_row, second = first, cells
        first = None
        head = first_row[0].split()
        card = int(head[0])
        name = head[2] if len(head) > 2 else ""
        power = re.search(r"(\d+(?:\.\d+)?)\s*W\s*/\s*(\d+(?:\.\d+)?)\s*W", second[0])
        temp = re.search(r"(\d+(?:\.\d+)?)C", second[0])
        util = re.match(r"(\d+(?:\.\d+)?)%", first_row[2])
        memory = _used_total(second[1])
        out += _device_readings(
            card,
            first_row[1],
            "cambricon",
            f"Cambricon {name}".strip(),
            driver,
            {
                POWER: None if power is None else float(power.group(1)),
                POWER_LIMIT: None if power is None else float(power.group(2)),
                TEMPERATURE: None if temp is None else float(temp.group(1)),
                UTILIZATION: None if util is None else float(util.group(1)) / 100,
                MEMORY_USED: None if memory is None else memory[0] * MIB,
                MEMORY_TOTAL: None if memory is None else memory[1] * MIB,
            },
        )
    return out


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


_XPU_COLUMNS = {
    "gpu utilization (%)": (UTILIZATION, 0.01),
    "gpu power (w)": (POWER, 1.0),
    "gpu frequency (mhz)": (SM_CLOCK, 1e6),
    "gpu core temperature (celsius degree)": (TEMPERATURE, 1.0),
    "gpu core temperature (celsius)": (TEMPERATURE, 1.0),
    "gpu memory temperature (celsius degree)": (MEMORY_TEMPERATURE, 1.0),
    "gpu memory temperature (celsius)": (MEMORY_TEMPERATURE, 1.0),
    "gpu memory bandwidth utilization (%)": (MEMORY_UTILIZATION, 0.01),
    "gpu memory bandwidth utilization. (%)": (MEMORY_UTILIZATION, 0.01),
    "gpu memory used (mib)": (MEMORY_USED, float(MIB)),
}
_XPU_ENERGY = "gpu energy consumed (j)"


def parse_xpu_smi_discovery(text: str) -> dict[int, dict[str, str]]:
    """Device id -> identity labels (``model``, ``uuid``, ``bus_id``, ``driver``, and
    ``memory_total`` in bytes where given) of ``xpu-smi discovery -j``'s ``device_list``; its
    virtual functions and devices other than GPUs are left out."""
    data = json.loads(text)
    devices = data.get("device_list", []) if isinstance(data, dict) else data
    out: dict[int, dict[str, str]] = {}
    for device in devices:
        if str(device.get("device_type", "GPU")) != "GPU":
            continue
        if str(device.get("device_function_type", "physical")) != "physical":
            continue
        out[int(device["device_id"])] = {
            "model": str(device.get("device_name", "")),
            "uuid": str(device.get("uuid", "")),
            "bus_id": str(device.get("pci_bdf_address", "")).lower(),
            "driver": str(device.get("driver_version", "")),
            "memory_total": str(device.get("memory_physical_size_byte", "")),
        }
    return out


def parse_xpu_smi_dump(text: str, discovery: str | None = None) -> list[Reading]:
    """Readings of every device of an ``xpu-smi dump`` CSV (its last row per device, the
    device-level rows where it has tile rows too), named by ``discovery`` (``xpu-smi discovery
    -j``'s output) where given. Raises ValueError naming the line of a row of another width."""
    rows = [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if any(r)]
    if not rows:
        return []
    header = [cell.strip().lower() for cell in rows[0]]
    if "deviceid" not in header:
        raise ValueError(f"line 1 has no DeviceId column: {', '.join(rows[0][:4])}")
    latest: dict[int, dict[str, str]] = {}
    for number, row in enumerate(rows[1:], 2):
        if len(row) != len(header):
            raise ValueError(f"line {number} has {len(row)} values for {len(header)} columns")
        cells = dict(zip(header, (cell.strip() for cell in row), strict=True))
        if cells.get("tileid"):
            continue
        latest[int(cells["deviceid"])] = cells
    names = parse_xpu_smi_discovery(discovery) if discovery else {}
    out: list[Reading] = []
    for device, cells in sorted(latest.items()):
        found = names.get(device, {})
        uuid = found.get("uuid") or f"xpu-{device}"
        labels = {"gpu": str(device), "uuid": uuid}
        info = {
            **labels,
            "model": found.get("model", ""),
            "driver": found.get("driver", ""),
            "vendor": "intel",
        }
        if found.get("bus_id"):
            info["bus_id"] = found["bus_id"]
        out.append(Reading(GPU_INFO, 1.0, info, Kind.INFO))
        for column, (name, scale) in _XPU_COLUMNS.items():
            value = _float(cells.get(column, ""))
            if value is not None:
                out.append(Reading(name, value * scale, labels))
        total = _float(found.get("memory_total", ""))
        if total is not None:
            out.append(Reading(MEMORY_TOTAL, total, labels))
        energy = _float(cells.get(_XPU_ENERGY, ""))
        if energy is not None:
            out.append(Reading(ENERGY, energy, labels, Kind.COUNTER))
    return out


PARSERS: dict[str, Callable[[str, str | None], list[Reading]]] = {
    "npu_smi": lambda text, _: parse_npu_smi_info(text),
    "cnmon": lambda text, _: parse_cnmon(text),
    "xpu_smi": parse_xpu_smi_dump,
}


class SmiTextSource:
    """Runs the tool (``command``, default `COMMANDS[name]`) each read and parses its output,
    after its identity command (`IDENTITY_COMMANDS`) once where it has one; with ``capture``,
    reads that file (and the identity file beside it) instead (replay), with ``runner`` asks
    it (a fake of the tool: hyperagent.capture.xpu_smi). A tool that is not installed means
    no such devices (up 0)."""

    target = "local"

    def __init__(
        self,
        name: str,
        argv: Sequence[str] = (),
        *,
        timeout_s: float = 1.5,
        capture: Path | None = None,
        runner: command.RunCommand | None = None,
    ) -> None:
        self.name = name
        self.argv = tuple(argv) or COMMANDS[name]
        self.timeout_s = timeout_s
        self.capture = capture
        self.runner = runner
        self.parse = PARSERS[name]
        self.identity_argv = IDENTITY_COMMANDS.get(name)
        """The command naming the devices, run before the first read (None: the readings name
        them)."""
        self._identity: str | None = None
        """The output of the tool's identity command (``IDENTITY_COMMANDS``), run once."""

    async def start(self) -> None:
        return None

    async def _run(self, argv: Sequence[str], capture: str) -> str:
        if self.runner is not None:
            return await self.runner(argv)
        if self.capture is not None:
            runner = command.capture_runner(self.capture.parent, lambda argv: capture)
            return await runner(argv)
        return await command.run_command(argv, self.timeout_s)

    async def read(self) -> list[Reading]:
        identity = self.identity_argv
        if identity is not None and self._identity is None:
            try:
                self._identity = await self._run(identity, IDENTITY_FILES[self.name])
            except command.CaptureMissing:
                self._identity = ""  # a capture of the readings alone: devices unnamed
        capture = "" if self.capture is None else self.capture.name
        return self.parse(await self._run(self.argv, capture), self._identity)

    @property
    def counts_energy(self) -> bool:
        """Whether the tool reports an energy counter (xpu-smi does)."""
        return self.name in ENERGY_TOOLS

    async def total_energy_j(self, indices: Collection[int] | None = None) -> float | None:
        """Sum of the energy counters of the devices whose index is in ``indices`` (None: every
        device), the tool run now; None where one has none or the tool fails."""
        try:
            readings = await self.read()
        except (SourceError, ValueError) as e:
            log.debug("%s: no energy reading: %s", self.name, e)
            return None
        devices = {r.labels["gpu"] for r in readings if r.name == GPU_INFO}
        if indices is not None:
            devices &= {str(i) for i in indices}
            if len(devices) != len(indices):
                return None
        energy = {
            r.labels["gpu"]: r.value
            for r in readings
            if r.name == ENERGY and r.labels["gpu"] in devices
        }
        if not devices or set(energy) != devices:
            return None
        return sum(energy.values())

    async def close(self) -> None:
        return None
