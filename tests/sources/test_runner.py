"""A failing, hanging or absent source is reported as data while the others keep reporting."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pynvml

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.errors import SourceUnavailable
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
