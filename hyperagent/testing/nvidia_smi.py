"""Pure parsers for `nvidia-smi` captures: `-q -x` XML and `--query-gpu ... --format=csv`.

Each parser turns the captured text into one `GpuRecord` per GPU, in nvidia-smi's (and NVML's)
device order. Values nvidia-smi reports as `N/A`, `[N/A]`, `[Not Supported]` and the like become
None. Nothing here does I/O; the caller passes the text in.
"""

from __future__ import annotations

import csv
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass

MIB = 1024 * 1024

# Accepted units and their scale to ours; "" is a bare number in nvidia-smi's usual unit.
_BYTES = {"B": 1.0, "KiB": 1024.0, "MiB": float(MIB), "GiB": 1024.0 * MIB, "": float(MIB)}
_WATTS = {"W": 1.0, "": 1.0}
_PERCENT = {"%": 1.0, "": 1.0}
_CELSIUS = {"C": 1.0, "": 1.0}
_MHZ = {"MHz": 1.0, "": 1.0}
_COUNT = {"": 1.0}

_MISSING = re.compile(r"^(\[.*\]|n/a|not supported|unknown error|err!|)$", re.IGNORECASE)
_QUANTITY = re.compile(r"^(?P<num>[-+]?\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z%]*)$")
_CSV_HEADER = re.compile(r"^(?P<name>[^\[]+?)\s*(?:\[(?P<unit>[^\]]*)\])?$")
_EXPORTER_SECTION = "# {phase} :: query-gpu"
_QUERY_GPU_IDENTITY = frozenset({"name", "uuid", "index", "pci.bus_id"})


@dataclass(frozen=True)
class GpuRecord:
    """One GPU as a capture recorded it. None means N/A, not supported or not captured.

    Units: percent, bytes (nvidia-smi's MiB times 1024*1024), watts, degrees Celsius, MHz.
    `power_limit_w` is the enforced (current) limit; `mem_used_bytes` excludes
    `mem_reserved_bytes`, as nvidia-smi reports it.
    """

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    driver: str
    util_gpu_pct: float | None = None
    util_mem_pct: float | None = None
    mem_total_bytes: int | None = None
    mem_used_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    default_power_limit_w: float | None = None
    min_power_limit_w: float | None = None
    max_power_limit_w: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    graphics_clock_mhz: float | None = None
    pcie_replay_count: int | None = None


def _number(
    raw: str | None, field: str, units: Mapping[str, float], default_unit: str = ""
) -> float | None:
    """Read `raw` as a quantity in one of `units` and scale it; None when N/A or absent.

    A value without a unit takes `default_unit`. A malformed value or an unexpected unit raises
    ValueError naming the field, rather than being passed on as a wrong number.
    """
    if raw is None:
        return None
    text = raw.strip()
    if _MISSING.match(text):
        return None
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"{field}: cannot read {raw!r} as a number")
    unit = match["unit"] or default_unit
    if unit not in units:
        raise ValueError(f"{field}: unexpected unit {unit!r} in {raw!r}")
    return float(match["num"]) * units[unit]


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    if found is None or found.text is None:
        return None
    return found.text.strip()


def parse_nvidia_smi_xml(text: str) -> list[GpuRecord]:
    """Parse `nvidia-smi -q -x` output (DTD v11 and v12) into one record per `<gpu>`.

    The NVML index is the GPU's position in the dump (nvidia-smi lists GPUs in NVML order;
    `minor_number` is the /dev node and may differ). MIG instances are not separate records.
    Raises ValueError if the text is not an `nvidia_smi_log` document.
    """
    try:
        root = ET.fromstring(text.lstrip("\ufeff").strip())
    except ET.ParseError as exc:
        raise ValueError(f"not valid nvidia-smi XML: {exc}") from exc
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"not nvidia-smi XML: root element is <{root.tag}>, not <nvidia_smi_log>")
    driver = _text(root, "driver_version") or ""
    return [_xml_gpu(i, gpu, driver) for i, gpu in enumerate(root.findall("gpu"))]


def _xml_gpu(index: int, gpu: ET.Element, driver: str) -> GpuRecord:
    def num(path: str, units: Mapping[str, float]) -> float | None:
        return _number(_text(gpu, path), path, units)

    power = "gpu_power_readings" if gpu.find("gpu_power_readings") is not None else "power_readings"
    return GpuRecord(
        index=index,
        name=_text(gpu, "product_name") or "",
        uuid=_text(gpu, "uuid") or "",
        pci_bus_id=_text(gpu, "pci/pci_bus_id") or gpu.get("id") or "",
        driver=driver,
        util_gpu_pct=num("utilization/gpu_util", _PERCENT),
        util_mem_pct=num("utilization/memory_util", _PERCENT),
        mem_total_bytes=_int(num("fb_memory_usage/total", _BYTES)),
        mem_used_bytes=_int(num("fb_memory_usage/used", _BYTES)),
        mem_reserved_bytes=_int(num("fb_memory_usage/reserved", _BYTES)),
        power_draw_w=_first(
            num(f"{power}/power_draw", _WATTS),
            num(f"{power}/average_power_draw", _WATTS),
            num(f"{power}/instant_power_draw", _WATTS),
        ),
        power_limit_w=_first(
            num(f"{power}/enforced_power_limit", _WATTS),
            num(f"{power}/current_power_limit", _WATTS),
            num(f"{power}/power_limit", _WATTS),
            num(f"{power}/requested_power_limit", _WATTS),
        ),
        default_power_limit_w=num(f"{power}/default_power_limit", _WATTS),
        min_power_limit_w=num(f"{power}/min_power_limit", _WATTS),
        max_power_limit_w=num(f"{power}/max_power_limit", _WATTS),
        temperature_c=num("temperature/gpu_temp", _CELSIUS),
        sm_clock_mhz=num("clocks/sm_clock", _MHZ),
        mem_clock_mhz=num("clocks/mem_clock", _MHZ),
        graphics_clock_mhz=num("clocks/graphics_clock", _MHZ),
        pcie_replay_count=_int(num("pci/replay_counter", _COUNT)),
    )


def parse_query_gpu_csv(text: str) -> list[GpuRecord]:
    """Parse `nvidia-smi --query-gpu=... --format=csv[,nounits]` output, one record per row.

    The header names the fields, with units in brackets (`memory.total [MiB]`); values may carry
    the unit or not (`nounits`). Any subset of fields works as long as `name` is among them;
    missing fields are None, a missing `index` is the row number. Raises ValueError when there
    is no header, no `name` column, or a row of the wrong width.
    """
    lines = [line for line in text.lstrip("\ufeff").splitlines() if line.strip()]
    if not lines:
        raise ValueError("empty --query-gpu CSV")
    rows = list(csv.reader(lines, skipinitialspace=True))
    columns: list[tuple[str, str]] = []
    for cell in rows[0]:
        match = _CSV_HEADER.match(cell.strip())
        if match is None:
            raise ValueError(f"bad --query-gpu CSV header cell {cell!r}")
        columns.append((match["name"], match["unit"] or ""))
    names = [name for name, _ in columns]
    if "name" not in names:
        raise ValueError(f"--query-gpu CSV has no 'name' column (header: {', '.join(names)})")
    records = []
    for number, row in enumerate(rows[1:]):
        if len(row) != len(columns):
            raise ValueError(
                f"--query-gpu CSV row {number + 1} has {len(row)} values for {len(columns)} fields"
            )
        records.append(
            _csv_gpu(number, {n: (u, v.strip()) for (n, u), v in zip(columns, row, strict=True)})
        )
    return records


def _csv_gpu(row_number: int, fields: Mapping[str, tuple[str, str]]) -> GpuRecord:
    def num(units: Mapping[str, float], *names: str) -> float | None:
        for name in names:
            if name in fields:
                unit, raw = fields[name]
                value = _number(raw, name, units, unit)
                if value is not None:
                    return value
        return None

    def string(name: str) -> str:
        raw = fields.get(name, ("", ""))[1]
        return "" if _MISSING.match(raw) else raw

    index = _int(num(_COUNT, "index"))
    return GpuRecord(
        index=row_number if index is None else index,
        name=string("name"),
        uuid=string("uuid"),
        pci_bus_id=string("pci.bus_id"),
        driver=string("driver_version"),
        util_gpu_pct=num(_PERCENT, "utilization.gpu"),
        util_mem_pct=num(_PERCENT, "utilization.memory"),
        mem_total_bytes=_int(num(_BYTES, "memory.total")),
        mem_used_bytes=_int(num(_BYTES, "memory.used")),
        mem_reserved_bytes=_int(num(_BYTES, "memory.reserved")),
        power_draw_w=num(_WATTS, "power.draw", "power.draw.average", "power.draw.instant"),
        power_limit_w=num(_WATTS, "enforced.power.limit", "power.limit"),
        default_power_limit_w=num(_WATTS, "power.default_limit"),
        min_power_limit_w=num(_WATTS, "power.min_limit"),
        max_power_limit_w=num(_WATTS, "power.max_limit"),
        temperature_c=num(_CELSIUS, "temperature.gpu"),
        sm_clock_mhz=num(_MHZ, "clocks.current.sm", "clocks.sm"),
        mem_clock_mhz=num(_MHZ, "clocks.current.memory", "clocks.mem"),
        graphics_clock_mhz=num(_MHZ, "clocks.current.graphics", "clocks.gr"),
    )


def _exporter_section(lines: list[str], phase: str) -> str | None:
    """The CSV body of a `# <phase> :: query-gpu` section of an nvidia_gpu_exporter capture."""
    marker = _EXPORTER_SECTION.format(phase=phase)
    start = next(
        (i for i, line in enumerate(lines) if line == marker or line.startswith(marker + " ")),
        None,
    )
    if start is None:
        return None
    body: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            if body:
                break
            continue
        if line.strip():
            body.append(line)
    return "\n".join(body) or None


def parse_capture(text: str) -> list[GpuRecord]:
    """Parse any supported capture, detecting its format.

    Accepts `nvidia-smi -q -x` XML, a bare `--query-gpu` CSV, or an nvidia_gpu_exporter
    multi-section capture (its `load ::` query-gpu section, else its `idle ::` one).
    Raises ValueError for anything else and for a capture that holds no GPU.
    """
    body = text.lstrip("\ufeff").strip()
    lines = body.splitlines()
    if body.startswith("<"):
        kind, records = "nvidia-smi XML", parse_nvidia_smi_xml(body)
    elif any(line.startswith("# idle :: ") or line.startswith("# load :: ") for line in lines):
        section = _exporter_section(lines, "load") or _exporter_section(lines, "idle")
        if section is None:
            raise ValueError("nvidia_gpu_exporter capture without a query-gpu section")
        kind, records = "nvidia_gpu_exporter capture", parse_query_gpu_csv(section)
    elif lines and _QUERY_GPU_IDENTITY & {c.split("[", 1)[0].strip() for c in lines[0].split(",")}:
        kind, records = "--query-gpu CSV", parse_query_gpu_csv(body)
    else:
        first = lines[0][:60] if lines else ""
        raise ValueError(
            "unrecognised nvidia-smi capture: expected `-q -x` XML, `--query-gpu` CSV or an "
            f"nvidia_gpu_exporter capture; it starts with {first!r}"
        )
    if not records:
        raise ValueError(f"{kind} holds no GPU")
    return records
