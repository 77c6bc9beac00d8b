"""Pure parsers for `nvidia-smi` captures: `-q -x` XML, `-q` text, `--query-gpu` CSV.

Each parser turns the captured text into one `GpuRecord` per GPU, in nvidia-smi's (and NVML's)
device order. Values nvidia-smi reports as `N/A`, `[N/A]`, `[Not Supported]` and the like become
None. Nothing here does I/O; the caller passes the text in.
"""

from __future__ import annotations

import csv
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

MIB = 1024 * 1024

# Accepted units and their scale to ours; "" is a bare number in nvidia-smi's usual unit.
_BYTES = {"B": 1.0, "KiB": 1024.0, "MiB": float(MIB), "GiB": 1024.0 * MIB, "": float(MIB)}
_WATTS = {"W": 1.0, "": 1.0}
_PERCENT = {"%": 1.0, "": 1.0}
_CELSIUS = {"C": 1.0, "": 1.0}
_MHZ = {"MHz": 1.0, "": 1.0}
_COUNT = {"": 1.0}
# NVML reports PCIe throughput in KB/s, and its K is 1024 as its MB are MiB.
_BYTES_PER_SECOND = {"KB/s": 1024.0, "MB/s": float(MIB), "B/s": 1.0}
_NANOSECONDS = {"us": 1000.0, "ns": 1.0, "ms": 1e6, "s": 1e9}

_MISSING = re.compile(r"^(\[.*\]|n/a|not supported|unknown error|err!|)$", re.IGNORECASE)
_QUANTITY = re.compile(r"^(?P<num>[-+]?\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z%/]*)$")
_CSV_HEADER = re.compile(r"^(?P<name>[^\[]+?)\s*(?:\[(?P<unit>[^\]]*)\])?$")
_EXPORTER_SECTION = "# {phase} :: query-gpu"
_EXPORTER_NVLINK = "# capabilities :: nvlink -s"
_EXPORTER_QUERY = "# {phase} :: query (-q)"
_QUERY_GPU_IDENTITY = frozenset({"name", "uuid", "index", "pci.bus_id"})
_NVLINK_GPU = re.compile(r"^GPU (?P<index>\d+): ")
_NVLINK_LINK = re.compile(r"^\s*Link (?P<link>\d+): (?P<state>.+?)\s*$")
_NVLINK_SPEED = re.compile(r"^\d+(?:\.\d+)?\s*[GM]B/s$")

_ACTIVE = {"active": True, "not active": False}
_YES = {"yes": True, "no": False}
_ENABLED = {"enabled": True, "disabled": False}

CLOCK_EVENT_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "display_clocks_setting",
)
"""The clock event (formerly throttle) reasons, by nvidia-smi's names."""

ECC_TYPES = ("corrected", "uncorrected")
ECC_COUNTERS = ("volatile", "aggregate")
ECC_LOCATIONS = (
    "device_memory",
    "register_file",
    "l1_cache",
    "l2_cache",
    "texture_memory",
    "texture_shm",
    "cbu",
    "sram",
)
"""Memory locations of ECC counts, by nvidia-smi's names (its `dram` is `device_memory`)."""


@dataclass(frozen=True)
class NvLinkRecord:
    """One NVLink of a GPU. Byte counters are cumulative; `errors` is keyed by
    replay, recovery, crc_flit, crc_data, ecc_data."""

    link: int
    active: bool | None = None
    tx_bytes: int | None = None
    rx_bytes: int | None = None
    errors: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MigRecord:
    """One MIG device of a GPU in MIG mode. `index` is its MIG device slot on the parent.

    `uuid` and `profile` (e.g. "1g.10gb") are None when the capture does not hold them
    (`-q -x` dumps do not); `mem_used_bytes` excludes `mem_reserved_bytes`.
    """

    index: int
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str | None = None
    profile: str | None = None
    mem_total_bytes: int | None = None
    mem_used_bytes: int | None = None
    mem_reserved_bytes: int | None = None


@dataclass(frozen=True)
class RemappedRows:
    """Row remapping state of HBM/GDDR6 memory (Ampere and newer)."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class GpuRecord:
    """One GPU as a capture recorded it. None means N/A, not supported or not captured.

    Units: percent, bytes (nvidia-smi's MiB times 1024*1024), bytes per second, watts, degrees
    Celsius, MHz, nanoseconds. `power_limit_w` is the enforced (current) limit;
    `mem_used_bytes` excludes `mem_reserved_bytes`, as nvidia-smi reports it.

    `clock_event_reasons` is the set of active reasons (names from CLOCK_EVENT_REASONS);
    `clock_event_api` is False for drivers that only know the older "throttle reasons" names.
    `clock_event_counters_ns` holds cumulative time per reason where the capture has counters.
    `ecc_errors` is keyed by (type, counter) from ECC_TYPES x ECC_COUNTERS and
    `ecc_errors_by_location` by (type, counter, location). The `sm_active_pct` group are GPM
    (Hopper and newer) activities, which no nvidia-smi capture holds.
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
    memory_temperature_c: float | None = None
    pcie_tx_bytes_per_s: int | None = None
    pcie_rx_bytes_per_s: int | None = None
    clock_event_reasons: frozenset[str] | None = None
    clock_event_api: bool = True
    clock_event_counters_ns: Mapping[str, int] = field(default_factory=dict)
    ecc_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    ecc_errors_by_location: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows: RemappedRows | None = None
    mig_enabled: bool | None = None
    mig_devices: tuple[MigRecord, ...] = ()
    nvlinks: tuple[NvLinkRecord, ...] = ()
    sm_active_pct: float | None = None
    sm_occupancy_pct: float | None = None
    tensor_active_pct: float | None = None
    dram_active_pct: float | None = None


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


def _flag(raw: str | None, field: str, words: Mapping[str, bool]) -> bool | None:
    """Read a yes/no style word (`words` maps lower-case words to values); None when N/A."""
    if raw is None:
        return None
    text = raw.strip()
    if _MISSING.match(text):
        return None
    try:
        return words[text.lower()]
    except KeyError:
        raise ValueError(f"{field}: expected one of {sorted(words)}, got {raw!r}") from None


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _text(element: ET.Element, path: str) -> str | None:
    found = element.find(path)
    if found is None or found.text is None:
        return None
    return found.text.strip()


def _sum(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def parse_nvidia_smi_xml(text: str) -> list[GpuRecord]:
    """Parse `nvidia-smi -q -x` output (DTD v11 and v12) into one record per `<gpu>`.

    The NVML index is the GPU's position in the dump (nvidia-smi lists GPUs in NVML order;
    `minor_number` is the /dev node and may differ). MIG devices are listed in the parent's
    `mig_devices`. Raises ValueError if the text is not an `nvidia_smi_log` document or a
    field holds something that is not a value of its kind.
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

    def count(path: str) -> int | None:
        return _int(num(path, _COUNT))

    power = "gpu_power_readings" if gpu.find("gpu_power_readings") is not None else "power_readings"
    reasons, event_api = _xml_clock_event_reasons(gpu)
    ecc_totals, ecc_locations = _xml_ecc(gpu)
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
        pcie_replay_count=count("pci/replay_counter"),
        memory_temperature_c=num("temperature/memory_temp", _CELSIUS),
        pcie_tx_bytes_per_s=_int(num("pci/tx_util", _BYTES_PER_SECOND)),
        pcie_rx_bytes_per_s=_int(num("pci/rx_util", _BYTES_PER_SECOND)),
        clock_event_reasons=reasons,
        clock_event_api=event_api,
        ecc_errors=ecc_totals,
        ecc_errors_by_location=ecc_locations,
        retired_pages_single_bit=count(
            "retired_pages/multiple_single_bit_retirement/retired_count"
        ),
        retired_pages_double_bit=count("retired_pages/double_bit_retirement/retired_count"),
        retired_pages_pending=_flag(
            _text(gpu, "retired_pages/pending_retirement"), "retired_pages/pending_retirement", _YES
        ),
        remapped_rows=_xml_remapped_rows(gpu),
        mig_enabled=_flag(_text(gpu, "mig_mode/current_mig"), "mig_mode/current_mig", _ENABLED),
        mig_devices=tuple(_xml_mig(device) for device in gpu.findall("mig_devices/mig_device")),
    )


def _xml_clock_event_reasons(gpu: ET.Element) -> tuple[frozenset[str] | None, bool]:
    """Active reasons from `clocks_event_reasons` (drivers >= 535) or `clocks_throttle_reasons`."""
    for tag, event_api in (("clocks_event_reasons", True), ("clocks_throttle_reasons", False)):
        section = gpu.find(tag)
        if section is None:
            continue
        prefix = tag.removesuffix("s") + "_"
        states = {
            child.tag.removeprefix(prefix): _flag(child.text, f"{tag}/{child.tag}", _ACTIVE)
            for child in section
        }
        known = {name: state for name, state in states.items() if state is not None}
        if not known:
            return None, event_api
        return frozenset(name for name, state in known.items() if state), event_api
    return None, True


def _xml_ecc(
    gpu: ET.Element,
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str, str], int]]:
    """ECC totals and per-location counts from either `ecc_errors` layout.

    Older dumps split `single_bit`/`double_bit` by location with a `total`; newer ones list
    `sram_correctable`, `dram_uncorrectable`, ... whose sum is the total.
    """
    totals: dict[tuple[str, str], int] = {}
    locations: dict[tuple[str, str, str], int] = {}
    for counter in ECC_COUNTERS:
        section = gpu.find(f"ecc_errors/{counter}")
        if section is None:
            continue
        for error_type, bits in zip(ECC_TYPES, ("single_bit", "double_bit"), strict=True):
            split = section.find(bits)
            if split is not None:
                for child in split:
                    path = f"ecc_errors/{counter}/{bits}/{child.tag}"
                    value = _int(_number(child.text, path, _COUNT))
                    if value is None:
                        continue
                    if child.tag == "total":
                        totals[(error_type, counter)] = value
                    else:
                        locations[(error_type, counter, child.tag)] = value
                continue
            suffix = "correctable" if error_type == "corrected" else "uncorrectable"
            parts: list[int | None] = []
            for memory, location in (("sram", "sram"), ("dram", "device_memory")):
                path = f"ecc_errors/{counter}/{memory}_{suffix}"
                value = _int(_number(_text(gpu, path), path, _COUNT))
                if value is not None:
                    locations[(error_type, counter, location)] = value
                parts.append(value)
            total = _sum(*parts)
            if total is not None:
                totals[(error_type, counter)] = total
    return totals, locations


def _remapped_rows(
    correctable: int | None, uncorrectable: int | None, pending: bool | None, failure: bool | None
) -> RemappedRows | None:
    """All four values, as NVML returns them in one call, or None when any is unknown."""
    if correctable is None or uncorrectable is None or pending is None or failure is None:
        return None
    return RemappedRows(correctable, uncorrectable, pending, failure)


def _xml_remapped_rows(gpu: ET.Element) -> RemappedRows | None:
    section = gpu.find("remapped_rows")
    if section is None or len(section) == 0:
        return None

    def count(tag: str) -> int | None:
        return _int(_number(_text(section, tag), f"remapped_rows/{tag}", _COUNT))

    def flag(tag: str) -> bool | None:
        return _flag(_text(section, tag), f"remapped_rows/{tag}", _YES)

    return _remapped_rows(
        count("remapped_row_corr"),
        count("remapped_row_unc"),
        flag("remapped_row_pending"),
        flag("remapped_row_failure"),
    )


def _xml_mig(device: ET.Element) -> MigRecord:
    def identifier(path: str) -> int:
        value = _int(_number(_text(device, path), f"mig_device/{path}", _COUNT))
        if value is None:
            raise ValueError(f"mig_device/{path}: missing")
        return value

    def memory(path: str) -> int | None:
        return _int(_number(_text(device, path), f"mig_device/{path}", _BYTES))

    return MigRecord(
        index=identifier("index"),
        gpu_instance_id=identifier("gpu_instance_id"),
        compute_instance_id=identifier("compute_instance_id"),
        mem_total_bytes=memory("fb_memory_usage/total"),
        mem_used_bytes=memory("fb_memory_usage/used"),
        mem_reserved_bytes=memory("fb_memory_usage/reserved"),
    )


_TEXT_LINE = re.compile(r"^(?P<indent> *)(?P<key>\S.*?)\s*(?::(?: (?P<value>.*))?)?$")
_TEXT_GPU = re.compile(r"^GPU (?P<bus>[0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s*$")
_TEXT_HEADER = "==============NVSMI LOG=============="

_TEXT_TAGS: dict[tuple[str, str], str] = {
    ("gpu", "GPU UUID"): "uuid",
    ("pci", "Bus Id"): "pci_bus_id",
    ("pci", "Replays Since Reset"): "replay_counter",
    ("pci", "Tx Throughput"): "tx_util",
    ("pci", "Rx Throughput"): "rx_util",
    ("utilization", "GPU"): "gpu_util",
    ("utilization", "Gpu"): "gpu_util",
    ("utilization", "Memory"): "memory_util",
    ("temperature", "GPU Current Temp"): "gpu_temp",
    ("temperature", "Memory Current Temp"): "memory_temp",
    ("gpu_power_readings", "Instantaneous Power Draw"): "instant_power_draw",
    ("power_readings", "Instantaneous Power Draw"): "instant_power_draw",
    ("clocks", "Graphics"): "graphics_clock",
    ("clocks", "SM"): "sm_clock",
    ("clocks", "Memory"): "mem_clock",
    ("clocks", "Video"): "video_clock",
    ("mig_device", "Shared FB Memory Usage"): "fb_memory_usage",
    ("mig_device", "Shared BAR1 Memory"): "bar1_memory_usage",
    ("mig_mode", "Current"): "current_mig",
    ("mig_mode", "Pending"): "pending_mig",
    ("remapped_rows", "Correctable Error"): "remapped_row_corr",
    ("remapped_rows", "Uncorrectable Error"): "remapped_row_unc",
    ("remapped_rows", "Pending"): "remapped_row_pending",
    ("remapped_rows", "Remapping Failure Occurred"): "remapped_row_failure",
    ("retired_pages", "Single Bit ECC"): "multiple_single_bit_retirement/retired_count",
    ("retired_pages", "Double Bit ECC"): "double_bit_retirement/retired_count",
    ("retired_pages", "Pending Page Blacklist"): "pending_retirement",
    ("retired_pages", "Pending Page Retirement"): "pending_retirement",
}
"""Labels of ``nvidia-smi -q`` whose ``-q -x`` tag is not their snake_case, by parent tag."""
_TEXT_REASONS = {"Idle": "gpu_idle", "Display Clock Setting": "display_clocks_setting"}
_TEXT_SKIPPED = frozenset({"ecc_errors", "processes"})
"""Sections not read from text: ECC counts are laid out differently from the XML's (use
``-q -x`` for them), processes are not GPU state."""


def _snake(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def _text_tag(parent: str, key: str) -> str:
    if parent in ("clocks_event_reasons", "clocks_throttle_reasons"):
        return parent.removesuffix("s") + "_" + _TEXT_REASONS.get(key, _snake(key))
    return _TEXT_TAGS.get((parent, key), _snake(key))


def _text_child(parent: ET.Element, path: str) -> ET.Element:
    element = parent
    for tag in path.split("/"):
        element = ET.SubElement(element, tag)
    return element


def parse_nvidia_smi_text(text: str) -> list[GpuRecord]:
    """Parse ``nvidia-smi -q`` text (the form users paste) into one record per GPU, MIG devices
    included, reading the same fields as :func:`parse_nvidia_smi_xml` except the ECC counts
    (laid out otherwise in text; ``-q -x`` has them).

    The text is read into the ``-q -x`` element tree: indentation gives the sections, labels
    become tags (snake_case, or :data:`_TEXT_TAGS`). Raises ValueError when it holds no GPU.
    """
    root = ET.Element("nvidia_smi_log")
    stack: list[tuple[int, ET.Element]] = []
    gpu: ET.Element | None = None
    skipped_below: int | None = None
    for line in text.splitlines():
        gpu_line = _TEXT_GPU.match(line)
        if gpu_line is not None:
            gpu = ET.SubElement(root, "gpu", id=gpu_line["bus"])
            stack, skipped_below = [(0, gpu)], None
            continue
        match = _TEXT_LINE.match(line.rstrip())
        if match is None:
            continue
        depth = len(match["indent"])
        key, value = match["key"], (match["value"] or "").strip()
        if gpu is None:
            if depth == 0 and key == "Driver Version":
                ET.SubElement(root, "driver_version").text = value
            continue
        if skipped_below is not None and depth > skipped_below:
            continue
        skipped_below = None
        while len(stack) > 1 and stack[-1][0] >= depth:
            stack.pop()
        parent = stack[-1][1]
        if parent.tag in ("clocks_event_reasons", "clocks_throttle_reasons") or (
            parent.tag.startswith("clocks_") and parent.tag.endswith("_reason_hw_slowdown")
        ):
            section = parent if parent.tag.endswith("reasons") else stack[-2][1]
            child = _text_child(section, _text_tag(section.tag, key))
        else:
            tag = _text_tag(parent.tag, key)
            if tag in _TEXT_SKIPPED:
                skipped_below = depth
                continue
            if tag == "mig_device" and parent.tag == "gpu":
                holder = parent.find("mig_devices")
                parent = holder if holder is not None else ET.SubElement(parent, "mig_devices")
            child = _text_child(parent, tag)
        child.text = value
        stack.append((depth, child))
    if root.find("gpu") is None:
        raise ValueError("nvidia-smi -q text holds no GPU")
    driver = _text(root, "driver_version") or ""
    return [_xml_gpu(i, element, driver) for i, element in enumerate(root.findall("gpu"))]


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


def _csv_memory(
    total: int | None, used: int | None, free: int | None, reserved: int | None
) -> tuple[int | None, int | None, int | None]:
    """(total, used, reserved) of a CSV row: NVML answers all of its memory figures or none, so
    one the row lacks is worked out from the other three (total = used + free + reserved).

    A row without ``memory.total`` (a field list that asks for reserved, used and free only)
    has it as their sum. Drivers since R510 leave the reserve out of ``memory.used``: a row
    without ``memory.reserved`` has it as total - used - free, so that used and reserved
    together are total - free, as the XML path reads them; one whose ``memory.used`` is N/A
    has used as total - free - reserved."""
    if total is None and None not in (used, free, reserved):
        assert used is not None and free is not None and reserved is not None
        total = used + free + reserved
    if reserved is None and None not in (total, used, free):
        assert total is not None and used is not None and free is not None
        reserved = max(0, total - used - free)
    elif used is None and None not in (total, free, reserved):
        assert total is not None and free is not None and reserved is not None
        used = max(0, total - free - reserved)
    return total, used, reserved


class _CsvRow:
    """One row of a ``--query-gpu`` CSV: field name -> (unit from the header, raw value)."""

    def __init__(self, fields: Mapping[str, tuple[str, str]]) -> None:
        self.fields = fields

    def num(self, units: Mapping[str, float], *names: str) -> float | None:
        """The first of ``names`` the row has a value for, scaled by ``units``."""
        for name in names:
            if name in self.fields:
                unit, raw = self.fields[name]
                value = _number(raw, name, units, unit)
                if value is not None:
                    return value
        return None

    def count(self, *names: str) -> int | None:
        return _int(self.num(_COUNT, *names))

    def bytes(self, name: str) -> int | None:
        return _int(self.num(_BYTES, name))

    def flag(self, name: str, words: Mapping[str, bool]) -> bool | None:
        return _flag(self.fields[name][1], name, words) if name in self.fields else None

    def string(self, name: str) -> str:
        raw = self.fields.get(name, ("", ""))[1]
        return "" if _MISSING.match(raw) else raw


def _csv_clock_events(
    row: _CsvRow,
) -> tuple[frozenset[str] | None, bool, dict[str, int]]:
    """A row's active clock event reasons (None: none known), whether it names them by the
    event API (not the older throttle reasons) and their counters in nanoseconds."""
    event_api = not any(name.startswith("clocks_throttle_reasons.") for name in row.fields)
    family = "clocks_event_reasons" if event_api else "clocks_throttle_reasons"
    states = {reason: row.flag(f"{family}.{reason}", _ACTIVE) for reason in CLOCK_EVENT_REASONS}
    known = {reason: state for reason, state in states.items() if state is not None}
    counters = {
        reason: _int(row.num(_NANOSECONDS, f"clocks_event_reasons_counters.{reason}"))
        for reason in CLOCK_EVENT_REASONS
    }
    active = frozenset(reason for reason, state in known.items() if state) if known else None
    return active, event_api, {r: ns for r, ns in counters.items() if ns is not None}


def _csv_ecc(
    row: _CsvRow,
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str, str], int]]:
    """A row's ECC counts: totals by (type, counter) and by (type, counter, location)."""
    totals: dict[tuple[str, str], int] = {}
    locations: dict[tuple[str, str, str], int] = {}
    for error_type in ECC_TYPES:
        for counter in ECC_COUNTERS:
            prefix = f"ecc.errors.{error_type}.{counter}"
            total = row.count(f"{prefix}.total")
            if total is not None:
                totals[(error_type, counter)] = total
            for location in ECC_LOCATIONS:
                names = [f"{prefix}.{location}"]
                if location == "device_memory":
                    names.append(f"{prefix}.dram")
                value = row.count(*names)
                if value is not None:
                    locations[(error_type, counter, location)] = value
    return totals, locations


def _csv_gpu(row_number: int, fields: Mapping[str, tuple[str, str]]) -> GpuRecord:
    row = _CsvRow(fields)
    index = row.count("index")
    mem_total, mem_used, mem_reserved = _csv_memory(
        row.bytes("memory.total"),
        row.bytes("memory.used"),
        row.bytes("memory.free"),
        row.bytes("memory.reserved"),
    )
    reasons, event_api, event_counters = _csv_clock_events(row)
    ecc, ecc_by_location = _csv_ecc(row)
    return GpuRecord(
        index=row_number if index is None else index,
        name=row.string("name"),
        uuid=row.string("uuid"),
        pci_bus_id=row.string("pci.bus_id"),
        driver=row.string("driver_version"),
        util_gpu_pct=row.num(_PERCENT, "utilization.gpu"),
        util_mem_pct=row.num(_PERCENT, "utilization.memory"),
        mem_total_bytes=mem_total,
        mem_used_bytes=mem_used,
        mem_reserved_bytes=mem_reserved,
        power_draw_w=row.num(_WATTS, "power.draw", "power.draw.average", "power.draw.instant"),
        power_limit_w=row.num(_WATTS, "enforced.power.limit", "power.limit"),
        default_power_limit_w=row.num(_WATTS, "power.default_limit"),
        min_power_limit_w=row.num(_WATTS, "power.min_limit"),
        max_power_limit_w=row.num(_WATTS, "power.max_limit"),
        temperature_c=row.num(_CELSIUS, "temperature.gpu"),
        sm_clock_mhz=row.num(_MHZ, "clocks.current.sm", "clocks.sm"),
        mem_clock_mhz=row.num(_MHZ, "clocks.current.memory", "clocks.mem"),
        graphics_clock_mhz=row.num(_MHZ, "clocks.current.graphics", "clocks.gr"),
        memory_temperature_c=row.num(_CELSIUS, "temperature.memory"),
        clock_event_reasons=reasons,
        clock_event_api=event_api,
        clock_event_counters_ns=event_counters,
        ecc_errors=ecc,
        ecc_errors_by_location=ecc_by_location,
        retired_pages_single_bit=row.count("retired_pages.single_bit_ecc.count"),
        retired_pages_double_bit=row.count("retired_pages.double_bit.count"),
        retired_pages_pending=row.flag("retired_pages.pending", _YES),
        remapped_rows=_remapped_rows(
            row.count("remapped_rows.correctable"),
            row.count("remapped_rows.uncorrectable"),
            row.flag("remapped_rows.pending", _YES),
            row.flag("remapped_rows.failure", _YES),
        ),
        mig_enabled=row.flag("mig.mode.current", _ENABLED),
    )


def _exporter_section(lines: list[str], marker: str) -> list[str] | None:
    """The body lines of the section headed by `marker` in an nvidia_gpu_exporter capture."""
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
    return body


def _exporter_query_gpu(lines: list[str], phase: str) -> str | None:
    body = _exporter_section(lines, _EXPORTER_SECTION.format(phase=phase))
    return "\n".join(body) if body else None


def parse_nvlink_status(lines: list[str]) -> dict[int, tuple[NvLinkRecord, ...]]:
    """Link states per GPU index from `nvidia-smi nvlink -s` output.

    A link with a speed is active, `<inactive>` is not; a GPU without NVLink has no entry.
    Raises ValueError for a link line that is neither.
    """
    links: dict[int, list[NvLinkRecord]] = {}
    current: int | None = None
    for line in lines:
        gpu = _NVLINK_GPU.match(line)
        if gpu is not None:
            current = int(gpu["index"])
            continue
        link = _NVLINK_LINK.match(line)
        if link is None or current is None:
            continue
        state = link["state"]
        if state == "<inactive>":
            active = False
        elif _NVLINK_SPEED.match(state):
            active = True
        else:
            raise ValueError(f"nvlink -s: GPU {current} link {link['link']}: cannot read {state!r}")
        links.setdefault(current, []).append(NvLinkRecord(int(link["link"]), active))
    return {index: tuple(found) for index, found in links.items()}


def _with_mig(records: list[GpuRecord], from_text: list[GpuRecord]) -> list[GpuRecord]:
    """CSV records with the MIG mode and devices of the same GPUs' ``-q`` text (by bus id)."""
    by_bus = {r.pci_bus_id.upper(): r for r in from_text}
    merged = []
    for record in records:
        text = by_bus.get(record.pci_bus_id.upper())
        if text is not None:
            record = replace(
                record,
                mig_enabled=record.mig_enabled
                if record.mig_enabled is not None
                else text.mig_enabled,
                mig_devices=record.mig_devices or text.mig_devices,
            )
        merged.append(record)
    return merged


def parse_capture(text: str) -> list[GpuRecord]:
    """Parse any supported capture, detecting its format.

    Accepts `nvidia-smi -q -x` XML, `nvidia-smi -q` text, a bare `--query-gpu` CSV, or an
    nvidia_gpu_exporter multi-section capture (its `load ::` query-gpu section, else its
    `idle ::` one, the MIG devices of the same phase's `-q` section and the link states of its
    `nvlink -s` section).
    Raises ValueError for anything else and for a capture that holds no GPU.
    """
    body = text.lstrip("\ufeff").strip()
    lines = body.splitlines()
    if body.startswith("<"):
        kind, records = "nvidia-smi XML", parse_nvidia_smi_xml(body)
    elif any(line.startswith("# idle :: ") or line.startswith("# load :: ") for line in lines):
        phase = "load" if _exporter_query_gpu(lines, "load") else "idle"
        section = _exporter_query_gpu(lines, phase)
        if section is None:
            raise ValueError("nvidia_gpu_exporter capture without a query-gpu section")
        kind, records = "nvidia_gpu_exporter capture", parse_query_gpu_csv(section)
        links = parse_nvlink_status(_exporter_section(lines, _EXPORTER_NVLINK) or [])
        records = [replace(r, nvlinks=links.get(r.index, r.nvlinks)) for r in records]
        query = _exporter_section(lines, _EXPORTER_QUERY.format(phase=phase))
        if query:
            records = _with_mig(records, parse_nvidia_smi_text("\n".join(query)))
    elif _TEXT_HEADER in body or _TEXT_GPU.match(lines[0] if lines else ""):
        kind, records = "nvidia-smi -q text", parse_nvidia_smi_text(body)
    elif lines and _QUERY_GPU_IDENTITY & {c.split("[", 1)[0].strip() for c in lines[0].split(",")}:
        kind, records = "--query-gpu CSV", parse_query_gpu_csv(body)
    else:
        first = lines[0][:60] if lines else ""
        raise ValueError(
            "unrecognised nvidia-smi capture: expected `-q -x` XML, `-q` text, `--query-gpu` CSV"
            f" or an nvidia_gpu_exporter capture; it starts with {first!r}"
        )
    if not records:
        raise ValueError(f"{kind} holds no GPU")
    return records


COMPUTE_APPS_FILE = "nvidia-smi-compute-apps.csv"
"""A capture directory's GPU processes:
``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_gpu_memory --format=csv``."""


def parse_compute_apps(text: str) -> list[tuple[str, int]]:
    """(GPU uuid, pid) of each process a ``--query-compute-apps`` CSV lists (its header names
    ``gpu_uuid`` and ``pid``); raises ValueError naming the line that is malformed."""
    rows = [r for r in csv.reader(text.splitlines(), skipinitialspace=True) if r]
    if not rows:
        return []
    header = [cell.strip().split(" [")[0] for cell in rows[0]]
    if "gpu_uuid" not in header or "pid" not in header:
        raise ValueError(f"line 1: header {rows[0]!r} names no gpu_uuid and pid")
    uuid_at, pid_at = header.index("gpu_uuid"), header.index("pid")
    out = []
    for number, row in enumerate(rows[1:], 2):
        if len(row) != len(header) or not row[pid_at].strip().isdigit():
            raise ValueError(f"line {number}: {row!r} is not {len(header)} cells with a pid")
        out.append((row[uuid_at].strip(), int(row[pid_at])))
    return out
