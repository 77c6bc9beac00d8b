"""Broker outage: mosquitto killed for 30 s during a trial, with the shipped timeouts (the
trial's clocks stop while the broker is away), loses no trial and no report and counts none
twice; spooled messages survive an agent restart."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hyperagent.coordinator import Coordinator
from hyperagent.demo import JOB, simulated_cluster
from hyperagent.spool import Spool
from hyperagent.tuner.tuning import JobTuning as JobState

from conftest import Mosquitto

OUTAGE_S = 30.0


@pytest.mark.long(70)
async def test_reports_survive_a_30s_broker_outage(mosquitto: Mosquitto) -> None:
    loop = asyncio.get_running_loop()
    outage: dict[str, float] = {}

    def kill_then_restart(state: JobState, record: Any) -> None:
        if record.index != 0:
            return

        def kill() -> None:
            assert mosquitto.process is not None
            mosquitto.process.send_signal(signal.SIGKILL)
            mosquitto.process.wait(10)
            mosquitto.process = None
            outage["killed"] = loop.time()

        loop.call_later(1.0, kill)
        loop.call_later(1.0 + OUTAGE_S, lambda: loop.run_in_executor(None, mosquitto.start))

    accepted: Counter[tuple[int, str]] = Counter()
    deliveries: Counter[tuple[int, str]] = Counter()
    original = Coordinator._route

    def counting_route(self: Coordinator, topic: str, payload: bytes, kind: str) -> None:
        original(self, topic, payload, kind)
        if kind == "report" and b'"partial":false' in payload:
            import orjson

            message = orjson.loads(payload)
            key = (message["version"], message["node"])
            deliveries[key] += 1
            accepted[key] = 1

    Coordinator._route = counting_route  # type: ignore[method-assign]
    try:
        async with simulated_cluster(
            mosquitto.url,
            nodes=3,
            trials=3,
            seed=4,
            speedup=10,
            on_trial=kill_then_restart,
            job_overrides={
                "abort_below": 0,
                "early_stop": False,
            },  # the shipped ack_timeout_s (30 s) < the outage
        ) as (coordinator, nodes, _):
            await coordinator.run(until_tuned=True)
            state = coordinator.jobs[JOB]
            sent = sum(n.agent.stats.reports_sent for n in nodes)
            spooled_left = sum(len(n.agent.link.spool) for n in nodes)  # type: ignore[union-attr]
    finally:
        Coordinator._route = original  # type: ignore[method-assign]
    assert "killed" in outage
    # three trials, then the start and the best re-measured interleaved
    runs = [*state.trials, *state.confirmations]
    assert [t.status for t in runs] == ["ok"] * 7
    for trial in runs:
        assert set(trial.reports) == {"node-0", "node-1", "node-2"}
    assert spooled_left == 0
    assert sum(accepted.values()) == sent == 3 * 7  # every report accepted exactly once
    print(
        f"reports sent {sent}, accepted {sum(accepted.values())}, broker deliveries "
        f"{sum(deliveries.values())} (duplicates the coordinator ignored: "
        f"{sum(deliveries.values()) - sum(accepted.values())})"
    )


def test_spool_keeps_order_and_survives_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, limit=3)
    for i in range(5):
        spool.append("t/report", f"r{i}".encode(), 1, False)
    assert spool.dropped == 2 and [m.payload for m in spool.pending] == [b"r2", b"r3", b"r4"]
    first = spool.first()
    assert first is not None
    spool.sent(first)
    (tmp_path / "junk.msg").write_bytes(b"not a header")
    again = Spool(tmp_path, limit=3)  # the process restarted
    assert [m.payload for m in again.pending] == [b"r3", b"r4"] and again.dropped == 1
    again.append("t/ack", b"a", 1, False)
    assert [m.payload for m in again.pending] == [b"r3", b"r4", b"a"]
