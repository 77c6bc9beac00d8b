"""Early stops through a real mosquitto with real agents over the simulated job: the agents
read the GPUs' energy counter as each measurement window closes, so an energy tuning's
reports carry energy per window and its trials a standard error; a search trial the
coordinator stops moves the agents on to the next trial's settings, and no report of the
stopped version is taken for the next one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from hyperagent.demo import JOB, simulated_cluster
from hyperagent.tuner.tuning import JobTuning

from conftest import Mosquitto

TERRIBLE = {"bucket_mb": 1, "chunk_kb": 64, "power_cap_w": 100, "allreduce": "tree"}


def journal(path: Path) -> list[dict[str, Any]]:
    lines = path.read_bytes().splitlines()
    return [orjson.loads(line) for line in lines if line.endswith(b"}")]


async def test_an_energy_tuning_measures_energy_per_window_and_stops_a_bad_trial_early(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    def propose_terrible(state: JobTuning, record: Any) -> None:
        if record.index == 0:
            assert state.tuner is not None
            ask = state.tuner.ask
            asked = iter([dict(TERRIBLE)])
            state.tuner.ask = lambda: next(asked, None) or ask()  # type: ignore[method-assign]

    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=3,
        objective="energy",
        speedup=100,
        on_trial=propose_terrible,
        coordinator_dir=tmp_path,
        job_overrides={"confirm_best": False, "abort_below": 0},
    ) as (coordinator, _, model):
        async with asyncio.timeout(120):
            await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
        entries = journal(coordinator.journals.path(JOB))
    baseline, bad, *_ = state.trials
    assert model.score(TERRIBLE, "energy") < 0.7 * model.score(baseline.settings, "energy")
    # every node reported its GPUs' energy in each window; the score's error comes from them
    assert baseline.status == "ok" and baseline.noise is not None and baseline.noise > 0
    for report in baseline.reports.values():
        assert len(report["energy_windows"]) == len(report["windows"]) >= 4
        assert all(e > 0 for e in report["energy_windows"])
        assert sum(report["energy_windows"]) == pyapprox(report["energy_j"])
    assert bad.settings == TERRIBLE
    assert (bad.status, bad.verdict) == ("stopped_early", "worse")
    assert bad.noise is not None
    windows = {len(r["windows"]) for r in bad.reports.values()}
    assert min(windows) >= 3 and max(windows) < len(
        next(iter(baseline.reports.values()))["windows"]
    )
    stopped = next(e for e in entries if e["type"] == "trial" and e["index"] == 1)
    assert stopped["status"] == "stopped_early" and stopped["verdict"] == "worse"
    # the next trial's reports are of its own version, measured in full
    after = state.trials[2]
    assert after.version > bad.version and after.status in ("ok", "stopped_early")
    assert all(r["version"] == after.version for r in after.reports.values())


def pyapprox(value: float) -> Any:
    import pytest

    return pytest.approx(value, rel=1e-6)
