"""Parser of ``hl-smi -Q <fields> -f csv`` (Intel Gaudi's tool) into `AcceleratorRecord`s, for
replay through FakeHlml.

hl-smi's CSV names its fields as ``--query-aip`` does (``name``, ``uuid``, ``bus_id``,
``power.draw [W]``, ``temperature.aip [C]``, ``utilization.aip [%]``, ``memory.used [MiB]``,
``memory.total [MiB]``, ``clocks.current.soc [MHz]``...); any subset, in any order. A capture
directory holds ``hl-smi.csv``, and, where the power limits were not in the query,
``hlml-power-limits.json`` (``{"min_w", "max_w", "limit_w"}``).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path

from hyperagent.capture.accelerators import AcceleratorRecord, number

CAPTURE_FILE = "hl-smi.csv"
LIMITS_FILE = "hlml-power-limits.json"
MIB = 1024 * 1024


def parse_hl_smi_csv(text: str) -> list[AcceleratorRecord]:
    """One record per data row; the header names the fields."""
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text)) if row]
    if not rows:
        return []
    header = [name.split(" [")[0].strip().lower() for name in rows[0]]
    out = []
    for position, row in enumerate(rows[1:]):
        field = dict(zip(header, row, strict=False))

        def mib(name: str, field: dict[str, str] = field) -> float | None:
            value = number(field.get(name))
            return None if value is None else value * MIB

        index = number(field.get("index"))
        out.append(
            AcceleratorRecord(
                index=position if index is None else int(index),
                vendor="intel",
                model=field.get("name", ""),
                uuid=field.get("uuid", ""),
                bus_id=field.get("bus_id", ""),
                driver=field.get("driver_version", ""),
                util_pct=number(field.get("utilization.aip")),
                power_w=number(field.get("power.draw")),
                mem_used_bytes=mib("memory.used"),
                mem_total_bytes=mib("memory.total"),
                temp_c=number(field.get("temperature.aip")),
                clock_mhz=number(field.get("clocks.current.soc")),
                power_cap_w=number(field.get("power.limit")),
            )
        )
    return out


def load_capture(directory: Path) -> list[AcceleratorRecord]:
    """The Gaudi devices of a capture directory, with its written power limits if any."""
    path = directory / CAPTURE_FILE
    if not path.is_file():
        return []
    records = parse_hl_smi_csv(path.read_text(encoding="utf-8"))
    limits_path = directory / LIMITS_FILE
    if not limits_path.is_file():
        return records
    limits = json.loads(limits_path.read_text(encoding="utf-8"))
    return [
        replace(
            r,
            min_power_cap_w=float(limits["min_w"]),
            max_power_cap_w=float(limits["max_w"]),
            power_cap_w=r.power_cap_w or float(limits["limit_w"]),
            default_power_cap_w=float(limits.get("default_w", limits["limit_w"])),
        )
        for r in records
    ]
