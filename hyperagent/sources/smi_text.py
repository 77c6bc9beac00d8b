"""Huawei Ascend (``npu-smi info``) and Cambricon (``cnmon``) read from their tools' tables:
telemetry only.

Neither vendor ships a Python binding the agent could call without its SDK, and their tools
print no energy counter and set no power cap here: these sources give instant power,
utilisation, memory, temperature and identity (``hyperagent_gpu_*`` with ``vendor="huawei"``
or ``"cambricon"``), and the power-cap actuator leaves such nodes alone.

``parse_npu_smi_info`` reads the two-line-per-chip table of ``npu-smi info`` (NPU id and name,
health, power W, temperature C, then chip, bus id, AICore %, memory and HBM usage in MB);
``parse_cnmon`` the two-line-per-card table of ``cnmon`` (card, name, firmware, bus id,
utilisation, then fan, temperature, power usage/cap in W, memory usage in MiB).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from hyperagent.devices.metrics import (
    GPU_INFO,
    MEMORY_TOTAL,
    MEMORY_USED,
    POWER,
    POWER_LIMIT,
    TEMPERATURE,
    UTILIZATION,
)
from hyperagent.readings import Kind, Reading
from hyperagent.sources import command

MIB = 1024 * 1024
COMMANDS = {"npu_smi": ("npu-smi", "info"), "cnmon": ("cnmon",)}
"""Each text source's default command line."""
CAPTURE_FILES = {"npu_smi": "npu-smi-info.txt", "cnmon": "cnmon.txt"}
"""A capture directory's file of each tool's output."""
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


PARSERS = {"npu_smi": parse_npu_smi_info, "cnmon": parse_cnmon}


class SmiTextSource:
    """Runs the tool (``command``, default `COMMANDS[name]`) each read and parses its table;
    with ``capture``, reads that file instead (replay). A tool that is not installed means no
    such devices (up 0)."""

    target = "local"

    def __init__(
        self,
        name: str,
        argv: Sequence[str] = (),
        *,
        timeout_s: float = 1.5,
        capture: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = tuple(argv) or COMMANDS[name]
        self.timeout_s = timeout_s
        self.capture = capture
        self.parse = PARSERS[name]

    async def start(self) -> None:
        return None

    async def read(self) -> list[Reading]:
        if self.capture is not None:
            name = self.capture.name
            runner = command.capture_runner(self.capture.parent, lambda argv: name)
            text = await runner(self.argv)
        else:
            text = await command.run_command(self.argv, self.timeout_s)
        return self.parse(text)

    async def close(self) -> None:
        return None
