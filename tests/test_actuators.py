"""Power capping through the NVML interface, on fake GPUs that enforce NVML's constraints."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pynvml
import pytest

from hyperagent.actuators import PowerCapActuator
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.errors import ActuationError, NoPermission


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


def test_a_failure_on_gpu_3_of_8_puts_every_gpu_back_and_names_it(
    nvidia_smi_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "power-limits.json"
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    actuator = PowerCapActuator(nvml, state)
    actuator.apply(175)
    assert limits_w(nvml) == [175.0] * 8
    nvml.set_faults(
        {"nvmlDeviceSetPowerManagementLimit": {"error": "NVML_ERROR_UNKNOWN", "gpus": [3]}}
    )
    with pytest.raises(ActuationError) as e:
        actuator.apply(150)
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(3))
    assert f"GPU 3 ({uuid})" in str(e.value) and "Unknown Error" in str(e.value)
    assert e.value.vendor_code == pynvml.NVML_ERROR_UNKNOWN
    assert limits_w(nvml) == [175.0] * 8  # the limits before this apply, on every GPU
    nvml.set_faults(None)
    assert actuator.restore() == 8 and limits_w(nvml) == [250.0] * 8 and not state.exists()


def test_a_restore_that_overlaps_an_apply_or_another_restore_runs_after_it(
    nvidia_smi_dir: Path,
) -> None:
    # The agent restores on shutdown while a coordinator-offline restore (or an apply from the
    # MQTT handler) may still run in its worker thread: each call runs whole, one after another.
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    actuator = PowerCapActuator(nvml)
    actuator.apply(150)
    nvml.set_faults({"nvmlDeviceGetPowerManagementLimit": {"block_s": 0.01}})
    start = threading.Barrier(3)

    def after_start(call: Any, *args: Any) -> Any:
        start.wait(timeout=5)
        return call(*args)

    with ThreadPoolExecutor(3) as pool:
        runs = [
            pool.submit(after_start, actuator.restore),
            pool.submit(after_start, actuator.restore),
            pool.submit(after_start, actuator.apply, 175),
        ]
        restored = sorted(run.result(timeout=30) for run in runs[:2])
        applied = runs[2].result(timeout=30)
    assert all(cap.applied_w == 175.0 for cap in applied)
    # the apply ran first (both restores put back all 8), between them (8 then 8) or last
    assert restored in ([0, 8], [8, 8])
    expected = [250.0] * 8 if actuator.original_mw == {} else [175.0] * 8
    assert limits_w(nvml) == expected


def test_a_failure_on_the_first_change_leaves_the_originals_and_no_state(
    nvidia_smi_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "power-limits.json"
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    nvml.set_faults(
        {"nvmlDeviceSetPowerManagementLimit": {"error": "NVML_ERROR_GPU_IS_LOST", "gpus": [5]}}
    )
    actuator = PowerCapActuator(nvml, state)
    lost = r"GPU 5 \(GPU-[0-9a-f-]+\) power limit: GPU is lost"
    with pytest.raises(ActuationError, match=lost):
        actuator.apply(150)
    assert limits_w(nvml) == [250.0] * 8
    assert actuator.original_mw == {} and not state.exists()  # nothing left to restore


def test_a_set_call_that_hangs_times_out_and_its_originals_stay_for_restore(
    nvidia_smi_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml")
    nvml.set_faults({"nvmlDeviceSetPowerManagementLimit": {"block_s": 1.0, "gpus": [2]}})
    actuator = PowerCapActuator(nvml, tmp_path / "power-limits.json", timeout_s=0.2)
    hung = r"GPU 2 \(GPU-.*\) power limit: nvml nvmlDeviceSetPowerManagementLimit: timed out"
    with pytest.raises(ActuationError, match=hung):
        actuator.apply(150)
    # the library is busy with the hung call: the put-backs fail at once, each one logged
    put_back = [r.getMessage() for r in caplog.records if "could not put back" in r.getMessage()]
    assert [m.split(":")[0] for m in put_back] == [
        f"GPU {i} ({nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))})" for i in (0, 1, 2)
    ]
    assert all("busy: a call (nvmlDeviceSetPowerManagementLimit)" in m for m in put_back)
    assert len(actuator.original_mw) == 3  # kept, in memory and in the state file
    nvml.set_faults(None)
    while actuator.gate.in_flight is not None:  # the hung call returns after its 1 s
        time.sleep(0.01)
    assert actuator.restore() == 3 and limits_w(nvml) == [250.0] * 8


def test_the_restore_file_is_fsynced_before_it_replaces_the_old_one(
    nvidia_smi_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "power-limits.json"
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        assert str(src) in synced, "renamed over the state file before it was on disk"
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    PowerCapActuator(FakeNvml.from_capture(nvidia_smi_dir / "gtx-8card.xml"), state).apply(150)
    assert orjson.loads(state.read_bytes()) and synced
    assert all(Path(p).parent == tmp_path for p in synced)
