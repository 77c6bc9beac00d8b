"""The whole loop through a real mosquitto: coordinator, three agents, simulated training ranks."""

from __future__ import annotations

import asyncio

from hyperagent.demo import JOB, simulated_cluster


def limits_w(nvml) -> set[float]:  # type: ignore[no-untyped-def]
    return {
        nvml.nvmlDeviceGetEnforcedPowerLimit(nvml.nvmlDeviceGetHandleByIndex(i)) / 1000
        for i in range(nvml.nvmlDeviceGetCount())
    }


async def test_closed_loop_through_mosquitto(mosquitto) -> None:  # type: ignore[no-untyped-def]
    async with simulated_cluster(mosquitto.url, nodes=3, trials=10, seed=1, speedup=100) as (
        coordinator,
        nodes,
        model,
    ):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
        names = {n.name for n in nodes}

        # ten trials and the best one measured again; bad ones may end early, none fails
        assert (
            len(state.trials) == 11
            and state.trials[-1].settings
            == state.trials[
                [t.score for t in state.trials[:10]].index(
                    max(t.score or 0 for t in state.trials[:10])
                )
            ].settings
        )
        assert {t.status for t in state.trials} <= {"ok", "aborted"}
        for trial in state.trials:
            acks = state.acks[trial.version]
            assert set(acks) == names and all(a["ok"] for a in acks.values())
            assert set(trial.reports) == names
        assert set(state.acks[state.final_version]) == names  # the final settings were acked

        assert state.best is not None
        best = state.best[0]
        # the agents acked the final settings; each rank takes them at its next step boundary
        async with asyncio.timeout(5):
            while any(
                n.reporter.applied is None or n.reporter.applied.version != state.final_version
                for n in nodes
            ):
                await asyncio.sleep(0.005)
        for node in nodes:
            assert node.agent.applied_versions[JOB] == state.final_version
            assert limits_w(node.nvml) == {float(best["power_cap_w"])}
            job_knobs = {k: v for k, v in best.items() if k != "power_cap_w"}
            assert node.reporter.applied is not None
            assert node.reporter.applied.version == state.final_version
            assert dict(node.reporter.applied.settings) == job_knobs
            # the rank switched versions in order, at step boundaries
            assert node.versions_run == sorted(node.versions_run)

        # never worse than the start; ten noisy trials may not find a gain beyond the noise
        # here (the best measured is +0.5%), so which of the two is published is the model's call
        start = state.trials[0].settings
        assert model.throughput(best) >= model.throughput(start)
    for node in nodes:  # agents stopped: the original limits are back
        assert limits_w(node.nvml) == {250.0}


async def test_coordinator_metrics_describe_the_tuning(mosquitto) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    async with simulated_cluster(mosquitto.url, nodes=2, trials=4, seed=3, speedup=100) as (
        coordinator,
        nodes,
        _,
    ):
        await coordinator.run(until_tuned=True)
        registry = CollectorRegistry()
        registry.register(coordinator.collector)
        get = registry.get_sample_value
        job = {"job_id": JOB}
        state = coordinator.jobs[JOB]
        ok = get("hyperagent_tuner_trials_total", {**job, "status": "ok"})
        aborted = get("hyperagent_tuner_trials_total", {**job, "status": "aborted"}) or 0
        assert ok + aborted == 5  # four and the confirmation of the best
        assert get("hyperagent_tuner_done", job) == 1
        assert (
            get("hyperagent_tuner_best_score", {**job, "objective": "throughput"})
            == (
                state.best[1]  # type: ignore[index]
            )
        )
        assert get("hyperagent_tuner_settings_version", job) == state.final_version
        assert (
            get("hyperagent_tuner_setting", {**job, "knob": "power_cap_w"})
            == (
                state.best[0]["power_cap_w"]  # type: ignore[index]
            )
        )
        for node in nodes:
            assert get("hyperagent_node_online", {"node": node.name}) == 1
