"""Host source: psutil readings and the kernel's NUMA balancing switch from procfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperagent.errors import SourceError
from hyperagent.sources.host import HostSource, parse_numa_balancing, swap_from_meminfo


def procfs(tmp_path: Path, numa: str | None) -> Path:
    kernel = tmp_path / "sys" / "kernel"
    kernel.mkdir(parents=True)
    if numa is not None:
        (kernel / "numa_balancing").write_text(numa)
    return tmp_path


async def read(root: Path) -> dict[str, float]:
    source = HostSource(procfs_root=root)
    await source.start()
    return {r.name: r.value for r in await source.read()}


async def test_numa_balancing_on_is_reported(tmp_path: Path) -> None:
    values = await read(procfs(tmp_path, "1\n"))
    assert values["hyperagent_host_numa_balancing_mode"] == 1
    assert 0 <= values["hyperagent_host_cpu_utilization_ratio"] <= 1
    assert (
        values["hyperagent_host_memory_available_bytes"]
        <= values["hyperagent_host_memory_total_bytes"]
    )


async def test_kernel_without_numa_balancing_omits_it(tmp_path: Path) -> None:
    values = await read(procfs(tmp_path, None))
    assert "hyperagent_host_numa_balancing_mode" not in values
    assert "hyperagent_host_memory_total_bytes" in values


def test_garbage_is_an_error_naming_the_key() -> None:
    assert parse_numa_balancing("2")[0].value == 2
    with pytest.raises(SourceError, match="numa_balancing"):
        parse_numa_balancing("enabled")


def test_swap_from_meminfo_is_what_psutil_reports() -> None:
    meminfo = (
        b"MemTotal:       16303824 kB\n"
        b"SwapCached:        12345 kB\n"
        b"SwapTotal:       8388604 kB\n"
        b"SwapFree:        7388604 kB\n"
    )
    swap = swap_from_meminfo(meminfo)
    assert swap is not None
    assert (swap.total, swap.used) == (8388604 * 1024, 1000000 * 1024)
    assert swap_from_meminfo(b"MemTotal:       16303824 kB\n") is None
