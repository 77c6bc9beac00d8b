"""The faults of tests/tuner/test_job_faults.py on a running loop: real mosquitto, agents over
fake GPUs with simulated ranks, the coordinator's journal. What a user of the product sees:
trials spent or not, what the journal says, whether the tuning ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator, coordinator_link
from hyperagent.demo import JOB, SimulatedNode, cluster_config, simulated_cluster
from hyperagent.signing import SigningKey

from conftest import REPO, Mosquitto


def journal(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / f"{JOB}.jsonl"
    lines = path.read_bytes().splitlines() if path.exists() else []
    return [orjson.loads(line) for line in lines if line.endswith(b"}")]


def trials(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if e["type"] == "trial"]


def two_nodes(
    mosquitto: Mosquitto, state: Path, objective: str = "throughput", seed: int = 2, **job: Any
) -> Any:
    """Two simulated nodes tuning the demo job (a budget of 4), journalling into ``state``."""
    return simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=4,
        seed=seed,
        speedup=100,
        objective=objective,
        job_overrides={"patience": 4, **job},
        coordinator_dir=state,
    )


def cap_at_most(node: SimulatedNode, watts: float) -> None:
    """The node's ``[actuation] max_power_w`` (an operator's bound below the GPUs' own)."""
    config = node.agent.config
    actuation = config.actuation.model_copy(update={"max_power_w": watts})
    node.agent.config = config.model_copy(update={"actuation": actuation})


async def test_a_node_bound_below_the_jobs_cap_is_held_to_not_retried_forever(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """A throughput job holds its cap at the top of ``power_limits_w`` (250 W); one node's
    operator allows at most 200 W. The job runs at 200 W and is tuned, instead of its first
    trial being refused and the same settings retried for ever with no trial done."""
    state = tmp_path / "state"
    async with two_nodes(mosquitto, state, power_limits_w=[100.0, 250.0]) as (
        coordinator,
        nodes,
        _,
    ):
        cap_at_most(nodes[1], 200.0)
        async with asyncio.timeout(90):
            await coordinator.run(until_tuned=True)
    entries = journal(state)
    done = trials(entries)
    assert len(done) >= 4 and all(t["status"] != "refused" for t in done), done
    caps = {e["settings"]["power_cap_w"] for e in entries if e["type"] == "published"}
    assert caps == {200}, caps
    assert entries[-1]["type"] == "final"


async def test_a_job_no_node_can_cap_for_is_tuned_without_a_cap_and_says_why(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """An energy job searching caps of 300-400 W on 250 W GPUs: no cap is ever published (none
    is inside the GPUs' range, and none outside the job's), the rest is tuned, the coordinator
    says why, and a run until every job is tuned returns."""
    state = tmp_path / "state"
    async with two_nodes(mosquitto, state, "energy", power_limits_w=[300.0, 400.0]) as (
        coordinator,
        _,
        _,
    ):
        async with asyncio.timeout(90):
            await coordinator.run(until_tuned=True)
    entries = journal(state)
    assert trials(entries) and entries[-1]["type"] == "final", entries[-3:]
    published = [e for e in entries if e["type"] in ("published", "final")]
    assert not [e for e in published if e["settings"].get("power_cap_w") is not None], published


async def test_a_missing_energy_reading_spends_no_trial_and_the_tuning_goes_on_when_it_returns(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Every GPU's energy counter unsupported (as on a driver that lost it): an energy job
    scores nothing as infeasible and ends nothing on penalties; it waits, saying why. When the
    counters are back the same tuning goes on and ends with measured energies."""
    state = tmp_path / "state"
    async with two_nodes(mosquitto, state, "energy") as (coordinator, nodes, _):
        for node in nodes:
            assert node.nvml is not None
            node.nvml.set_faults(
                {"nvmlDeviceGetTotalEnergyConsumption": {"error": "NVML_ERROR_NOT_SUPPORTED"}}
            )
        run = asyncio.create_task(coordinator.run(until_tuned=True))
        await asyncio.sleep(12)
        while_missing = journal(state)
        assert not [t for t in trials(while_missing) if t["status"] != "no_energy"], while_missing
        assert not run.done()
        assert not [e for e in while_missing if e["type"] == "final"]
        assert "no energy reading" in str(coordinator.job(JOB).state)
        for node in nodes:
            assert node.nvml is not None
            node.nvml.set_faults(None)
        async with asyncio.timeout(90):
            await run
    entries = journal(state)
    measured = [t for t in trials(entries) if t["status"] == "ok"]
    energies = [r["energy_j"] for t in measured for r in t["reports"].values()]
    assert len(measured) >= 4 and all(e > 0 for e in energies), measured
    assert entries[-1]["type"] == "final"


async def test_a_job_waiting_for_its_ranks_holds_back_no_other_jobs_drift_watch(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two jobs: ``stuck`` names nodes whose ranks never come; the demo job is tuned, then its
    GPUs are capped to 100 W behind the agents' backs (an operator's ``nvidia-smi -pl``). The
    demo job is re-tuned on the drift while ``stuck`` still waits (instead of no job being
    watched until every job is tuned)."""
    key = SigningKey.generate()
    state = tmp_path / "state"
    overrides = {"patience": 3, "confirm_best": False, "drift_sustained_s": 3.0}
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=3,
        seed=4,
        speedup=100,
        key=key,
        job_overrides=overrides,
        coordinator_dir=state,
    ) as (_, nodes, _):
        raw = cluster_config(mosquitto.url, 2, 3, 4, tmp_path, "throughput", (100.0, 250.0))
        raw["coordinator"]["state_dir"] = str(state)
        raw["coordinator"]["jobs"][0].update(overrides)
        stuck = {**raw["coordinator"]["jobs"][0], "id": "stuck", "nodes": ["node-8", "node-9"]}
        raw["coordinator"]["jobs"].append(stuck)
        config = build_config(raw, {"node": "coordinator"})
        coordinator = Coordinator(config, coordinator_link(config), key)
        caplog.set_level(logging.WARNING, logger="hyperagent.coordinator")
        run = asyncio.create_task(coordinator.run())
        try:
            async with asyncio.timeout(60):  # tuned, and the final settings applied (their
                # power cap after this test's would undo it)
                while not (
                    (final := next((e for e in journal(state) if e["type"] == "final"), None))
                    and all(n.agent.applied_versions.get(JOB) == final["version"] for n in nodes)
                ):
                    await asyncio.sleep(0.1)
            for node in nodes:
                assert node.nvml is not None
                for index in range(node.nvml.nvmlDeviceGetCount()):
                    handle = node.nvml.nvmlDeviceGetHandleByIndex(index)
                    node.nvml.nvmlDeviceSetPowerManagementLimit(handle, 100_000)
            async with asyncio.timeout(60):
                while "re-tuning" not in caplog.text:
                    await asyncio.sleep(0.1)
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
    assert not (state / "stuck.jsonl").exists() or not trials(
        [orjson.loads(line) for line in (state / "stuck.jsonl").read_bytes().splitlines()]
    )


async def test_a_job_sharing_a_node_with_another_leaves_the_other_jobs_gpu_alone(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """An energy job on 2 nodes searches power caps; another job's rank, a process of its own,
    runs on GPU 7 of node-1 (NVML shows it there, though the tuned job's rank says it drives
    every GPU). GPU 7 keeps its power limit through the tuning (a tuning caps only its own
    job's GPUs), node-1's other GPUs are tuned, and the tuning ends."""
    state = tmp_path / "state"
    async with two_nodes(mosquitto, state, "energy", seed=5, confirm_best=False) as (
        coordinator,
        nodes,
        _,
    ):
        shared = nodes[1]
        nvml = shared.nvml
        assert nvml is not None
        await asyncio.sleep(0.5)  # the demo's agents are up and show their job's process
        other = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            OTHER_RANK,
            str(shared.agent.config.sources.job.socket),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

        def limits() -> list[int]:
            assert nvml is not None
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            return [nvml.nvmlDeviceGetPowerManagementLimit(h) for h in handles]

        before = limits()
        seen: list[set[int]] = [set() for _ in before]
        try:
            nvml.set_processes(7, [other.pid])
            async with asyncio.timeout(30):  # the agent sees it there (its next process poll)
                while shared.agent.job_gpus("other")[0] != {7}:
                    await asyncio.sleep(0.05)
            run = asyncio.create_task(coordinator.run(until_tuned=True))
            async with asyncio.timeout(90):
                while not run.done():
                    for gpu, limit in enumerate(limits()):
                        seen[gpu].add(limit)
                    await asyncio.sleep(0.05)
            await run
        finally:
            other.kill()
            await other.wait()
    assert seen[7] == {before[7]}, seen
    assert any(len(limits_seen) > 1 for limits_seen in seen[:7]), seen
    assert journal(state)[-1]["type"] == "final"


OTHER_RANK = """
import sys, time
from hyperagent.job import JobReporter
other = JobReporter("other", rank=0, socket_path=sys.argv[1], gpu=7)
while True:
    other.report_step(32, 0.5, 0.4, 0.1, 2.0)
    time.sleep(0.05)
"""
