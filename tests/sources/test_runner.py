"""A failing, hanging or absent source is reported as data while the others keep reporting."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pynvml
import pytest

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.cli import LogfmtFormatter
from hyperagent.errors import SourceError, SourceUnavailable
from hyperagent.readings import Reading
from hyperagent.sources.nvml import NvmlSource
from hyperagent.sources.runner import SourceRunner


class Hanging:
    name, target = "hang", "local"

    async def start(self) -> None:
        return None

    async def read(self) -> list[Reading]:
        await asyncio.sleep(3600)
        return []

    async def close(self) -> None:
        return None


class Absent(Hanging):
    name = "absent"

    async def read(self) -> list[Reading]:
        raise SourceUnavailable("no such hardware")


def health(readings: list[Reading]) -> dict[tuple[str, str], float]:
    return {(r.name, r.labels["source"]): r.value for r in readings if "source" in r.labels}


async def test_one_bad_source_never_stops_the_others(nvidia_smi_dir: Path) -> None:
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    # the bound must also fit the 8-GPU read (about 2 ms) on a loaded CI machine
    runner = SourceRunner([NvmlSource(nvml), Hanging(), Absent()], timeout_s=1.0)
    await runner.start()
    readings = await runner.read_all()
    h = health(readings)
    assert h[("hyperagent_source_up", "nvml")] == 1
    assert h[("hyperagent_source_up", "hang")] == 0
    assert h[("hyperagent_source_errors_total", "hang")] == 1
    assert h[("hyperagent_source_up", "absent")] == 0
    assert h[("hyperagent_source_errors_total", "absent")] == 0  # absent hardware is not an error
    assert sum(r.name == "hyperagent_gpu_power_watts" for r in readings) == 8

    nvml.fail(3, pynvml.NVML_ERROR_GPU_IS_LOST)
    h = health(await runner.read_all())
    assert h[("hyperagent_source_up", "nvml")] == 0
    assert h[("hyperagent_source_errors_total", "nvml")] == 1
    nvml.recover(3)
    h = health(await runner.read_all())
    assert h[("hyperagent_source_up", "nvml")] == 1
    await runner.close()


async def test_real_nvml_without_a_driver_is_up_zero_quietly() -> None:
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        has_gpu = True
    except pynvml.NVMLError:
        has_gpu = False
    runner = SourceRunner([NvmlSource(pynvml)], timeout_s=5)
    await runner.start()
    h = health(await runner.read_all())
    assert h[("hyperagent_source_up", "nvml")] == (1 if has_gpu else 0)
    assert h[("hyperagent_source_errors_total", "nvml")] == 0
    await runner.close()


class Deaf(Hanging):
    """A read that ignores its cancellation (a call the timeout cannot reach) until released,
    or until ``DEAF_FOR_S`` has passed (so that no test waits on it for ever): then it
    returns."""

    name, target = "deaf", "bmc-1"

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def read(self) -> list[Reading]:
        loop = asyncio.get_running_loop()
        deaf_until = loop.time() + DEAF_FOR_S
        while not self.release.is_set() and loop.time() < deaf_until:
            try:
                async with asyncio.timeout_at(deaf_until):
                    await self.release.wait()
            except (asyncio.CancelledError, TimeoutError):
                continue
        return [Reading("hyperagent_deaf", 1.0, {})]


DEAF_FOR_S = 4.0
CYCLE_BOUND_S = 2.0
"""A collection cycle ends well within this, however deaf a source is."""


class Flaky(Hanging):
    name, target = "flaky", "pdu-7"

    def __init__(self) -> None:
        self.failing = False

    async def read(self) -> list[Reading]:
        if self.failing:
            raise SourceError("no answer")
        return [Reading("hyperagent_flaky", 1.0, {})]


async def test_a_read_that_ignores_its_timeout_never_holds_the_cycle() -> None:
    deaf, flaky = Deaf(), Flaky()
    runner = SourceRunner([deaf, flaky], timeout_s=0.1)
    await runner.start()
    try:
        for cycle in range(3):
            async with asyncio.timeout(CYCLE_BOUND_S):
                readings = await runner.read_all()
            h = health(readings)
            assert h[("hyperagent_source_up", "deaf")] == 0, cycle
            assert h[("hyperagent_source_up", "flaky")] == 1, cycle
            assert ("hyperagent_source_last_success_timestamp_seconds", "deaf") not in h
            assert h[("hyperagent_source_errors_total", "deaf")] == cycle + 1
            assert any(r.name == "hyperagent_flaky" for r in readings)
        deaf.release.set()
        async with asyncio.timeout(5):
            while runner.overdue(deaf):
                await asyncio.sleep(0.01)
        h = health(await runner.read_all())
        assert h[("hyperagent_source_up", "deaf")] == 1
    finally:
        deaf.release.set()
        await runner.close()


async def test_up_is_zero_while_a_read_is_overdue_and_last_success_stops() -> None:
    deaf = Deaf()
    deaf.release.set()
    runner = SourceRunner([deaf], timeout_s=0.1)
    await runner.start()
    ok = {r.name: r.value for r in await runner.read_all()}
    last = ok["hyperagent_source_last_success_timestamp_seconds"]
    assert ok["hyperagent_source_up"] == 1 and last > 0
    deaf.release.clear()
    cycle = asyncio.create_task(runner.read_all())  # a cycle stuck in the read ...
    async with asyncio.timeout(5):
        while not runner.overdue(deaf):
            await asyncio.sleep(0.01)
    now = {r.name: r.value for r in runner.health_readings()}  # ... is up 0 before it ends
    assert now["hyperagent_source_up"] == 0
    assert now["hyperagent_source_last_success_timestamp_seconds"] == last
    await cycle
    deaf.release.set()
    await runner.close()


async def test_every_runner_line_names_the_source_and_target(
    caplog: pytest.LogCaptureFixture,
) -> None:
    flaky, deaf = Flaky(), Deaf()
    runner = SourceRunner([flaky, deaf], timeout_s=0.1)
    await runner.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="hyperagent.sources.runner"):
            await runner.read_all()
            flaky.failing = True
            await runner.read_all()
            flaky.failing = False
            await runner.read_all()
    finally:
        deaf.release.set()
        await runner.close()
    formatter = LogfmtFormatter()
    lines = [formatter.format(r) for r in caplog.records if r.name == "hyperagent.sources.runner"]
    flaky_lines = [line for line in lines if "flaky" in line]
    deaf_lines = [line for line in lines if "deaf" in line]
    assert len(flaky_lines) == 2 and len(deaf_lines) == 1 and len(lines) == 3  # each said once
    assert 'msg="source flaky (pdu-7) down: read: no answer"' in flaky_lines[0]
    assert 'msg="source flaky (pdu-7) recovered"' in flaky_lines[1]
    assert (
        'msg="source deaf (bmc-1) down: read: still in flight past its 0.1s timeout"'
        in (deaf_lines[0])
    )


async def test_a_hang_is_logged_once_and_its_duration_when_it_ends(
    nvidia_smi_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While NVML hangs, every cycle's read times out or finds the library busy "for N s" (a
    new N each time): one warning when the hang begins, one with its length when it ends."""
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    runner = SourceRunner([NvmlSource(nvml, timeout_s=0.1)], timeout_s=0.1)
    await runner.start()
    try:
        await runner.read_all()
        with caplog.at_level(logging.DEBUG, logger="hyperagent.sources.runner"):
            nvml.set_faults({"nvmlDeviceGetUtilizationRates": {"block_s": 0.8}})
            for _ in range(6):
                assert health(await runner.read_all())[("hyperagent_source_up", "nvml")] == 0
                await asyncio.sleep(0.1)
            nvml.set_faults(None)
            async with asyncio.timeout(10):
                while health(await runner.read_all())[("hyperagent_source_up", "nvml")] == 0:
                    await asyncio.sleep(0.1)
    finally:
        nvml.set_faults(None)
        await runner.close()
    said = [r for r in caplog.records if r.name == "hyperagent.sources.runner"]
    warnings = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("source nvml (local) down: read")
    ended = warnings[1]
    assert ended.startswith("source nvml (local) recovered after hanging for ")
    assert 0.5 <= float(ended.split()[-2]) < 10
