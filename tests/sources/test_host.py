"""Host source: CPU, memory and swap as psutil computes them, and the kernel's NUMA balancing
switch, from procfs files held open."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest

from hyperagent.errors import SourceError
from hyperagent.sources.host import (
    HostSource,
    busy_percent,
    cpu_times,
    memory_from_meminfo,
    parse_numa_balancing,
)


def procfs(tmp_path: Path, numa: str | None) -> Path:
    """A procfs tree: this machine's /proc/stat and /proc/meminfo, and ``numa``."""
    for name in ("stat", "meminfo"):
        shutil.copyfile(f"/proc/{name}", tmp_path / name)
    kernel = tmp_path / "sys" / "kernel"
    kernel.mkdir(parents=True)
    if numa is not None:
        (kernel / "numa_balancing").write_text(numa)
    return tmp_path


async def read(root: Path) -> dict[str, float]:
    source = HostSource(procfs_root=root)
    await source.start()
    try:
        return {r.name: r.value for r in await source.read()}
    finally:
        await source.close()


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


async def test_the_live_host_reads_as_psutil_reports_it() -> None:
    source = HostSource()
    await source.start()
    try:
        values = {r.name: r.value for r in await source.read()}
    finally:
        await source.close()
    memory, swap = psutil.virtual_memory(), psutil.swap_memory()
    assert values["hyperagent_host_memory_total_bytes"] == memory.total
    assert values["hyperagent_host_swap_total_bytes"] == swap.total
    assert values["hyperagent_host_memory_available_bytes"] == pytest.approx(
        memory.available, rel=0.05
    )
    assert 0 <= values["hyperagent_host_cpu_utilization_ratio"] <= 1


async def test_cpu_utilisation_follows_proc_stat_between_reads(tmp_path: Path) -> None:
    root = procfs(tmp_path, "0\n")
    (root / "stat").write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 100 0 100 800 0 0 0 0 0 0\n")
    source = HostSource(procfs_root=root)
    await source.start()
    # 300 more jiffies: 150 user, 30 system, 100 idle, 20 iowait -> 60% busy
    (root / "stat").write_text("cpu  250 0 130 900 20 0 0 0 0 0\ncpu0 250 0 130 900 20 0 0 0 0 0\n")
    values = {r.name: r.value for r in await source.read()}
    await source.close()
    assert values["hyperagent_host_cpu_utilization_ratio"] == pytest.approx(0.6)


def test_cpu_times_count_guest_time_once_and_iowait_as_idle() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    before = cpu_times(b"cpu  100 10 50 800 40 0 0 0 20 5\n")
    after = cpu_times(b"cpu  200 10 100 850 50 0 0 0 60 5\n")
    assert before == (1000.0, 160.0)
    assert busy_percent(before, after) == pytest.approx(100 * 150 / 210)
    assert busy_percent(after, after) == 0.0
    with pytest.raises(ValueError, match="cpu line"):
        cpu_times(b"intr 12 3\n")


async def test_an_unreadable_proc_stat_is_an_error_naming_it(tmp_path: Path) -> None:
    root = procfs(tmp_path, "1\n")
    (root / "stat").write_text("garbage\n")
    with pytest.raises(SourceError, match="cpu line"):
        await HostSource(procfs_root=root).start()


def test_garbage_is_an_error_naming_the_key() -> None:
    assert parse_numa_balancing("2")[0].value == 2
    with pytest.raises(SourceError, match="numa_balancing"):
        parse_numa_balancing("enabled")


def test_memory_and_swap_from_meminfo_are_what_psutil_reports() -> None:
    meminfo = (
        b"MemTotal:       16303824 kB\n"
        b"MemFree:         1000000 kB\n"
        b"MemAvailable:    9000000 kB\n"
        b"SwapCached:        12345 kB\n"
        b"SwapTotal:       8388604 kB\n"
        b"SwapFree:        7388604 kB\n"
    )
    memory, swap = memory_from_meminfo(meminfo)
    assert memory is not None and swap is not None
    assert (memory.total, memory.available) == (16303824 * 1024, 9000000 * 1024)
    assert (swap.total, swap.used) == (8388604 * 1024, 1000000 * 1024)
    assert memory_from_meminfo(b"MemTotal:       16303824 kB\n") == (None, None)
    with open("/proc/meminfo", "rb") as live:
        memory, swap = memory_from_meminfo(live.read())
    assert memory is not None and memory.total == psutil.virtual_memory().total
    assert swap is not None and swap.total == psutil.swap_memory().total
