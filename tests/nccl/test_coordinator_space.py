"""The coordinator's space for an NCCL job follows what its ranks announce: with the tuner
plugin (``allreduce`` and ``protocol``) it tunes both; without, it never publishes a protocol."""

from __future__ import annotations

from hyperagent.demo import JOB, simulated_cluster

from conftest import Mosquitto


async def test_an_nccl_job_announcing_the_plugin_knobs_is_tuned_over_them(
    mosquitto: Mosquitto,
) -> None:
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=8,
        seed=3,
        speedup=100,
        job_knobs=("bucket_mb", "chunk_kb", "allreduce", "protocol"),
    ) as (coordinator, _, _):  # confirming re-publishes the baseline, from before the announcement
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert state.space.protocol == ("ll", "ll128", "simple")
    assert state.space.allreduce == ("ring", "tree")
    announced = [t for t in state.trials if "protocol" in t.settings]
    assert announced, "trials after the announcement carry the protocol"
    assert {t.settings["protocol"] for t in announced} <= {"ll", "ll128", "simple"}
    assert len({(t.settings["allreduce"], t.settings["protocol"]) for t in announced}) > 1


async def test_an_nccl_job_without_the_plugin_never_sees_a_protocol(mosquitto: Mosquitto) -> None:
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=4,
        seed=3,
        speedup=100,
        job_knobs=("bucket_mb", "chunk_kb"),
        job_overrides={"confirm_best": False},
    ) as (coordinator, _, _):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
    assert state.space.protocol == ()
    assert all("protocol" not in t.settings for t in state.trials)
