"""Host source: CPU, memory and swap as psutil computes them, swap activity, memory stall time
(PSI) and the kernel's NUMA balancing switch, from procfs files held open."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyperagent.errors import SourceError
from hyperagent.sources.host import (
    HostSource,
    busy_percent,
    cpu_times,
    memory_from_meminfo,
    parse_memory_pressure,
    parse_numa_balancing,
    parse_swap_activity,
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


def psi(some_us: int, full_us: int) -> str:
    """/proc/pressure/memory as the kernel writes it (Documentation/accounting/psi.rst)."""
    return (
        f"some avg10=1.53 avg60=0.87 avg300=0.24 total={some_us}\n"
        f"full avg10=0.98 avg60=0.52 avg300=0.13 total={full_us}\n"
    )


def vmstat(swapped_in: int, swapped_out: int) -> str:
    """The swap lines of /proc/vmstat among their neighbours, as the kernel writes them."""
    return f"pgpgout 1203384\npswpin {swapped_in}\npswpout {swapped_out}\npgalloc_dma 4\n"


async def read(root: Path) -> dict[str, float]:
    return {key: value for key, value in (await labelled(root)).items() if "=" not in key}


async def labelled(root: Path) -> dict[str, float]:
    """Readings by name, and by ``name{label=value}`` for labelled ones."""
    source = HostSource(procfs_root=root)
    await source.start()
    try:
        return {key(r.name, r.labels): r.value for r in await source.read()}
    finally:
        await source.close()


def key(name: str, labels: Mapping[str, str]) -> str:
    inner = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


STALL = "hyperagent_host_memory_pressure_stall_seconds_total"
SWAPPED = "hyperagent_host_swap_pages_total"


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


async def test_memory_stall_time_and_swap_activity_follow_the_kernel_files(tmp_path: Path) -> None:
    root = procfs(tmp_path, "0\n")
    (root / "pressure").mkdir()
    (root / "pressure" / "memory").write_text(psi(2_500_000, 1_000_000))
    (root / "vmstat").write_text(vmstat(10, 300))
    source = HostSource(procfs_root=root)
    await source.start()
    try:
        first = {key(r.name, r.labels): r.value for r in await source.read()}
        (root / "pressure" / "memory").write_text(psi(9_000_000, 4_250_000))
        (root / "vmstat").write_text(vmstat(4096, 300))
        second = {key(r.name, r.labels): r.value for r in await source.read()}
    finally:
        await source.close()
    assert first[f"{STALL}{{kind=some}}"] == 2.5
    assert first[f"{STALL}{{kind=full}}"] == 1.0
    assert (first[f"{SWAPPED}{{direction=in}}"], first[f"{SWAPPED}{{direction=out}}"]) == (10, 300)
    assert second[f"{STALL}{{kind=some}}"] == 9.0
    assert second[f"{STALL}{{kind=full}}"] == 4.25
    assert second[f"{SWAPPED}{{direction=in}}"] == 4096


async def test_a_kernel_without_psi_or_vmstat_omits_them(tmp_path: Path) -> None:
    values = await labelled(procfs(tmp_path, "0\n"))
    assert not [name for name in values if name.startswith((STALL, SWAPPED))]
    assert "hyperagent_host_memory_available_bytes" in values


async def test_the_live_kernel_s_stall_time_and_swap_counters_are_read() -> None:
    try:
        with open("/proc/pressure/memory", "rb") as pressure:  # noqa: ASYNC230 (procfs)
            before = parse_memory_pressure(pressure.read())
    except FileNotFoundError:
        pytest.skip("this kernel has no PSI")
    values = await labelled(Path("/proc"))
    for reading in before:
        assert values[key(reading.name, reading.labels)] >= reading.value
    assert {f"{SWAPPED}{{direction=in}}", f"{SWAPPED}{{direction=out}}"} <= set(values)


def test_garbled_pressure_and_vmstat_lines_are_errors_naming_the_file() -> None:
    assert [r.labels["kind"] for r in parse_memory_pressure(psi(1, 0).encode())] == [
        "some",
        "full",
    ]
    with pytest.raises(ValueError, match="/proc/pressure/memory"):
        parse_memory_pressure(b"some avg10=0.00 avg60=0.00 avg300=0.00\n")
    with pytest.raises(ValueError, match="/proc/vmstat"):
        parse_swap_activity(b"pswpin lots\n")
    assert parse_swap_activity(b"nr_free_pages 10\n") == []


async def test_a_garbled_pressure_file_fails_the_read_naming_it(tmp_path: Path) -> None:
    root = procfs(tmp_path, "0\n")
    (root / "pressure").mkdir()
    (root / "pressure" / "memory").write_text("some total=x\n")
    with pytest.raises(SourceError, match="pressure/memory"):
        await labelled(root)


@given(st.binary(max_size=200) | st.sampled_from([psi(5, 3).encode(), vmstat(1, 2).encode()]))
def test_any_bytes_parse_or_fail_with_a_message_naming_the_file(data: bytes) -> None:
    for parse, name in ((parse_memory_pressure, "pressure"), (parse_swap_activity, "vmstat")):
        try:
            readings = parse(data)
        except ValueError as e:
            assert name in str(e)
        else:
            assert all(r.value >= 0 for r in readings)
