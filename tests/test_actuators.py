"""Power capping through the NVML interface, on fake GPUs that enforce NVML's constraints."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from hyperagent.actuators import PowerCapActuator
from hyperagent.errors import NoPermission
from hyperagent.testing.fake_nvml import FakeNvml


def limits_w(nvml: FakeNvml) -> list[float]:
    nvml.nvmlInit()
    return [
        nvml.nvmlDeviceGetEnforcedPowerLimit(nvml.nvmlDeviceGetHandleByIndex(i)) / 1000
        for i in range(nvml.nvmlDeviceGetCount())
    ]


def test_caps_every_gpu_clamped_and_restores(nvidia_smi_dir: Path) -> None:
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    actuator = PowerCapActuator(nvml)
    assert actuator.limits_w() == (100.0, 250.0)
    caps = actuator.apply(175)
    assert [c.applied_w for c in caps] == [175.0] * 8 and all(c.changed for c in caps)
    assert limits_w(nvml) == [175.0] * 8
    assert not any(c.changed for c in actuator.apply(175))  # no-op writes are skipped
    assert [c.applied_w for c in actuator.apply(40)] == [100.0] * 8  # clamped to the minimum
    assert [c.applied_w for c in actuator.apply(900)] == [250.0] * 8
    actuator.apply(150)
    assert actuator.restore() == 8
    assert limits_w(nvml) == [250.0] * 8  # the limits before hyperagent touched them


def test_fake_rejects_what_nvml_rejects(nvidia_smi_dir: Path) -> None:
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "tesla-t4.xml")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    _, high = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceSetPowerManagementLimit(handle, high + 1000)
    # the actuator never asks for that: it clamps first
    applied = PowerCapActuator(nvml).apply(high / 1000 + 1)
    assert applied[0].applied_w == high / 1000


def test_no_permission_is_translated(nvidia_smi_dir: Path) -> None:
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-1card.xml", writable=False)
    with pytest.raises(NoPermission) as e:
        PowerCapActuator(nvml).apply(150)
    assert e.value.vendor_code == pynvml.NVML_ERROR_NO_PERMISSION


def test_originals_survive_a_crash_in_the_state_file(nvidia_smi_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "power-limits.json"
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    PowerCapActuator(nvml, state).apply(150)  # then the process dies without restoring
    assert state.exists() and limits_w(nvml) == [150.0] * 8
    restarted = PowerCapActuator(nvml, state)
    assert restarted.recover() == 8
    assert limits_w(nvml) == [250.0] * 8 and not state.exists()
    assert restarted.recover() == 0  # nothing left to do


def test_garbage_state_file_is_reported_not_fatal(nvidia_smi_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "power-limits.json"
    state.write_text("{not json")
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    assert PowerCapActuator(nvml, state).recover() == 0
