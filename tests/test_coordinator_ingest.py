"""The coordinator's telemetry ingest: what it keeps, what it counts as invalid."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hyperagent import bus
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator

TOPICS = bus.Topics("c")
KEY = b"k" * 32


def _coordinator(tmp_path: Path, nodes: list[str]) -> Coordinator:
    config = build_config(
        {
            "cluster": "c",
            "coordinator": {
                "state_dir": str(tmp_path),
                "metrics_address": "",
                "jobs": [{"id": "j", "nodes": nodes}, {"id": "other", "nodes": ["x"]}],
            },
        }
    )
    return Coordinator(config, bus.MqttLink("127.0.0.1", 1, "x"), KEY)


def _telemetry(node: str, jobs: object, ts: float = 5.0) -> bytes:
    return bus.encode(
        {"node": node, "ts": ts, "indicators": {}, "sources_up": {}, "jobs": jobs, "gpu": [1]}
    )


def test_telemetry_tracks_progress_of_the_jobs_nodes(tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(5000)]
    coordinator = _coordinator(tmp_path, nodes)

    async def feed() -> None:
        for node in ("n0", "n4999", "stranger"):
            payload = _telemetry(node, {"j": {"samples": 64, "step_s": 0.2}, "other": {}})
            await coordinator._on_telemetry(TOPICS.telemetry(node), payload)
        # a job's totals of the wrong type, no jobs at all, a job nobody tunes: ignored
        await coordinator._on_telemetry(
            TOPICS.telemetry("n1"), _telemetry("n1", {"j": {"samples": "many", "step_s": 1}})
        )
        await coordinator._on_telemetry(TOPICS.telemetry("n2"), _telemetry("n2", None))
        await coordinator._on_telemetry(
            TOPICS.telemetry("n3"), _telemetry("n3", {"nobody": {"samples": 1, "step_s": 1}})
        )

    asyncio.run(feed())
    assert coordinator.jobs["j"].progress == {
        "n0": (64.0, 0.2, 5.0, 1),
        "n4999": (64.0, 0.2, 5.0, 1),
    }
    assert coordinator.jobs["other"].progress == {}
    assert coordinator.invalid_payloads == 0


def test_invalid_telemetry_is_counted_not_fatal(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, ["n0"])
    good = _telemetry("n0", {"j": {"samples": 1, "step_s": 1.0}})
    bad = [
        (TOPICS.telemetry("n0"), b"not json"),
        (TOPICS.telemetry("n0"), b"[1, 2]"),
        (TOPICS.telemetry("n0"), bus.encode({"node": "n0", "ts": "late"})),
        (TOPICS.telemetry("n0"), good.replace(b'"schema":1', b'"schema":2')),
        ("somewhere/else/node/n0/telemetry/x", good),
    ]

    async def feed() -> None:
        for topic, payload in bad:
            await coordinator._on_telemetry(topic, payload)
        await coordinator._on_telemetry(TOPICS.telemetry("n0"), good)

    asyncio.run(feed())
    assert coordinator.invalid_payloads == len(bad)
    assert coordinator.jobs["j"].progress == {"n0": (1.0, 1.0, 5.0, 1)}


def test_job_membership_follows_the_jobs_config(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, ["n0", "n1"])
    state = coordinator.jobs["j"]
    assert state.has_node("n1") and not state.has_node("n2")
    state.config = state.config.model_copy(update={"nodes": ("n2",)})
    assert state.has_node("n2") and not state.has_node("n1")


def test_the_knobs_jobs_announce_narrow_the_space(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, ["n0", "n1"])
    state = coordinator.jobs["j"]
    assert state.space.allreduce == ("ring", "tree")

    async def feed() -> None:
        for node, knobs in (
            ("n0", ["bucket_mb", "chunk_kb", "allreduce"]),
            ("n1", ["chunk_kb", "bucket_mb"]),
            ("n1", "everything"),  # not a list: ignored, n1's earlier word stands
        ):
            jobs = {"j": {"samples": 1, "step_s": 1.0, "knobs": knobs}}
            await coordinator._on_telemetry(TOPICS.telemetry(node), _telemetry(node, jobs))

    asyncio.run(feed())
    assert state.knobs == {
        "n0": ("bucket_mb", "chunk_kb", "allreduce"),
        "n1": ("chunk_kb", "bucket_mb"),
    }
    assert state.announced_knobs == ("bucket_mb", "chunk_kb")  # what every node applies
    coordinator._follow_knobs(state)
    assert state.space.allreduce == ("ring",) and len(state.space.chunk_kb) == 11
    assert state.space.contains(state.tuner.ask())


def test_confirmations_resume_apart_from_the_trials(tmp_path: Path) -> None:
    from hyperagent.coordinator import TrialRecord
    from hyperagent.tuner.journal import JournalState

    coordinator = _coordinator(tmp_path, ["n0"])
    state = coordinator.jobs["j"]
    start = state.space.defaults()
    other = {**start, "bucket_mb": 64}

    def record(index: int, settings: dict, windows: list[float], confirmation: bool) -> dict:
        report = {"throughput": sum(windows) / len(windows), "windows": windows}
        trial = TrialRecord(index, index + 1, settings, report["throughput"], "ok")
        trial.reports, trial.confirmation = {"n0": report}, confirmation
        return trial.to_journal()

    entries = [
        record(0, start, [100.0, 100.0], False),
        record(1, other, [120.0, 120.0], False),
        record(2, start, [99.0, 101.0, 100.0, 100.0], True),
        record(3, other, [109.0, 111.0, 110.0, 110.0], True),
    ]
    coordinator._resume(state, JournalState(trials=entries))
    assert [t.index for t in state.trials] == [0, 1]
    assert [t.index for t in state.confirmations] == [2, 3]
    gain = coordinator.confirmed_gain(state, start, other)
    assert gain is not None and gain.better and abs(gain.value - 0.1) < 1e-9


def test_a_cap_change_settles_for_the_latency_the_nodes_measured(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, ["n0", "n1"])
    state = coordinator.jobs["j"]
    capped = {"bucket_mb": 25, "chunk_kb": 4096, "power_cap_w": 300, "allreduce": "ring"}
    # nothing measured yet: three of NVML's 1 s averaging windows
    assert coordinator._plan(state, capped).settle_s == 3.0
    state.version = 1  # v1 published

    async def acks() -> None:
        for node, latency in (("n0", 0.42), ("n1", 2.5), ("stranger", 9.0)):
            ack = {
                "job": "j",
                "node": node,
                "version": 1,
                "ok": True,
                "applied": {"power_cap_w": [300.0], "power_cap_latency_s": latency},
            }
            await coordinator._on_ack(TOPICS.ack("j", node), bus.encode(ack))

    asyncio.run(acks())
    # the slowest node's measured latency, plus the averaging window
    assert coordinator._plan(state, capped).settle_s == 2.5 + 1.0
    state.current = dict(capped)
    assert coordinator._plan(state, capped).settle_s == state.config.plan.settle_s  # no change


def _ack(node: str, version: int, job: str = "j") -> bytes:
    return bus.encode(
        {"job": job, "node": node, "version": version, "ok": True, "applied": {}, "ts": 1.0}
    )


def _report(node: str, version: int, partial: bool = False) -> bytes:
    return bus.encode(
        {
            "job": "j",
            "node": node,
            "version": version,
            "trial": 0,
            "samples": 64,
            "seconds": 1.0,
            "throughput": 64.0,
            "windows": [64.0],
            "steps": 4,
            "energy_j": None,
            "nonfinite_loss": False,
            "xid_errors": 0.0,
            "partial": partial,
            "stalled": False,
            "ts": 1.0,
        }
    )


def test_acks_and_reports_are_kept_only_for_the_version_in_play(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, ["n0", "n1"])
    state = coordinator.jobs["j"]

    async def scenario() -> None:
        # never published: a node naming v7 (a bug, a replay, another coordinator) is ignored
        await coordinator._on_ack(TOPICS.ack("j", "n0"), _ack("n0", 7))
        await coordinator._on_report(TOPICS.report("j", "n0"), _report("n0", 7))
        assert state.acks == {} and state.reports == {}
        for _ in range(300):  # a long tuning: trials, rollbacks, re-tunes
            version = coordinator._publish_settings(state, state.space.defaults(), None, None)
            for node in ("n0", "n1"):
                await coordinator._on_ack(TOPICS.ack("j", node), _ack(node, version))
                await coordinator._on_report(TOPICS.report("j", node), _report(node, version))
                await coordinator._on_report(
                    TOPICS.report("j", node), _report(node, version, partial=True)
                )
        # late messages of a version long gone change nothing
        await coordinator._on_ack(TOPICS.ack("j", "n0"), _ack("n0", 3))
        await coordinator._on_report(TOPICS.report("j", "n1"), _report("n1", 299))

    asyncio.run(scenario())
    assert state.version == 300
    for table in (state.acks, state.reports, state.partials):
        assert list(table) == [300] and set(table[300]) == {"n0", "n1"}


def test_only_the_nodes_of_configured_jobs_are_tracked(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    coordinator = _coordinator(tmp_path, ["n0", "n1"])

    async def statuses() -> None:
        for i in range(2000):  # a shared broker's other nodes, coming and going
            node = f"elsewhere-{i}"
            await coordinator._on_status(
                TOPICS.status(node), bus.status_message(TOPICS, node, "online").payload
            )
        for node in ("n0", "x"):
            await coordinator._on_status(
                TOPICS.status(node), bus.status_message(TOPICS, node, "online").payload
            )

    asyncio.run(statuses())
    assert set(coordinator.nodes) == {"n0", "x"}
    registry = CollectorRegistry()
    coordinator.update_metrics()
    registry.register(coordinator.collector)
    online = [
        s.labels["node"]
        for m in registry.collect()
        for s in m.samples
        if s.name == "hyperagent_node_online"
    ]
    assert sorted(online) == ["n0", "x"]


def test_the_journal_is_loaded_off_the_event_loop(tmp_path: Path) -> None:
    import threading

    from hyperagent.tuner.journal import Journal

    coordinator = _coordinator(tmp_path, ["n0"])
    state = coordinator.jobs["j"]
    threads: list[threading.Thread] = []
    load = Journal.load

    def recording_load(self: Journal) -> Any:
        threads.append(threading.current_thread())
        return load(self)

    async def start() -> None:
        task = asyncio.create_task(coordinator.tune(state))
        async with asyncio.timeout(10):
            while not threads:
                await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    Journal.load = recording_load  # type: ignore[method-assign]
    try:
        asyncio.run(start())
    finally:
        Journal.load = load  # type: ignore[method-assign]
    assert threads and threading.main_thread() not in threads
