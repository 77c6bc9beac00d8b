"""Each guardrail firing, through a real mosquitto with real agents: early abort, rollback on a
NaN loss and on a missing ack, a lost node excluded while the tuning completes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiomqtt
import orjson

from hyperagent import bus
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator, coordinator_link
from hyperagent.demo import JOB, simulated_cluster
from hyperagent.job import JobReporter
from hyperagent.signing import write_key_pair
from hyperagent.tuner.lifecycle import MEASURED, Backoff
from hyperagent.tuner.tuning import JobTuning as JobState

from conftest import REPO, Mosquitto

TERRIBLE = {"bucket_mb": 1, "chunk_kb": 64, "power_cap_w": 100, "allreduce": "tree"}


def journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_bytes().splitlines()
    return [orjson.loads(line) for line in lines if line.endswith(b"}")]


async def test_a_bad_trial_is_aborted_early(mosquitto: Mosquitto) -> None:
    def propose_terrible(state: JobState, record: Any) -> None:
        if record.index == 0:
            assert state.tuner is not None
            state.tuner.ask = lambda: dict(TERRIBLE)  # type: ignore[method-assign]

    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=2,
        speedup=100,
        on_trial=propose_terrible,
        job_overrides={"search_power_cap": True, "confirm_best": False},
    ) as (coordinator, _, model):
        async with asyncio.timeout(120):
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    baseline, bad = state.trials
    assert model.throughput(TERRIBLE) < 0.5 * model.throughput(baseline.settings)
    assert baseline.status == "ok" and state.baseline == baseline.score
    assert bad.settings == TERRIBLE and bad.status == "aborted"
    assert bad.score is not None and bad.score < 0.7 * baseline.score  # type: ignore[operator]
    plan_steps = state.config.plan.measure_steps
    assert all(r["partial"] and r["steps"] < plan_steps for r in bad.reports.values())


async def test_nan_loss_rolls_back_to_the_last_good_settings(mosquitto: Mosquitto) -> None:
    def inject(state: JobState, record: Any) -> None:
        nodes[1].nan_loss = record.index == 1  # trial 2 runs with a diverging loss

    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=4,
        seed=5,
        speedup=100,
        on_trial=inject,
        job_overrides={"confirm_best": False, "abort_below": 0, "early_stop": False},
    ) as (coordinator, nodes, _):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
        entries = journal(coordinator.journals.path(JOB))
    statuses = [t.status for t in state.trials]
    assert statuses[2] == "nonfinite_loss" and statuses.count("nonfinite_loss") == 1
    failed = next(i for i, e in enumerate(entries) if e["type"] == "trial" and e["index"] == 2)
    rollback = entries[failed + 1]
    good = max(state.trials[:2], key=lambda t: t.score or 0).settings
    assert rollback["type"] == "published" and rollback["trial"] is None
    assert rollback["settings"] == good


async def test_a_lost_node_is_excluded_and_the_tuning_completes(mosquitto: Mosquitto) -> None:
    def lose_one(state: JobState, record: Any) -> None:
        if record.index == 1:
            nodes[4].stop()  # one node of five (20%) disappears mid-tuning

    async with simulated_cluster(
        mosquitto.url,
        nodes=5,
        trials=5,
        seed=2,
        speedup=100,
        on_trial=lose_one,
        job_overrides={"ack_timeout_s": 3, "trial_timeout_s": 20},
    ) as (coordinator, nodes, model):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert state.done and state.lost == {"node-4": "offline"}
    assert all(t.status in MEASURED for t in state.trials)  # ok, aborted or stopped early
    for trial in state.trials[2:]:
        assert set(trial.reports) == {"node-0", "node-1", "node-2", "node-3"}
    # scores stay comparable: four nodes' mean scaled to five
    assert state.best is not None
    assert abs(state.best[1] - model.throughput(state.best[0])) < 0.1 * state.best[1]


async def test_a_node_whose_job_hangs_leaves_the_trial_at_once_and_rejoins(
    mosquitto: Mosquitto,
) -> None:
    def hang(state: JobState, record: Any) -> None:
        if record.index == 0:
            nodes[2].stalled = True  # its agent stays online; its training steps stop
        elif record.index == 2:
            nodes[2].stalled = False  # and start again

    async with simulated_cluster(
        mosquitto.url,
        nodes=3,
        trials=4,
        seed=4,
        speedup=100,
        on_trial=hang,
        job_overrides={
            "confirm_best": False,
            "trial_timeout_s": 120,
            "abort_below": 0,
            "early_stop": False,
        },
    ) as (coordinator, nodes, _):
        async with asyncio.timeout(100):  # a trial waiting out its timeout would not finish
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert [t.status for t in state.trials] == ["ok"] * 4
    everyone = {"node-0", "node-1", "node-2"}
    assert set(state.trials[0].reports) == everyone
    # the hung node left trial 1 (no partial window of it counts) and stayed out of trial 2
    assert set(state.trials[1].reports) == set(state.trials[2].reports) == {"node-0", "node-1"}
    assert all(r["steps"] > 0 and not r.get("stalled") for r in state.trials[1].reports.values())
    assert state.trials[2].acks["node-2"]["stalled"] is True
    # it steps again: back in trial 3
    assert set(state.trials[3].reports) == everyone and "node-2" not in state.lost


async def test_the_space_follows_the_knobs_the_job_announces(mosquitto: Mosquitto) -> None:
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=6,
        seed=1,
        speedup=100,
        job_knobs=("bucket_mb", "chunk_kb"),  # like TunedDDP: no live AllReduce switch
        job_overrides={"confirm_best": False, "start": {"allreduce": "tree"}},
    ) as (coordinator, _, _):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert state.knobs == {"node-0": ("bucket_mb", "chunk_kb"), "node-1": ("bucket_mb", "chunk_kb")}
    ack = state.trials[-1].acks["node-0"]
    assert ack["applied"]["knobs"] == ["bucket_mb", "chunk_kb"]
    assert state.space.allreduce == ("tree",)  # kept where it started
    assert {t.settings["allreduce"] for t in state.trials} == {"tree"}
    assert len({(t.settings["bucket_mb"], t.settings["chunk_kb"]) for t in state.trials}) > 1


def test_a_silent_node_pauses_the_job_which_rolls_back_and_retries(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    key, private, public = write_key_pair(tmp_path, "settings")
    socket_path = tmp_path / "job.sock"
    raw = {
        "cluster": "g",
        "node": "coordinator",
        "mqtt": {"url": mosquitto.url, "reconnect_min_s": 0.1},
        "security": {"signing_key_file": str(private), "trusted_keys": [str(public)]},
        "coordinator": {
            "state_dir": str(tmp_path / "coordinator"),
            "metrics_address": "",
            "defaults": {
                "trials": 2,
                "ack_timeout_s": 2,
                "trial_timeout_s": 10,
                "confirm_best": False,
                "abort_below": 0,
                "early_stop": False,
                "plan": {"settle_steps": 2, "settle_s": 0.2, "measure_steps": 8, "measure_s": 0.4},
            },
        },
    }
    config_file = tmp_path / "agent.toml"
    config_file.write_text(
        f'cluster = "g"\nnode = "node-1"\n[mqtt]\nurl = "{mosquitto.url}"\n'
        f'[agent]\nstate_dir = "{tmp_path / "agent"}"\n'
        f'[security]\ntrusted_keys = ["{public}"]\n'
        f'[sources.job]\nsocket = "{socket_path}"\n'
    )
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--config",
            str(config_file),
            "--replay",
            str(REPO / "fixtures/replay/v100s-8gpu-training"),
            "--metrics-address",
            "",
        ],
        stderr=subprocess.DEVNULL,
    )

    def hang_after_trial_0(state: JobState, record: Any) -> None:
        if record.index == 0:
            agent.send_signal(signal.SIGSTOP)  # hung: connected, silent
            asyncio.get_running_loop().call_later(4, agent.send_signal, signal.SIGCONT)

    async def scenario() -> tuple[JobState, Path]:
        config = build_config(raw)
        coordinator = Coordinator(
            config,
            coordinator_link(config),
            key,
            on_trial=hang_after_trial_0,
            backoff=Backoff(1.0, 4.0),
        )

        async def train() -> None:
            while not socket_path.exists():
                await asyncio.sleep(0.05)
            with JobReporter("j", 0, socket_path, world_size=1, tune=True) as rank:
                while True:
                    rank.poll_settings()
                    rank.report_step(samples=8, step_s=0.05, compute_s=0.04, comm_s=0.01)
                    await asyncio.sleep(0.05)

        training = asyncio.create_task(train())
        try:
            async with asyncio.timeout(90):
                await coordinator.run(until_tuned=True)
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        return coordinator.jobs["j"], coordinator.journals.path("j")

    try:
        state, path = asyncio.run(scenario())
    finally:
        agent.send_signal(signal.SIGCONT)
        agent.terminate()
        agent.wait(20)
    # the missing ack is not a trial: the job paused, rolled back and ran trial 1 again once
    # the node answered, and that run measured it
    assert [t.status for t in state.trials] == ["ok", "ok"] and state.done
    entries = journal(path)
    paused = [(e["trial"], e["reason"], e["nodes"]) for e in entries if e["type"] == "paused"]
    assert paused == [(1, "no ack", ["node-1"])]
    published = [e for e in entries if e["type"] == "published"]
    trial, rollback, retry = published[1:4]
    assert trial["trial"] == retry["trial"] == 1 and trial["settings"] == retry["settings"]
    assert rollback["trial"] is None and rollback["settings"] == state.trials[0].settings
    assert state.retries >= 1


def test_sigterm_puts_the_power_limits_back(mosquitto: Mosquitto, tmp_path: Path) -> None:
    key, _, public = write_key_pair(tmp_path, "settings")
    config = tmp_path / "agent.toml"
    config.write_text(
        f'cluster = "g"\nnode = "node-1"\n[mqtt]\nurl = "{mosquitto.url}"\n'
        f'[agent]\nstate_dir = "{tmp_path / "agent"}"\n'
        f'[security]\ntrusted_keys = ["{public}"]\n'
        f'[sources.job]\nsocket = "{tmp_path / "job.sock"}"\n'
    )
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperagent.cli",
            "agent",
            "--config",
            str(config),
            "--replay",
            str(REPO / "fixtures/replay/v100s-8gpu-training"),
            "--metrics-address",
            "",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )

    async def cap() -> int:
        """Publish a signed 150 W cap as the coordinator would, and read the node's ack (the
        agent applies it once it knows the job's GPUs)."""
        topics = bus.Topics("g")
        settings = {"bucket_mb": 32, "chunk_kb": 4096, "power_cap_w": 150, "allreduce": "ring"}
        message = bus.sign(
            {
                "job": "j",
                "version": 1,
                "trial": None,
                "nodes": ["node-1"],
                "settings": settings,
                "backend": {},
                "plan": None,
                "issued_at": time.time(),
            },
            key,
        )
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="coordinator") as c:
            online = bus.encode({"state": "online", "node": "coordinator", "ts": time.time()})
            await c.publish(topics.coordinator_status(), online, qos=1, retain=True)
            await c.subscribe(topics.ack("j", "node-1"), qos=1)
            await c.publish(topics.settings("j"), bus.encode(message), qos=1, retain=True)
            async with asyncio.timeout(30):
                while True:
                    for rank in ranks:  # each steps, so that it is (re)connected
                        rank.report_step(samples=8, step_s=0.1, compute_s=0.1, comm_s=0.0)
                    try:
                        async with asyncio.timeout(0.5):
                            incoming = await anext(aiter(c.messages))
                    except TimeoutError:
                        continue
                    ack = bus.decode(bytes(incoming.payload), "ack")  # type: ignore[arg-type]
                    assert ack["ok"], ack
                    return len([w for w in ack["applied"]["power_cap_w"] if w == 150])

    # the job's 8 ranks, one per GPU (the replay's NVML shows no process: each declares its own)
    ranks = [JobReporter("j", rank=i, gpu=i, socket_path=tmp_path / "job.sock") for i in range(8)]
    try:
        assert asyncio.run(cap()) == 8
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
        for rank in ranks:
            rank.close()
    assert agent.returncode == 0
    assert "restored the original power limit of 8 GPU(s)" in err
