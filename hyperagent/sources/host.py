"""Host CPU, memory and swap through psutil; kernel NUMA balancing from procfs."""

from __future__ import annotations

from pathlib import Path
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
        readings = parse_host(
            psutil.cpu_percent(interval=None), psutil.virtual_memory(), psutil.swap_memory()
        )
        try:
            text = self.numa_balancing_file.read_text()
        except FileNotFoundError:
            return readings  # a kernel built without NUMA balancing
        except OSError as e:
            raise SourceError(f"{self.numa_balancing_file}: {e.strerror}") from e
        return readings + parse_numa_balancing(text)

    async def close(self) -> None:
        return None
