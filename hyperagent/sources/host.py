"""Host CPU, memory and swap through psutil; kernel NUMA balancing from procfs."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

from hyperagent.errors import SourceError
from hyperagent.readings import Reading


def parse_host(cpu_percent: float, memory: Any, swap: Any) -> list[Reading]:
    """Readings from psutil's cpu_percent(), virtual_memory() and swap_memory() results."""
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


def swap_from_meminfo(meminfo: bytes) -> SimpleNamespace | None:
    """Swap ``total`` and ``used`` (bytes) from ``/proc/meminfo`` as psutil.swap_memory()
    computes them; None when the file lacks SwapTotal or SwapFree (psutil then asks sysinfo)."""
    total = free = None
    for line in meminfo.splitlines():
        if line.startswith(b"Swap"):
            fields = line.split()
            if fields[0] == b"SwapTotal:":
                total = int(fields[1]) * 1024
            elif fields[0] == b"SwapFree:":
                free = int(fields[1]) * 1024
    if total is None or free is None:
        return None
    return SimpleNamespace(total=total, used=total - free)


def _swap() -> Any:
    """psutil.swap_memory()'s total and used, without its read of /proc/vmstat (swap-in and
    -out page counts, unused here): that file is most of its cost."""
    try:
        with open(f"{psutil.PROCFS_PATH}/meminfo", "rb") as f:
            swap = swap_from_meminfo(f.read())
    except (OSError, ValueError, IndexError):
        swap = None
    return psutil.swap_memory() if swap is None else swap


def _read_small(path: Path) -> str:
    """The text of a small procfs file: one open, read and close (``Path.read_text`` costs
    several times that, read every cycle)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
        if len(data) == 4096:
            chunks = [data]
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            data = b"".join(chunks)
    finally:
        os.close(fd)
    return data.decode()


class HostSource:
    """CPU busy fraction since the previous read, memory and swap of this machine, and whether
    the kernel migrates memory between NUMA nodes (a cause of step-time jitter)."""

    name = "host"
    target = "local"

    def __init__(self, procfs_root: Path = Path("/proc")) -> None:
        self.numa_balancing_file = procfs_root / "sys" / "kernel" / "numa_balancing"

    async def start(self) -> None:
        psutil.cpu_percent(interval=None)

    async def read(self) -> list[Reading]:
        readings = parse_host(psutil.cpu_percent(interval=None), psutil.virtual_memory(), _swap())
        try:
            text = _read_small(self.numa_balancing_file)
        except FileNotFoundError:
            return readings  # a kernel built without NUMA balancing
        except OSError as e:
            raise SourceError(f"{self.numa_balancing_file}: {e.strerror}") from e
        return readings + parse_numa_balancing(text)

    async def close(self) -> None:
        return None
