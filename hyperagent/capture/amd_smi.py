"""Parsers of AMD's tools' output into `AcceleratorRecord`s, for replay through FakeAmdsmi.

- ``amd-smi metric --csv`` (one row per device: activity, socket power in W, clocks in MHz,
  temperatures in degrees C, ECC totals, total energy in J, VRAM in MiB as amd-smi prints "MB");
- ``amd-smi metric --json``: the same readings, one object per device (``usage``, ``power``,
  ``clock``, ``temperature``, ``ecc``, ``energy``, ``mem_usage`` sections of ``{"value",
  "unit"}`` pairs), as a list or under ``gpu_data`` (newer amd-smi);
- ``amd-smi static --json`` (``gpu_data[]``: ``asic.market_name``, ``limit.{min,max}_power`` and
  ``limit.socket_power`` in W, the power cap; ``driver.version``);
- ``amd-smi xgmi --json`` (each device's PCI address, ``bdf``);
- ``rocm-smi --showallinfo --json`` (``-a``; ``cardN`` objects; ``Max Graphics Package Power
  (W)`` is the power cap, ``Average``/``Current Socket Graphics Package Power (W)`` the draw,
  else the GPU metrics' ``average_socket_power (W)``; ``Accumulated Energy (uJ)`` the energy
  counter);
- ``rocm-smi ... --csv``, what monitoring scripts run: the same keys as columns, one row per
  card (:func:`parse_rocm_smi_csv`).

A capture directory holds ``amd-smi-metric.csv`` or ``amd-smi-metric.json`` (with
``amd-smi-static.json`` and ``amd-smi-xgmi.json`` beside it where recorded), ``rocm-smi.json``
or ``rocm-smi.csv``: see `load_capture`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hyperagent.capture.accelerators import AcceleratorRecord, number, read_capture

MIB = 1024 * 1024
METRIC_CSV = "amd-smi-metric.csv"
METRIC_JSON = "amd-smi-metric.json"
STATIC_JSON = "amd-smi-static.json"
XGMI_JSON = "amd-smi-xgmi.json"
ROCM_SMI_JSON = "rocm-smi.json"
ROCM_SMI_CSV = "rocm-smi.csv"
CAPTURE_FILES = (METRIC_CSV, METRIC_JSON, ROCM_SMI_JSON, ROCM_SMI_CSV)
"""Either one makes a directory an AMD capture."""


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _metric_record(row: Mapping[str, str | None]) -> AcceleratorRecord:
    """A record from one device's ``amd-smi metric`` fields, named as the CSV's columns."""
    get = row.get
    used, total = number(get("used_vram")), number(get("total_vram"))
    hotspot = number(get("hotspot"))
    return AcceleratorRecord(
        index=int(number(get("gpu")) or 0),
        vendor="amd",
        model="",
        util_pct=number(get("gfx_activity")),
        mem_util_pct=number(get("umc_activity")),
        power_w=number(get("socket_power")),
        energy_j=number(get("total_energy_consumption")),
        mem_used_bytes=None if used is None else used * MIB,
        mem_total_bytes=None if total is None else total * MIB,
        temp_c=hotspot if hotspot is not None else number(get("edge")),
        mem_temp_c=number(get("mem")),
        clock_mhz=number(get("gfx_0_clk")) or number(get("gfx_clk")),
        mem_clock_mhz=number(get("mem_0_clk")) or number(get("mem_clk")),
        ecc_corrected=_int(number(get("total_correctable_count"))),
        ecc_uncorrected=_int(number(get("total_uncorrectable_count"))),
    )


def parse_metric_csv(text: str) -> list[AcceleratorRecord]:
    """Records from ``amd-smi metric --csv``: one per row, model unknown (the static output
    has it)."""
    return [_metric_record(row) for row in csv.DictReader(io.StringIO(text))]


def _flatten(section: Mapping[str, Any], prefix: str = "") -> dict[str, str | None]:
    """A section of one device's ``amd-smi metric --json`` as the CSV names its columns: the
    section's name dropped, nested objects joined with ``_`` (``clock.gfx_0.clk`` ->
    ``gfx_0_clk``), each ``{"value", "unit"}`` pair its value."""
    out: dict[str, str | None] = {}
    for key, entry in section.items():
        name = f"{prefix}{key}"
        if isinstance(entry, dict) and "value" not in entry:
            out.update(_flatten(entry, f"{name}_"))
        elif isinstance(entry, dict):
            out[name] = None if entry["value"] is None else str(entry["value"])
        elif not isinstance(entry, list):
            out[name] = None if entry is None else str(entry)
    return out


def parse_metric_json(text: str) -> list[AcceleratorRecord]:
    """Records from ``amd-smi metric --json``: a list of device objects, or ``{"gpu_data":
    [...]}`` as newer amd-smi prints it; the readings are those of the CSV form. Raises
    ValueError for any other shape."""
    data = json.loads(text)
    devices = data.get("gpu_data") if isinstance(data, dict) else data
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise ValueError('expected a list of device objects or {"gpu_data": [...]}')
    out = []
    for device in devices:
        if "gpu" not in device:
            raise ValueError("a device object without its 'gpu' index")
        row: dict[str, str | None] = {"gpu": str(device["gpu"])}
        for section in device.values():
            if isinstance(section, dict):
                row.update({k: v for k, v in _flatten(section).items() if k not in row})
        out.append(_metric_record(row))
    return out


def _value(entry: Any) -> float | None:
    """``{"value": 300, "unit": "W"}`` or a bare value."""
    if isinstance(entry, dict):
        return number(str(entry.get("value")))
    return number(None if entry is None else str(entry))


def parse_static_json(text: str) -> dict[int, dict[str, Any]]:
    """By device: model, power-cap range and cap in W, driver version, PCI address."""
    data = json.loads(text)
    devices = data.get("gpu_data", data) if isinstance(data, dict) else data
    out: dict[int, dict[str, Any]] = {}
    for gpu in devices:
        limit = gpu.get("limit", {})
        out[int(gpu["gpu"])] = {
            "model": gpu.get("asic", {}).get("market_name", ""),
            "vendor_id": str(gpu.get("asic", {}).get("vendor_id", "")),
            "device_id": str(gpu.get("asic", {}).get("device_id", "")),
            "min_power_cap_w": _value(limit.get("min_power")),
            "max_power_cap_w": _value(limit.get("max_power")),
            "power_cap_w": _value(limit.get("socket_power")),
            "driver": gpu.get("driver", {}).get("version", ""),
            "bus_id": gpu.get("bus", {}).get("bdf", ""),
        }
    return out


def parse_xgmi_json(text: str) -> dict[int, str]:
    """Each device's PCI address from ``amd-smi xgmi --json``."""
    return {int(gpu["gpu"]): str(gpu["bdf"]) for gpu in json.loads(text)}


def _model(series: str) -> str:
    """rocm-smi's "Card series" ("Arcturus GL-XL [Instinct MI100]"): the bracketed name
    amdsmi gives as market name ("AMD Instinct MI100")."""
    if "[" in series and series.endswith("]"):
        inner = series[series.rindex("[") + 1 : -1]
        last = inner.split("/")[-1].strip()
        return last if last.startswith("AMD") else f"AMD {last}"
    return series


def parse_rocm_smi_json(text: str) -> list[AcceleratorRecord]:
    """Records from ``rocm-smi --showallinfo --json`` (or any subset of its keys)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object of cardN objects")
    driver = str(data.get("system", {}).get("Driver version", ""))
    return _rocm_smi_cards(data, driver)


def parse_rocm_smi_csv(text: str) -> list[AcceleratorRecord]:
    """Records from ``rocm-smi [--showuse --showmemuse --showpower --showtemp --showmeminfo
    vram ...] --csv``: a ``device`` column (``card0``...) and one column per key of the
    ``--json`` form, whose names moved across rocm-smi 1.x-2.x (``Average`` or ``Current
    Socket Graphics Package Power (W)``, ``GPU memory use (%)`` or ``GPU Memory Allocated
    (VRAM%)``, ``Card series`` or ``Card Series``); ``WARNING:`` and other lines before the
    header are skipped. Raises ValueError naming the line of a row of another width."""
    lines = text.lstrip("\ufeff").splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.strip().lower().startswith("device,")), None
    )
    if start is None:
        raise ValueError("no header line starting with 'device,'")
    rows = list(csv.reader(lines[start:]))
    header = [name.strip() for name in rows[0]]
    cards: dict[str, dict[str, str]] = {}
    for offset, row in enumerate(rows[1:], start + 2):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(header):
            raise ValueError(f"line {offset} has {len(row)} values for {len(header)} columns")
        values = dict(zip(header, (cell.strip() for cell in row), strict=True))
        cards[values.pop(header[0])] = values
    return _rocm_smi_cards(cards, "")


_ENERGY_UNIT = "15.259uJ (2^-16)"
_ENERGY_RESOLUTION_UJ = 15.259
"""``--showmetrics``' energy_accumulator counts in this unit (rocm_smi.py's label for it)."""


def _rocm_smi_cards(data: dict[str, Any], driver: str) -> list[AcceleratorRecord]:
    """Records of the ``cardN`` entries of rocm-smi's output, keys matched case-insensitively.

    ``-a`` (``--showallinfo``) adds the energy counter (``Accumulated Energy (uJ)``) and the GPU
    metrics table (``average_socket_power (W)``, ``current_gfxclk (MHz)``...), read where the
    usual keys are absent (RDNA cards print no package power); the first key with a number
    wins."""
    out = []
    cards = sorted(
        (k for k in data if k.startswith("card") and k[4:].isdigit()), key=lambda k: int(k[4:])
    )
    for position, key in enumerate(cards):
        card = {str(k).lower(): v for k, v in data[key].items()}

        def get(name: str, card: dict[str, Any] = card) -> Any:
            return card.get(name.lower())

        def first(*names: str, card: dict[str, Any] = card) -> float | None:
            return next(
                (n for n in (number(card.get(k.lower())) for k in names) if n is not None), None
            )

        power = first(
            "Average Graphics Package Power (W)",
            "Current Socket Graphics Package Power (W)",
            "Average Socket Graphics Package Power (W)",
            "current_socket_power (W)",
            "average_socket_power (W)",
        )
        cap = number(get("Max Graphics Package Power (W)"))
        energy_uj = first("Accumulated Energy (uJ)")
        if energy_uj is None and (counter := first(f"energy_accumulator ({_ENERGY_UNIT})")):
            energy_uj = counter * _ENERGY_RESOLUTION_UJ
        model = str(get("Card series") or "")
        if not model or model == "N/A":
            model = str(get("Device Name") or "").strip()
        out.append(
            AcceleratorRecord(
                index=position,
                vendor="amd",
                model="" if model == "N/A" else _model(model),
                uuid=str(get("Unique ID") or ""),
                vendor_id=str(get("Vendor ID") or ("0x1002" if get("Device ID") else "")),
                device_id=str(get("Device ID") or ""),
                bus_id=str(get("PCI Bus") or "").lower(),
                driver=driver,
                util_pct=first("GPU use (%)", "average_gfx_activity (%)"),
                mem_util_pct=number(get("GPU Memory Read/Write Activity (%)"))
                if get("GPU Memory Read/Write Activity (%)") is not None
                else first(
                    "GPU memory use (%)", "GPU Memory Allocated (VRAM%)", "average_umc_activity (%)"
                ),
                power_w=power,
                energy_j=None if energy_uj is None else energy_uj / 1e6,
                mem_used_bytes=number(get("VRAM Total Used Memory (B)")),
                mem_total_bytes=number(get("VRAM Total Memory (B)")),
                temp_c=first(
                    "Temperature (Sensor junction) (C)",
                    "Temperature (Sensor edge) (C)",
                    "temperature_hotspot (C)",
                    "temperature_edge (C)",
                ),
                mem_temp_c=first("Temperature (Sensor memory) (C)", "temperature_mem (C)"),
                clock_mhz=first("sclk clock speed:", "current_gfxclk (MHz)"),
                mem_clock_mhz=first("mclk clock speed:", "current_uclk (MHz)"),
                power_cap_w=cap,
                max_power_cap_w=cap,
            )
        )
    return out


def load_capture(directory: Path) -> list[AcceleratorRecord]:
    """The AMD devices a capture directory holds (see the module docstring); [] when none."""
    metric, metric_json = directory / METRIC_CSV, directory / METRIC_JSON
    if metric.is_file() or metric_json.is_file():
        records = (
            read_capture(metric, "amd-smi metric --csv", parse_metric_csv)
            if metric.is_file()
            else read_capture(metric_json, "amd-smi metric --json", parse_metric_json)
        )
        xgmi = directory / XGMI_JSON
        buses = read_capture(xgmi, "amd-smi xgmi --json", parse_xgmi_json) if xgmi.is_file() else {}
        static_path = directory / STATIC_JSON
        static = (
            read_capture(static_path, "amd-smi static --json", parse_static_json)
            if static_path.is_file()
            else {}
        )
        out = []
        for record in records:
            found = static.get(record.index, {})
            bus = buses.get(record.index) or found.get("bus_id", "")
            out.append(
                replace(
                    record,
                    model=found.get("model", "") or record.model,
                    vendor_id=found.get("vendor_id", ""),
                    device_id=found.get("device_id", ""),
                    bus_id=bus,
                    driver=found.get("driver", ""),
                    power_cap_w=found.get("power_cap_w"),
                    min_power_cap_w=found.get("min_power_cap_w"),
                    max_power_cap_w=found.get("max_power_cap_w"),
                    default_power_cap_w=found.get("power_cap_w"),
                )
            )
        return out
    rocm = directory / ROCM_SMI_JSON
    if rocm.is_file():
        return read_capture(rocm, "rocm-smi --showallinfo --json", parse_rocm_smi_json)
    rocm_csv = directory / ROCM_SMI_CSV
    if rocm_csv.is_file():
        return read_capture(rocm_csv, "rocm-smi ... --csv", parse_rocm_smi_csv)
    return []
