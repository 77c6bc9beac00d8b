"""The coordinator on the production shape: several ranks per node, nodes that refuse every
version, jobs that stall for longer than a trial, journals an older coordinator wrote."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pynvml
import pytest
from prometheus_client import CollectorRegistry
from tuner.driver import Driver, Nodes, begin, coordinator_section

from hyperagent import bus
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator, coordinator_link
from hyperagent.demo import JOB, simulated_cluster
from hyperagent.notify import Notifier
from hyperagent.signing import SigningKey, write_key_pair
from hyperagent.tuner import tuning
from hyperagent.tuner.jobstate import Progress
from hyperagent.tuner.lifecycle import MEASURED, Backoff, Tuned, WaitingForRanks
from hyperagent.tuner.trial import score
from hyperagent.tuner.tuning import JobTuning as JobState

from conftest import Mosquitto

TOPICS = bus.Topics("c")
RANK_SAMPLES = 16
"""Samples one rank does per step."""
RANK_STEP_S = 2.0
"""Seconds one rank's step takes."""


def entries(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.endswith(b"}")]


def metrics(coordinator: Coordinator) -> Any:
    coordinator.update_metrics()
    registry = CollectorRegistry()
    registry.register(coordinator.collector)
    return registry.get_sample_value


# -- units: the drift watch against the tuned score ------------------------------------------


def _tuned(tmp_path: Path, ranks: int) -> Driver:
    """A job on two nodes tuned to the score its nodes' ranks make (each RANK_SAMPLES per
    RANK_STEP_S), as a trial scores the nodes' reports: a node's throughput is the sum of its
    ranks'."""
    node = {"throughput": ranks * RANK_SAMPLES / RANK_STEP_S, "nonfinite_loss": False}
    tuned = score([node, node], "throughput", 2)
    assert tuned is not None
    section = coordinator_section(
        trials=1, confirm_best=False, drift_threshold=0.15, drift_sustained_s=15.0
    )
    nodes = ("n0", "n1")
    driver = begin("j", nodes, tmp_path / "j.jsonl", section, Nodes(nodes, lambda _: tuned))
    driver.run_until_done()
    assert isinstance(driver.machine.state, Tuned) and driver.machine.best is not None
    assert driver.machine.best[1] == pytest.approx(tuned)
    return driver


def _watch(driver: Driver, ranks: int, slow_after: int) -> int:
    """Feed telemetry as an agent sums its ranks' steps (samples and step seconds, each summed
    over the node's ranks), one step a second, the ranks' steps taking twice as long from step
    ``slow_after``; returns how many rounds the drift watch began."""
    samples, step_s = 0, 0.0
    for step in range(60):
        samples += ranks * RANK_SAMPLES
        step_s += ranks * RANK_STEP_S * (2 if step >= slow_after else 1)
        for node in ("n0", "n1"):
            progress = Progress(float(samples), step_s, float(step), ranks)
            driver.feed(tuning.Steps(driver.now, node, progress))
        driver.advance(1.0)
        driver.answer = False  # a re-tune's trials stay in flight: the count is what matters
    assert set(driver.machine.progress) == {"n0", "n1"}
    return driver.machine.rounds - 1


@pytest.mark.parametrize("ranks", [4, 8])
def test_steady_throughput_on_several_ranks_per_node_is_no_drift(
    tmp_path: Path, ranks: int
) -> None:
    driver = _tuned(tmp_path, ranks)
    assert _watch(driver, ranks, slow_after=10**6) == 0
    state = driver.machine
    previous = dict(state.progress)
    for node, progress in previous.items():
        previous[node] = progress._replace(
            samples=progress.samples - ranks * RANK_SAMPLES,
            step_s=progress.step_s - ranks * RANK_STEP_S,
        )
    assert state.best is not None
    assert state.job_throughput(previous) == pytest.approx(state.best[1])


@pytest.mark.parametrize("ranks", [4, 8])
def test_a_real_drop_on_several_ranks_per_node_re_tunes(tmp_path: Path, ranks: int) -> None:
    driver = _tuned(tmp_path, ranks)
    assert _watch(driver, ranks, slow_after=20) >= 1


async def found(coordinator: Coordinator, job: str, timeout_s: float = 60) -> JobState:
    """The machine of ``job`` once the coordinator has found it."""
    async with asyncio.timeout(timeout_s):
        while job not in coordinator.jobs:
            await asyncio.sleep(0.05)
    return coordinator.jobs[job]


# -- not-trials: refusals, stalls ------------------------------------------------------------


class NotifySocket:
    """What a service manager hears on ``$NOTIFY_SOCKET``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.heard: list[str] = []

    def statuses(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(4096).decode()
            except BlockingIOError:
                break
            self.heard += [line[7:] for line in data.splitlines() if line.startswith("STATUS=")]
        return self.heard


async def test_a_node_that_refuses_every_version_pauses_the_job(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="hyperagent.coordinator")
    notify = NotifySocket(tmp_path / "notify.sock")
    async with simulated_cluster(
        mosquitto.url,
        nodes=3,
        trials=3,
        seed=1,
        speedup=100,
        job_overrides={"abort_below": 0, "early_stop": False},
    ) as (coordinator, nodes, _):
        nodes[2].nvml.fail(3, pynvml.NVML_ERROR_NO_PERMISSION)  # its power cap cannot be set
        coordinator.backoff = Backoff(0.2, 0.8)
        coordinator.notifier = Notifier({"NOTIFY_SOCKET": str(notify.path)})
        tuning = asyncio.create_task(coordinator.run(until_tuned=True))
        state = await found(coordinator, JOB)
        path = coordinator.journals.path(JOB)

        def published() -> int:
            return [e["type"] for e in entries(path)].count("published")

        def paused() -> bool:
            state_ = {"job_id": JOB, "state": "paused"}
            return metrics(coordinator)("hyperagent_tuner_state", state_) == 1

        try:
            async with asyncio.timeout(60):
                # each attempt publishes the trial's settings and the rollback's: five attempts
                while not tuning.done() and (published() < 10 or not paused()):
                    await asyncio.sleep(0.05)
            ended = tuning.done()
            get = metrics(coordinator)
            paused_then = None if ended else state.paused
        finally:
            tuning.cancel()
            await asyncio.gather(tuning, return_exceptions=True)
        journal = entries(path)
    assert not ended  # a refusal is not a trial: the tuning cannot end on refusals
    paused = paused_then
    # no trial counted, none told, the tuning not over
    assert state.trials == [] and state.tuner.n_told == 0 and not state.done
    assert [e["type"] for e in journal if e["type"] in ("trial", "final", "paused")] == ["paused"]
    assert paused is not None and paused.reason == "refused" and paused.nodes == ("node-2",)
    job = {"job_id": JOB}
    assert get("hyperagent_tuner_paused", {**job, "reason": "refused"}) == 1
    assert get("hyperagent_tuner_paused_node", {**job, "reason": "refused", "node": "node-2"}) == 1
    assert get("hyperagent_tuner_done", job) == 0
    assert get("hyperagent_tuner_retries_total", job) >= 4
    statuses = notify.statuses()
    assert any("paused" in s and "node-2" in s for s in statuses)
    assert "every job tuned" not in statuses
    # one line for the pause, not one per retry
    pauses = [r for r in caplog.records if "paused (refused" in r.getMessage()]
    assert len(pauses) == 1 and "node-2" in pauses[0].getMessage()


@pytest.mark.long(12)
async def test_most_nodes_stalling_longer_than_a_trial_pause_then_resume(
    mosquitto: Mosquitto,
) -> None:
    loop = asyncio.get_running_loop()

    def stall_two(state: JobState, record: Any) -> None:
        if record.index != 0:
            return
        for node in nodes[1:]:
            node.stalled = True  # their agents stay online; their jobs stop stepping

        def step_again() -> None:
            for node in nodes[1:]:
                node.stalled = False

        loop.call_later(8.0, step_again)  # longer than the trial timeout

    async with simulated_cluster(
        mosquitto.url,
        nodes=3,
        trials=3,
        seed=3,
        speedup=100,
        on_trial=stall_two,
        job_overrides={
            "confirm_best": False,
            "abort_below": 0,
            "early_stop": False,
            "trial_timeout_s": 4,
        },
    ) as (coordinator, nodes, _):
        coordinator.backoff = Backoff(0.5, 2.0)
        async with asyncio.timeout(120):
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
        paused = [e for e in entries(coordinator.journals.path(JOB)) if e["type"] == "paused"]
    assert state.done and [t.status for t in state.trials] == ["ok"] * 3
    everyone = {"node-0", "node-1", "node-2"}
    assert set(state.trials[-1].reports) == everyone and not state.lost
    assert paused and paused[0]["trial"] == 1 and paused[0]["reason"] == "no measurement"
    assert set(paused[0]["nodes"]) == {"node-1", "node-2"}


@pytest.mark.long(25)
async def test_a_node_stalling_briefly_at_a_trials_start_costs_it_no_timeout(
    mosquitto: Mosquitto,
) -> None:
    """A job that stops stepping when a trial begins and steps again before the other nodes
    have measured: its agent left that trial (it measures again from the next one), so the
    trial ends with the others' reports instead of waiting out ``trial_timeout_s``."""
    resumed: list[asyncio.Task[None]] = []

    def stall_briefly(state: JobState, record: Any) -> None:
        if record.index != 0:
            return
        nodes[2].stalled = True

        async def step_again_once_out() -> None:
            while state.lost.get("node-2") != "stalled":
                await asyncio.sleep(0.05)
            nodes[2].stalled = False

        resumed.append(asyncio.create_task(step_again_once_out()))

    async with simulated_cluster(
        mosquitto.url,
        nodes=3,
        trials=3,
        seed=3,
        speedup=10,
        on_trial=stall_briefly,
        job_overrides={
            "confirm_best": False,
            "abort_below": 0,
            "early_stop": False,
            "trial_timeout_s": 120,
        },
    ) as (coordinator, nodes, _):
        async with asyncio.timeout(90):  # below the trial timeout
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert [t.status for t in state.trials] == ["ok"] * 3
    assert set(state.trials[1].reports) == {"node-0", "node-1"}
    assert state.trials[1].seconds < 60
    assert set(state.trials[2].reports) == {"node-0", "node-1", "node-2"} and not state.lost


async def test_a_journal_of_refusals_alone_does_not_resume_as_tuned(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """What a coordinator that counted refusals as trials left behind: eleven refused
    "trials" and a final entry with no score. The tuning starts over and measures."""
    settings = {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 250, "allreduce": "ring"}
    lines = [{"type": "start", "fingerprint": "nccl/2n/?B/?"}]
    for index in range(11):
        lines.append(
            {"type": "published", "version": index + 1, "trial": index, "settings": settings}
        )
        lines.append(
            {
                "type": "trial",
                "index": index,
                "version": index + 1,
                "settings": settings,
                "score": None,
                "status": "refused",
                "reports": {},
                "seconds": 0.1,
                "noise": None,
            }
        )
    lines.append({"type": "published", "version": 12, "trial": None, "settings": settings})
    lines.append({"type": "final", "version": 12, "settings": settings, "score": None})
    journal = tmp_path / f"{JOB}.jsonl"
    journal.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=2,
        seed=2,
        speedup=100,
        coordinator_dir=tmp_path,
        job_overrides={"confirm_best": False},
    ) as (coordinator, _, _):
        async with asyncio.timeout(120):
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert len(state.trials) == 2
    assert all(t.status in MEASURED for t in state.trials)  # ok, or stopped early
    assert state.best is not None and state.best[1] > 0
    assert min(t.version for t in state.trials) > 12  # versions keep rising
    log = entries(journal)
    assert [e["type"] for e in log].count("start") == 2
    assert log[-1]["type"] == "final" and log[-1]["score"] == state.best[1]


def test_an_unreadable_journal_ends_the_coordinator_with_one_clear_line(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    _, key, _ = write_key_pair(tmp_path, "settings")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    journal = state_dir / "j.jsonl"
    journal.write_bytes(b'{"type": "start"}\n{"type": "published", "vers\n{"type": "start"}\n')
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'cluster = "c"\nnode = "coordinator"\n[mqtt]\nurl = "{mosquitto.url}"\n'
        f'[security]\nsigning_key_file = "{key}"\n'
        f'[coordinator]\nstate_dir = "{state_dir}"\nmetrics_address = ""\n'
        '[[coordinator.jobs]]\nid = "j"\nnodes = ["n0"]\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "hyperagent.cli", "coordinator", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "ExceptionGroup" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if str(journal) in line]
    assert len(lines) == 1 and f"{journal}:2:" in lines[0], done.stderr


def test_a_journal_with_pauses_reads_back_and_reports(tmp_path: Path) -> None:
    from hyperagent.report import read_journal
    from hyperagent.tuner.journal import Journal

    settings = {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 250, "allreduce": "ring"}
    trial = {
        "type": "trial",
        "index": 0,
        "version": 3,
        "settings": settings,
        "score": 400.0,
        "status": "ok",
        "reports": {},
        "seconds": 9.0,
        "noise": None,
    }
    lines = [
        {"type": "start", "fingerprint": "nccl/1n/?B/?"},
        {"type": "published", "version": 1, "trial": 0, "settings": settings},
        {"type": "paused", "trial": 0, "version": 1, "reason": "refused", "nodes": ["n0"]},
        {"type": "published", "version": 2, "trial": None, "settings": settings},
        {"type": "published", "version": 3, "trial": 0, "settings": settings},
        trial,
        {"type": "published", "version": 4, "trial": None, "settings": settings},
        {"type": "final", "version": 4, "settings": settings, "score": 400.0},
    ]
    path = tmp_path / "j.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    state = Journal(path).load()
    assert [t["index"] for t in state.trials] == [0] and state.measured and state.version == 4
    _, trials, final, in_flight = read_journal(path)
    assert [t.status for t in trials] == ["ok"] and final is not None and in_flight is None


# -- jobs are independent --------------------------------------------------------------------


async def test_a_job_waiting_for_its_ranks_delays_no_other_jobs_drift_watch(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``stuck`` waits for ranks that never attach (8 of 16); ``ok``, tuned before the
    coordinator started (its journal says so), slows to half its tuned throughput: the drift
    watch re-tunes ``ok`` while ``stuck`` is still waiting."""
    caplog.set_level(logging.INFO, logger="hyperagent")
    policy = {"tune": "all", "trials": 1, "confirm_best": False, "drift_sustained_s": 1.0}
    nodes = ("n0", "n1")
    tuned = begin(
        "ok",
        nodes,
        tmp_path / "ok.jsonl",
        coordinator_section(**policy),
        Nodes(nodes, lambda _: 1000.0),
    )
    tuned.run_until_done()
    assert isinstance(tuned.machine.state, Tuned)
    config = build_config(
        {
            "cluster": "c",
            "mqtt": {"url": mosquitto.url},
            "coordinator": {"state_dir": str(tmp_path), "metrics_address": "", "defaults": policy},
        }
    )
    coordinator = Coordinator(config, coordinator_link(config), SigningKey.generate())
    running = asyncio.create_task(coordinator.run())

    def telemetry(node: str, jobs: dict[str, Any], ts: float) -> bytes:
        message = {"node": node, "ts": ts, "indicators": {}, "sources_up": {}, "jobs": jobs}
        return bus.encode(message)

    def ranks(first: int, world: int, samples: float, step_s: float) -> dict[str, Any]:
        return {
            "samples": samples,
            "step_s": step_s,
            "attached": 8,
            "ranks": 8,
            "rank_ids": list(range(first, first + 8)),
            "world_size": world,
            "tune": True,
        }

    try:
        async with asyncio.timeout(10):
            await coordinator.link.connected.wait()
        samples = step_s = 0.0
        async with asyncio.timeout(60):
            while coordinator.jobs.get("ok") is None or coordinator.job("ok").rounds < 2:
                samples += 250.0  # 500 samples/s a node when tuned: half that now
                step_s += 8 * 1.0
                for i, node in enumerate(nodes):
                    payload = telemetry(node, {"ok": ranks(8 * i, 16, samples, step_s)}, step_s)
                    await coordinator._on_telemetry(TOPICS.telemetry(node), payload)
                stuck = telemetry("n2", {"stuck": ranks(0, 16, samples, step_s)}, step_s)
                await coordinator._on_telemetry(TOPICS.telemetry("n2"), stuck)
                await asyncio.sleep(1.0)
        waiting = coordinator.job("stuck").state
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert isinstance(waiting, WaitingForRanks), waiting
    starts = [e for e in entries(tmp_path / "ok.jsonl") if e["type"] == "start"]
    assert len(starts) == 2, starts  # re-tuned: a second round began ...
    said = [r.getMessage() for r in caplog.records]
    assert "ok: throughput drifted below the tuned score; re-tuning" in said, said  # on drift
    assert not [line for line in said if "starts over" in line], said
