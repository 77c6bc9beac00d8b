"""A coordinator killed with SIGKILL mid-trial resumes from its journal: no trial lost or counted
twice, versions keep rising, the retained settings end consistent with what every node runs."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiomqtt
import orjson

from hyperagent import bus
from hyperagent.demo import JOB, JOB_DEFAULTS, simulated_cluster
from hyperagent.signing import write_key_pair
from hyperagent.tuner.lifecycle import MEASURED

from conftest import Mosquitto

TRIALS = 6
NODES = 2


def entries(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_bytes().splitlines()
    return [orjson.loads(line) for line in lines if line.endswith(b"}")]


def coordinator_config(
    tmp_path: Path,
    mosquitto: Mosquitto,
    key_file: Path,
    trials: int = TRIALS,
    patience: int = TRIALS,
) -> Path:
    nodes = ", ".join(f'"node-{i}"' for i in range(NODES))
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'cluster = "demo"\nnode = "coordinator"\n[mqtt]\nurl = "{mosquitto.url}"\n'
        f'[security]\nsigning_key_file = "{key_file}"\n'
        f'[coordinator]\nstate_dir = "{tmp_path / "state"}"\nmetrics_address = ""\n'
        f'[[coordinator.jobs]]\nid = "{JOB}"\nnodes = [{nodes}]\nbackend = "nccl"\n'
        f"trials = {trials}\npatience = {patience}\npower_limits_w = [100.0, 250.0]\n"
        "abort_below = 0\nearly_stop = false\nack_timeout_s = 30\ntrial_timeout_s = 60\n"
    )
    return config


def start(config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "hyperagent.cli", "coordinator", "--config", str(config)],
        stderr=subprocess.DEVNULL,
    )


async def wait_until(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def mid_trial(journal: Path) -> bool:
    """The journal says two trials are done and the next one's settings are published."""
    log = entries(journal)
    done = [e for e in log if e["type"] == "trial"]
    return len(done) >= 2 and log[-1]["type"] == "published" and bool(log[-1]["trial"])


async def final_applied(journal: Path, nodes: list[Any]) -> dict[str, Any]:
    """The journal's final entry, once every node's agent applies its version."""
    await wait_until(lambda: any(e["type"] == "final" for e in entries(journal)), 180)
    final = next(e for e in entries(journal) if e["type"] == "final")
    await wait_until(
        lambda: all(n.agent.applied_versions.get(JOB) == final["version"] for n in nodes), 30
    )
    return final


async def test_coordinator_killed_mid_trial_resumes(mosquitto: Mosquitto, tmp_path: Path) -> None:
    key, private, _ = write_key_pair(tmp_path, "settings")
    config = coordinator_config(tmp_path, mosquitto, private)
    journal = tmp_path / "state" / f"{JOB}.jsonl"
    async with simulated_cluster(
        mosquitto.url, nodes=NODES, trials=TRIALS, seed=7, speedup=60, key=key
    ) as (_, nodes, _):
        first = start(config)
        try:
            await wait_until(lambda: mid_trial(journal), 120)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        finally:
            if first.poll() is None:
                first.kill()
        killed_at = entries(journal)[-1]
        second = start(config)
        try:
            final = await final_applied(journal, nodes)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
            await client.subscribe(bus.Topics("demo").settings(JOB), qos=1)
            async with asyncio.timeout(10):
                retained = await anext(aiter(client.messages))
    log = entries(journal)
    trials = [e for e in log if e["type"] == "trial"]
    # none lost, none twice; then the start and the best re-measured (unless the best and
    # the runner-up are the start), as confirmations
    budget = [t["index"] for t in trials if not t.get("confirmation")]
    confirmations = [t["index"] for t in trials if t.get("confirmation")]
    assert budget == list(range(TRIALS))
    assert confirmations in ([], list(range(TRIALS, TRIALS + 4)))
    resumed = next(t for t in trials if t["index"] == killed_at["trial"])
    assert resumed["status"] == "ok"
    versions = [e["version"] for e in log if e["type"] in ("published", "final")]
    assert (
        versions == sorted(versions) and len(set(versions)) == len(versions) - 1
    )  # final re-states
    message = bus.decode(retained.payload, "settings")  # type: ignore[arg-type]
    assert message["version"] == final["version"] and message["settings"] == final["settings"]
    assert bus.verify(message, key.trusted())
    assert second.returncode == 0


KILLS = 10


def confirming(log: list[dict[str, Any]]) -> bool:
    """The journal says the search is over and the confirmations run."""
    return any(e["type"] == "confirm" for e in log)


async def test_killed_at_ten_points_of_a_tuning_that_converges_early_it_finishes(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """SIGKILL at 10 random points (and at the first confirmation's publish) of a search
    that stops early (patience 3 of 14 trials) and of its confirmations: every start loads
    the journal, no trial index repeats, no search trial follows a confirmation, and the
    tuning ends with its final version applied."""
    key, private, _ = write_key_pair(tmp_path, "settings")
    config = coordinator_config(tmp_path, mosquitto, private, trials=14, patience=3)
    journal = tmp_path / "state" / f"{JOB}.jsonl"
    # kill points: a number of trials done (search and confirmations: this tuning runs
    # about 8) and a delay into the next one, drawn; and the first confirmation's publish
    rng = random.Random(33)
    points = sorted((rng.randrange(8), rng.uniform(0.0, 2.0)) for _ in range(KILLS))
    kills: list[str] = []
    async with simulated_cluster(
        mosquitto.url, nodes=NODES, trials=14, seed=7, speedup=60, key=key
    ) as (_, nodes, _):
        while points:
            process = start(config)
            try:
                done, delay = points[0]
                first = not any("confirming" in k for k in kills)

                def due(done: int = done, process: Any = process, first: bool = first) -> bool:
                    log = entries(journal)
                    at_confirmation = first and confirming(log) and log[-1]["type"] == "published"
                    finished = sum(e["type"] == "trial" for e in log)
                    ended = any(e["type"] == "final" for e in log)
                    return (
                        finished >= done or at_confirmation or ended or process.poll() is not None
                    )

                await wait_until(due, 120)
                log = entries(journal)
                if sum(e["type"] == "trial" for e in log) >= done:
                    points.pop(0)
                    await asyncio.sleep(delay)
                    log = entries(journal)
                assert process.poll() is None, f"start {len(kills) + 1} exited {process.returncode}"
                if any(e["type"] == "final" for e in log):
                    break
                last = log[-1] if log else {"type": "nothing journalled"}
                where = f"{last['type']} {last.get('trial', last.get('index', ''))}"
                kills.append(where + (" (confirming)" if confirming(log) else ""))
                process.send_signal(signal.SIGKILL)
                process.wait(10)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
        last_start = start(config)
        try:
            await final_applied(journal, nodes)
        finally:
            last_start.send_signal(signal.SIGTERM)
            last_start.wait(30)
    assert len(kills) >= KILLS and any("confirming" in k for k in kills), kills
    trials = [e for e in entries(journal) if e["type"] == "trial"]
    indices = [t["index"] for t in trials]
    assert len(indices) == len(set(indices)), indices
    search = [t["index"] for t in trials if not t.get("confirmation")]
    confirmations = [t["index"] for t in trials if t.get("confirmation")]
    assert search == list(range(len(search))) and len(search) < 14, search  # it stopped early
    assert confirmations == list(range(len(search), len(search) + 4)), confirmations
    first_confirmation = indices.index(confirmations[0])
    assert all(t.get("confirmation") for t in trials[first_confirmation:]), indices
    versions = [e["version"] for e in entries(journal) if e["type"] in ("published", "final")]
    assert versions == sorted(versions)
    assert last_start.returncode == 0


async def test_a_coordinator_without_its_journal_learns_the_version_the_agents_apply(
    mosquitto: Mosquitto,
) -> None:
    """The agents apply v40 (kept in their state); a coordinator that starts from nothing
    publishes v1, is told "stale: v40 applied" and publishes above it: no trial is lost."""
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=2,
        seed=1,
        speedup=50,
        job_overrides={"abort_below": 0, "early_stop": False},
    ) as (coordinator, nodes, _):
        for node in nodes:
            node.agent.applied_messages[JOB] = {"version": 40, "settings": dict(JOB_DEFAULTS)}
        async with asyncio.timeout(120):
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert [t.status for t in state.trials] == ["ok"] * 2
    assert [t.status for t in state.confirmations] == ["ok"] * 4  # the start and the other
    assert min(t.version for t in state.trials) > 40


async def test_a_journal_from_another_search_space_starts_the_tuning_over(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Interrupted while tuning for energy, restarted for throughput: the trials at 150 W lie
    outside the new space (the cap stays at its highest), so the tuning starts over."""
    energy_trial = {"bucket_mb": 32, "chunk_kb": 4096, "allreduce": "ring", "power_cap_w": 150}
    journal = tmp_path / f"{JOB}.jsonl"
    journal.write_bytes(
        b"".join(
            orjson.dumps(e) + b"\n"
            for e in (
                {"type": "start", "fingerprint": "nccl/2n/?B/?"},
                {"type": "published", "version": 7, "trial": 0, "settings": energy_trial},
                {
                    "type": "trial",
                    "index": 0,
                    "version": 7,
                    "settings": energy_trial,
                    "score": 3.2,
                    "status": "ok",
                    "reports": {},
                    "seconds": 9.0,
                    "noise": None,
                },
            )
        )
    )
    async with simulated_cluster(
        mosquitto.url,
        nodes=NODES,
        trials=3,
        seed=2,
        speedup=100,
        coordinator_dir=tmp_path,
        job_overrides={"confirm_best": False},
    ) as (coordinator, _, _):
        async with asyncio.timeout(120):
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert [t.index for t in state.trials] == [0, 1, 2]
    # measured (a design point far from the start may be aborted by the guardrail, or stopped
    # early against the best so far)
    assert all(t.status in MEASURED for t in state.trials)
    assert all(t.settings["power_cap_w"] == 250 for t in state.trials)
    assert min(t.version for t in state.trials) > 7  # versions keep rising
    starts = [e for e in entries(journal) if e["type"] == "start"]
    assert len(starts) == 2
