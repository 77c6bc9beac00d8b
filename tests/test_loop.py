"""The whole loop through a real mosquitto: coordinator, three agents, simulated training ranks."""

from __future__ import annotations

import asyncio

from hyperagent.demo import JOB, simulated_cluster
from hyperagent.tuner.lifecycle import MEASURED


def limits_w(nvml) -> set[float]:  # type: ignore[no-untyped-def]
    return {
        nvml.nvmlDeviceGetEnforcedPowerLimit(nvml.nvmlDeviceGetHandleByIndex(i)) / 1000
        for i in range(nvml.nvmlDeviceGetCount())
    }


async def test_closed_loop_through_mosquitto(mosquitto) -> None:  # type: ignore[no-untyped-def]
    async with simulated_cluster(
        mosquitto.url, nodes=3, trials=14, seed=1, speedup=100, job_overrides={"patience": 14}
    ) as (
        coordinator,
        nodes,
        model,
    ):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
        names = {n.name for n in nodes}

        # 14 trials, then the start and the best trial's settings measured again, interleaved
        assert len(state.trials) == 14 and not any(t.confirmation for t in state.trials)
        start = state.trials[0].settings
        candidate = next((c.settings for c in state.confirmations if c.settings != start), start)
        assert [c.settings for c in state.confirmations] == [start, candidate, candidate, start]
        assert all(c.confirmation and c.status == "ok" for c in state.confirmations)
        assert {t.status for t in state.trials} <= MEASURED  # ok, aborted or stopped early
        # throughput without a power budget: no trial is spent on a lower power cap
        assert {t.settings["power_cap_w"] for t in state.trials} == {250}
        for trial in [*state.trials, *state.confirmations]:
            acks = trial.acks
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

        # the landscape's optimum is about 10% above the start (longer chunks and buckets on
        # three nodes): 14 trials find most of it (the table's 256 KiB chunks measure 21% below
        # the start and the space-filling design spends trials 3-6 away from the seeds, so ten
        # trials often ended on the start under load; 14 chose +6.7% to +10.2% of +10.2% with
        # seed 1 on a loaded machine), and the best trial's settings are published because
        # their gain over the start, both measured the same way, has an interval above zero
        space = state.space
        optimum = model.optimum(space)[1] / model.throughput(start) - 1
        assert optimum > 0.05
        confirmed = state.confirmed
        assert confirmed is not None and confirmed.better and confirmed.low > 0
        assert best == candidate != start and state.gain == confirmed.value > 0
        chosen = model.throughput(best) / model.throughput(start) - 1
        assert 0 < chosen <= optimum
        print(f"optimum {optimum:+.1%}, chosen {chosen:+.1%}, confirmed {confirmed.describe()}")
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
        stopped = get("hyperagent_tuner_trials_total", {**job, "status": "stopped_early"}) or 0
        assert ok + aborted + stopped == 4  # the budget; confirmations after it are not trials
        by_verdict = [
            get("hyperagent_tuner_trials_stopped_early_total", {**job, "verdict": v})
            for v in ("worse", "better")
        ]
        assert sum(by_verdict) == stopped
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
        # what the tuning cost against its start, as the journal's final entry says it
        final = coordinator.journals.read(JOB).final
        assert final is not None and "cost" in final, final
        scored = {**job, "objective": "throughput"}
        cost = final["cost"]
        assert get("hyperagent_tuner_samples_lost", scored) == cost["samples_lost"]
        assert get("hyperagent_tuner_tuning_seconds", scored) == cost["seconds"] > 0
        break_even = get("hyperagent_tuner_break_even_seconds", scored)
        assert break_even == cost["break_even_s"]  # None (absent): never breaks even
