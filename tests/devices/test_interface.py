"""One contract for every vendor library: the same questions asked of NVML (FakeNvml over a
V100S capture), amdsmi (FakeAmdsmi over the MI300X capture) and HLML (FakeHlml over the Gaudi
capture) get answers in the same units."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hyperagent.capture.fake_amdsmi import FakeAmdsmi
from hyperagent.capture.fake_hlml import FakeHlml
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.devices import as_library
from hyperagent.devices.amd import AmdsmiLibrary
from hyperagent.devices.base import DeviceLibrary
from hyperagent.devices.gaudi import HlmlLibrary

from conftest import FIXTURES

LIBRARIES: dict[str, Callable[[], DeviceLibrary]] = {
    "nvidia": lambda: as_library(FakeNvml.from_capture(FIXTURES / "nvidia-smi" / "gtx-8card.xml")),
    "amd": lambda: AmdsmiLibrary(
        FakeAmdsmi.from_capture(FIXTURES / "replay" / "amd-mi300x-8gpu"), check_s=0
    ),
    "intel": lambda: HlmlLibrary(FakeHlml.from_capture(FIXTURES / "replay" / "gaudi-hl205-8card")),
}
EXPECTED: dict[str, dict[str, Any]] = {
    "nvidia": {"model": "Tesla V100S-PCIE-32GB", "power_w": 232.8, "total": 32510 * 2**20},
    "amd": {"model": "AMD Instinct MI300X", "power_w": 133.0, "total": 196592 * 2**20},
    "intel": {"model": "HL-205", "power_w": 103.0, "total": 32768 * 2**20},
}


@pytest.mark.parametrize("vendor", sorted(LIBRARIES))
def test_every_library_answers_the_same_questions_in_the_same_units(vendor: str) -> None:
    library = LIBRARIES[vendor]()
    assert library.vendor == vendor
    devices = library.devices()
    assert len(devices) == 8
    first = devices[0]
    expected = EXPECTED[vendor]
    assert first.identity.model == expected["model"] and first.identity.index == 0
    assert first.identity.info["vendor"] == vendor
    assert first.power_w() == pytest.approx(expected["power_w"])
    memory = first.memory()
    assert memory is not None and memory.total_bytes == expected["total"]
    activity = first.activity()
    assert activity is not None and 0 <= activity.compute <= 1  # type: ignore[operator]
    assert first.energy_j() is not None
    assert "gpu" in first.temperatures_c()
    low, high = first.power_limit_constraints_mw()
    assert 0 <= low < high
    target = (low + high) // 2 // 1000 * 1000
    first.set_power_limit_mw(target)
    assert first.power_limit_mw() == target
    assert library.by_uuid(first.identity.uuid).power_limit_mw() == target
    assert [d.identity.uuid for d in library.power_devices()] == [d.identity.uuid for d in devices]
