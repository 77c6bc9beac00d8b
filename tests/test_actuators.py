"""Power capping through the NVML interface, on fake GPUs that enforce NVML's constraints."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from hyperagent.actuators import PowerCapActuator
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.errors import NoPermission


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


class Clock:
    """Fake time, moved on only by the actuator's own sleeps between polls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.now += seconds


def test_cap_latency_is_the_time_until_instant_power_is_under_the_new_cap(
    nvidia_smi_dir: Path,
) -> None:
    clock = Clock()
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml", clock=clock, cap_response_s=0.25)
    nvml.nvmlInit()
    draws_w = [
        nvml.nvmlDeviceGetPowerUsage(nvml.nvmlDeviceGetHandleByIndex(i)) / 1000 for i in range(8)
    ]
    over = [i for i, draw in enumerate(draws_w) if draw > 150]
    assert 0 < len(over) < 8  # the capture has busy GPUs and idle ones
    actuator = PowerCapActuator(nvml, clock=clock, sleep=clock.sleep, poll_s=0.02)
    assert actuator.last_latency_s is None
    caps = actuator.apply(150)  # a busy V100S draws over 150 W until 0.25 s after its set call
    for cap in caps:
        assert cap.changed and cap.latency_s is not None
        if cap.gpu in over:
            assert 0.25 <= cap.latency_s < 0.25 + 0.02 + 1e-9, cap
        else:
            assert cap.latency_s == 0.0, cap  # already under the new cap
    assert actuator.last_latency_s == max(c.latency_s or 0.0 for c in caps)
    unchanged = actuator.apply(150)
    assert [c.latency_s for c in unchanged] == [None] * 8
    slept = clock.slept
    raised = actuator.apply(250)  # a higher cap holds at once: nothing to wait for
    assert [c.latency_s for c in raised] == [0.0] * 8 and clock.slept == slept


def test_a_gpu_that_stays_over_the_cap_is_waited_for_at_most_the_timeout(
    nvidia_smi_dir: Path,
) -> None:
    clock = Clock()
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-1card.xml", clock=clock, cap_response_s=60)
    actuator = PowerCapActuator(nvml, clock=clock, sleep=clock.sleep, latency_timeout_s=2.0)
    (cap,) = actuator.apply(100)
    assert cap.changed and cap.latency_s is None
    assert 2.0 <= clock.now < 2.1
    assert actuator.last_latency_s is None


class NoInstantPower(FakeNvml):
    """A GPU whose driver answers NOT_SUPPORTED for the instant power field."""

    def nvmlDeviceGetFieldValues(self, handle: object, fieldIds: list[object]) -> object:
        found = super().nvmlDeviceGetFieldValues(handle, fieldIds)  # type: ignore[arg-type]
        for value in found:
            if value.fieldId == pynvml.NVML_FI_DEV_POWER_INSTANT:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return found


def test_without_instant_power_the_latency_is_unknown_and_nothing_waits(
    nvidia_smi_dir: Path,
) -> None:
    from hyperagent.capture.nvidia_smi import parse_capture

    clock = Clock()
    gpus = parse_capture((nvidia_smi_dir / "gtx-1card.xml").read_text())
    nvml = NoInstantPower(gpus, clock=clock, cap_response_s=60)
    (cap,) = PowerCapActuator(nvml, clock=clock, sleep=clock.sleep).apply(100)
    assert cap.changed and cap.latency_s is None and clock.slept == 0
