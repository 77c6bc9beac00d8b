"""Parser of ``hl-smi -Q <fields> -f csv`` (Intel Gaudi's tool) into `AcceleratorRecord`s, for
replay through FakeHlml.

hl-smi's CSV names its fields as ``--query-aip`` does (``name``, ``uuid``, ``bus_id``,
``power.draw [W]``, ``temperature.aip [C]``, ``utilization.aip [%]``, ``memory.used [MiB]``,
``memory.total [MiB]``, ``clocks.current.soc [MHz]``...); any subset, in any order. Values may
carry their units (``131072 MiB``, ``226 W``, ``36 C``, ``0 %``), as ``-f csv`` prints them. A
capture directory holds ``hl-smi.csv``; where it was taken with ``-f csv,noheader`` (what
monitoring scripts run), ``hl-smi-fields.txt`` holds the ``-Q`` field list it was taken with
(``index,uuid,name,...``), since a headerless CSV names no field; without that file, a
headerless CSV whose rows hold as many values as `DEFAULT_FIELDS` is read by that list. Where
the power limits were not in the query, ``hlml-power-limits.json`` (``{"min_w", "max_w",
"limit_w"}``).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hyperagent.capture.accelerators import AcceleratorRecord, number, read_capture

CAPTURE_FILE = "hl-smi.csv"
FIELDS_FILE = "hl-smi-fields.txt"
_FIELD = re.compile(r"^[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*(?:\s*\[[^\]]*\])?$")
LIMITS_FILE = "hlml-power-limits.json"
DEFAULT_FIELDS = (
    "index",
    "uuid",
    "name",
    "driver_version",
    "memory.total",
    "memory.used",
    "memory.free",
    "power.draw",
    "power.max",
    "temperature.aip",
    "utilization.aip",
)
"""The ``-Q`` list a monitoring tool runs ``hl-smi -f csv,noheader`` with when none is given:
all-smi's default (lablup/all-smi ``src/device/hlsmi/config.rs``, Apache-2.0). hl-smi itself
has no default list: ``-Q`` takes one."""
MIB = 1024 * 1024


def is_header(row: Sequence[str]) -> bool:
    """Whether a CSV row names fields (``power.draw [W]``) rather than holding values
    (``HL-205``, ``226 W``): every cell a lower-case dotted field name."""
    return bool(row) and all(_FIELD.match(cell.strip()) for cell in row)


def parse_hl_smi_csv(text: str, fields: Sequence[str] | None = None) -> list[AcceleratorRecord]:
    """One record per data row. The first row names the fields where it is a header; else
    ``fields`` (the ``-Q`` list) does. Raises ValueError naming the line for a headerless CSV
    without ``fields`` and for a row of another width than the fields."""
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text)) if row]
    if not rows:
        return []
    first = 1
    if is_header(rows[0]):
        names = rows[0]
    elif fields:
        names, first = list(fields), 0
    elif len(rows[0]) == len(DEFAULT_FIELDS):
        names, first = list(DEFAULT_FIELDS), 0
    else:
        raise ValueError(
            f"line 1 holds values, not a header ({', '.join(rows[0][:3])}, ...): expected "
            f"hl-smi -Q FIELDS -f csv, or -f csv,noheader with the -Q list in {FIELDS_FILE} "
            f"(or {len(DEFAULT_FIELDS)} values a row: {','.join(DEFAULT_FIELDS)})"
        )
    header = [name.split(" [")[0].strip().lower() for name in names]
    out = []
    for position, row in enumerate(rows[first:]):
        if len(row) != len(header):
            raise ValueError(
                f"line {position + first + 1} has {len(row)} values for {len(header)} fields"
                f" ({', '.join(header)})"
            )
        field = dict(zip(header, row, strict=True))

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
                power_cap_w=number(field.get("power.limit") or field.get("power.max")),
            )
        )
    return out


def load_capture(directory: Path) -> list[AcceleratorRecord]:
    """The Gaudi devices of a capture directory, with its written power limits if any."""
    path = directory / CAPTURE_FILE
    if not path.is_file():
        return []
    fields_path = directory / FIELDS_FILE
    fields = None
    if fields_path.is_file():
        listed = fields_path.read_text(encoding="utf-8").replace("\n", ",").split(",")
        fields = [name.strip() for name in listed if name.strip()]
    records = read_capture(
        path, "hl-smi -Q FIELDS -f csv[,noheader]", lambda text: parse_hl_smi_csv(text, fields)
    )
    limits_path = directory / LIMITS_FILE
    if not limits_path.is_file():
        return records
    limits = read_capture(limits_path, "a JSON object of min_w, max_w, limit_w", json.loads)
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
