"""Host CPU, memory and swap from /proc/stat and /proc/meminfo (as psutil computes them);
swap activity from /proc/vmstat, memory stall time from /proc/pressure/memory (PSI) and kernel
NUMA balancing from procfs. The files are held open and read with one pread(2) each."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

from hyperagent.errors import SourceError
from hyperagent.readings import Kind, Reading
from hyperagent.sources.heldfile import HeldFile

STAT_HEAD = 1024
"""Bytes of /proc/stat read: its first line (all CPUs together) is all that is used."""


def parse_host(cpu_percent: float, memory: Any, swap: Any) -> list[Reading]:
    """Readings from a CPU busy percentage and objects with psutil's ``virtual_memory()``
    (``total``, ``available``) and ``swap_memory()`` (``total``, ``used``) fields."""
    return [
        Reading("hyperagent_host_cpu_utilization_ratio", cpu_percent / 100),
        Reading("hyperagent_host_memory_total_bytes", float(memory.total)),
        Reading("hyperagent_host_memory_available_bytes", float(memory.available)),
        Reading("hyperagent_host_swap_total_bytes", float(swap.total)),
        Reading("hyperagent_host_swap_used_bytes", float(swap.used)),
    ]


def parse_numa_balancing(text: str) -> list[Reading]:
    """``/proc/sys/kernel/numa_balancing``: 0 off, 1 on, 2 memory tiering (kernel >= 5.18)."""
    value = text.strip()
    if not (value.isascii() and value.isdigit()):
        raise SourceError(f"kernel.numa_balancing: unexpected value {value[:40]!r}")
    return [Reading("hyperagent_host_numa_balancing_mode", float(value))]


def parse_memory_pressure(text: bytes) -> list[Reading]:
    """``/proc/pressure/memory`` (PSI, kernel >= 4.20): the ``total=`` microseconds during which
    some task, or every non-idle task (``full``), stalled waiting for memory, in seconds.

    Raises ValueError on a line that is not ``some|full avg10=... total=N``."""
    readings = []
    for line in text.splitlines():
        if not line.strip():
            continue
        kind, *fields = line.split()
        values = dict(field.partition(b"=")[::2] for field in fields)
        total = values.get(b"total", b"")
        if kind not in (b"some", b"full") or not total.isdigit():
            raise ValueError(f"/proc/pressure/memory: unexpected line {line[:80]!r}")
        readings.append(
            Reading(
                "hyperagent_host_memory_pressure_stall_seconds_total",
                int(total) / 1e6,
                {"kind": kind.decode()},
                Kind.COUNTER,
            )
        )
    return readings


SWAP_COUNTERS = {b"pswpin": "in", b"pswpout": "out"}
"""/proc/vmstat fields counting pages swapped in and out since boot."""


def parse_swap_activity(vmstat: bytes) -> list[Reading]:
    """Pages swapped in and out since boot from ``/proc/vmstat`` (``pswpin``, ``pswpout``);
    none when the kernel has no swap support (the fields are then absent).

    Raises ValueError when a field's value is not a number."""
    readings = []
    text = b"\n" + vmstat
    for field, direction in SWAP_COUNTERS.items():
        start = text.find(b"\n" + field + b" ")
        if start < 0:
            continue
        start += len(field) + 2
        end = text.find(b"\n", start)
        value = text[start : end if end >= 0 else len(text)].strip()
        if not value.isdigit():
            raise ValueError(f"/proc/vmstat: unexpected {field.decode()} value {value[:40]!r}")
        readings.append(
            Reading(
                "hyperagent_host_swap_pages_total",
                float(value),
                {"direction": direction},
                Kind.COUNTER,
            )
        )
    return readings


def cpu_times(stat: bytes) -> tuple[float, float]:
    """(total, busy) jiffies of all CPUs from ``/proc/stat``'s first line, as psutil counts
    them: guest time is already in user and nice, and idle and iowait are not busy.

    Raises ValueError when the first line is not the ``cpu`` line."""
    fields = stat.split(b"\n", 1)[0].split()
    if len(fields) < 5 or fields[0] != b"cpu":
        raise ValueError(f"/proc/stat does not start with the cpu line: {stat[:40]!r}")
    times = [int(f) for f in fields[1:]]
    total = sum(times) - sum(times[8:10])  # guest, guest_nice
    idle = times[3] + (times[4] if len(times) > 4 else 0)  # idle, iowait
    return float(total), float(total - idle)


def busy_percent(before: tuple[float, float], after: tuple[float, float]) -> float:
    """CPU busy percentage between two :func:`cpu_times` samples (psutil's cpu_percent)."""
    total = after[0] - before[0]
    busy = after[1] - before[1]
    if total <= 0:
        return 0.0
    return min(max(100 * busy / total, 0.0), 100.0)


def memory_from_meminfo(meminfo: bytes) -> tuple[SimpleNamespace | None, SimpleNamespace | None]:
    """Memory ``total`` and ``available`` and swap ``total`` and ``used`` (bytes) from
    ``/proc/meminfo`` as psutil's virtual_memory() and swap_memory() compute them; either is None
    when the file lacks its fields (a kernel before 3.14 has no MemAvailable: psutil then
    estimates it)."""
    wanted = {b"MemTotal:", b"MemAvailable:", b"SwapTotal:", b"SwapFree:"}
    found: dict[bytes, int] = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(b" ")
        if key in wanted and (value := rest.split()):
            found[key] = int(value[0]) * 1024
            if len(found) == len(wanted):
                break
    memory = swap = None
    if b"MemTotal:" in found and b"MemAvailable:" in found:
        memory = SimpleNamespace(total=found[b"MemTotal:"], available=found[b"MemAvailable:"])
    if b"SwapTotal:" in found and b"SwapFree:" in found:
        total = found[b"SwapTotal:"]
        swap = SimpleNamespace(total=total, used=total - found[b"SwapFree:"])
    return memory, swap


class HostSource:
    """CPU busy fraction since the previous read, memory and swap of this machine, pages swapped
    in and out, time stalled waiting for memory (PSI), and whether the kernel migrates memory
    between NUMA nodes (a cause of step-time jitter).

    ``procfs_root`` is the procfs mount; where its files lack a field, psutil's own answer is
    used. A kernel without PSI or NUMA balancing (or a procfs without vmstat) omits those."""

    name = "host"
    target = "local"

    def __init__(self, procfs_root: Path = Path("/proc")) -> None:
        self.procfs_root = procfs_root
        self.numa_balancing_file = procfs_root / "sys" / "kernel" / "numa_balancing"
        self.pressure_file = procfs_root / "pressure" / "memory"
        self.vmstat_file = procfs_root / "vmstat"
        self._stat: HeldFile | None = None
        self._meminfo: HeldFile | None = None
        self._optional: dict[str, HeldFile] = {}
        self._cpu: tuple[float, float] | None = None

    async def start(self) -> None:
        """Open the procfs files and take the first CPU sample."""
        try:
            self._stat = HeldFile(str(self.procfs_root / "stat"))
            self._meminfo = HeldFile(str(self.procfs_root / "meminfo"))
            self._cpu = self._cpu_times()
        except OSError as e:
            await self.close()
            raise SourceError(f"{e.filename}: {e.strerror}") from e
        except ValueError as e:
            await self.close()
            raise SourceError(str(e)) from e
        for key, path in (
            ("numa", self.numa_balancing_file),
            ("pressure", self.pressure_file),
            ("vmstat", self.vmstat_file),
        ):
            try:
                self._optional[key] = HeldFile(str(path))
            except FileNotFoundError:
                pass  # a kernel built without the feature
            except OSError as e:
                await self.close()
                raise SourceError(f"{path}: {e.strerror}") from e

    def _cpu_times(self) -> tuple[float, float]:
        assert self._stat is not None
        return cpu_times(self._stat.read(STAT_HEAD))

    def _read_optional(self, key: str) -> bytes | None:
        held = self._optional.get(key)
        if held is None:
            return None
        try:
            return held.read()
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:  # PSI compiled in but off (psi=0)
                raise
            del self._optional[key]
            held.close()
            return None

    async def read(self) -> list[Reading]:
        if self._stat is None or self._meminfo is None or self._cpu is None:
            raise SourceError("host source read before start")
        try:
            now = self._cpu_times()
            memory, swap = memory_from_meminfo(self._meminfo.read())
            numa = self._read_optional("numa")
            pressure = self._read_optional("pressure")
            vmstat = self._read_optional("vmstat")
            cpu = busy_percent(self._cpu, now)
            readings = parse_host(
                cpu, memory or psutil.virtual_memory(), swap or psutil.swap_memory()
            )
            if numa is not None:
                readings += parse_numa_balancing(numa.decode())
            if pressure is not None:
                readings += parse_memory_pressure(pressure)
            if vmstat is not None:
                readings += parse_swap_activity(vmstat)
        except OSError as e:
            raise SourceError(f"{e.filename or self.procfs_root}: {e.strerror}") from e
        except ValueError as e:
            raise SourceError(f"{self.procfs_root}: {e}") from e
        self._cpu = now
        return readings

    async def close(self) -> None:
        for held in (self._stat, self._meminfo, *self._optional.values()):
            if held is not None:
                held.close()
        self._stat = self._meminfo = None
        self._optional = {}
