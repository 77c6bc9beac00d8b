"""The device gate: one call in flight per library, each bounded by its timeout, a hung call
refusing the rest at once instead of piling threads up."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.errors import DeviceBusy, DeviceTimeout
from hyperagent.gate import DeviceGate

from conftest import FIXTURES


def test_every_holder_of_a_library_shares_its_gate() -> None:
    one = FakeNvml.from_capture(FIXTURES / "nvidia-smi" / "gtx-1card.xml")
    other = FakeNvml.from_capture(FIXTURES / "nvidia-smi" / "gtx-1card.xml")
    assert DeviceGate.of(one) is DeviceGate.of(one)
    assert DeviceGate.of(one) is not DeviceGate.of(other)


async def test_a_hung_call_times_out_and_later_calls_fail_fast_without_new_threads() -> None:
    gate = DeviceGate("nvml")
    release = threading.Event()
    try:
        with pytest.raises(DeviceTimeout, match=r"nvml hang: timed out after 0.2 s"):
            await gate.run(release.wait, 30, timeout_s=0.2, what="hang")
        threads = threading.active_count()
        for _ in range(20):
            with pytest.raises(DeviceBusy, match=r"nvml busy: a call \(hang\) has been in flight"):
                await gate.run(time.time, timeout_s=0.2)
        with pytest.raises(DeviceBusy):
            await asyncio.to_thread(gate.call, time.time, timeout_s=0.2)
        assert threading.active_count() <= threads + 1  # to_thread's own worker at most
        assert gate.busy == 21 and gate.timeouts == 1
    finally:
        release.set()
    async with asyncio.timeout(10):
        while gate.in_flight is not None:
            await asyncio.sleep(0.01)
    assert await gate.run(lambda: "answered", timeout_s=1) == "answered"


async def test_a_call_waits_behind_a_healthy_one_and_errors_reach_the_caller() -> None:
    gate = DeviceGate("nvml")
    started = threading.Event()

    def slow() -> str:
        started.set()
        time.sleep(0.2)
        return "slow"

    first = asyncio.create_task(gate.run(slow, timeout_s=5))
    await asyncio.to_thread(started.wait, 5)
    assert await gate.run(lambda: "second", timeout_s=5) == "second"
    assert await first == "slow"
    with pytest.raises(ZeroDivisionError):
        await gate.run(lambda: 1 / 0, timeout_s=5)
    assert gate.busy == 0 and gate.timeouts == 0


async def test_a_call_that_gave_up_in_the_queue_never_runs() -> None:
    gate = DeviceGate("nvml")
    release = threading.Event()
    ran: list[str] = []
    first = asyncio.create_task(gate.run(release.wait, 5, timeout_s=5))
    while gate.in_flight is None:
        await asyncio.sleep(0.01)
    with pytest.raises(DeviceTimeout, match=r"waited 0\.1 s behind another call"):
        await gate.run(ran.append, "queued", timeout_s=0.1)
    release.set()
    assert await first is True
    assert await gate.run(ran.append, "later", timeout_s=5) is None
    assert ran == ["later"]


def test_a_gated_call_may_call_the_gate_again() -> None:
    gate = DeviceGate("nvml")
    assert gate.call(lambda: gate.call(lambda: 7, timeout_s=1), timeout_s=1) == 7
