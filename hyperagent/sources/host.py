"""Host CPU, memory and swap through psutil."""

from __future__ import annotations

from typing import Any

import psutil

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


class HostSource:
    """CPU busy fraction since the previous read, memory and swap of this machine."""

    name = "host"
    target = "local"

    async def start(self) -> None:
        psutil.cpu_percent(interval=None)

    async def read(self) -> list[Reading]:
        return parse_host(
            psutil.cpu_percent(interval=None), psutil.virtual_memory(), psutil.swap_memory()
        )

    async def close(self) -> None:
        return None
