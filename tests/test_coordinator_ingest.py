"""The coordinator's telemetry ingest: what it keeps, what it counts as invalid."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
    assert coordinator.jobs["j"].progress == {"n0": (64.0, 0.2, 5.0), "n4999": (64.0, 0.2, 5.0)}
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
    assert coordinator.jobs["j"].progress == {"n0": (1.0, 1.0, 5.0)}


def test_job_membership_follows_the_jobs_config(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, ["n0", "n1"])
    state = coordinator.jobs["j"]
    assert state.has_node("n1") and not state.has_node("n2")
    state.config = state.config.model_copy(update={"nodes": ("n2",)})
    assert state.has_node("n2") and not state.has_node("n1")
