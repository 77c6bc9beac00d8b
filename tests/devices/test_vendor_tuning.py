"""The demo's coordinator tunes a job on AMD MI300X and Intel Gaudi replays through a real
mosquitto, with the power cap in the search: the agents cap the fake amdsmi / HLML devices
(microwatts, milliwatts), the job's power follows the cap, and the energy objective reads the
devices' energy counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyperagent.demo import JOB, demo_power_limits_w, simulated_cluster

from conftest import FIXTURES, Mosquitto

MI300X = FIXTURES / "replay" / "amd-mi300x-8gpu"
GAUDI = FIXTURES / "replay" / "gaudi-hl205-8card"


async def tuned_for_energy(
    mosquitto: Mosquitto, capture: Path, search_power_cap: bool
) -> tuple[Any, list[float | None], Any]:
    """An energy tuning of 8 trials on two nodes replaying ``capture``: the job's machine, each
    node's power cap after it, the job model; at least 4 trials were scored."""
    async with simulated_cluster(
        mosquitto.url,
        nodes=2,
        trials=8,
        seed=3,
        objective="energy",
        speedup=100,
        capture_dir=capture,
        job_overrides={"search_power_cap": search_power_cap},
    ) as (coordinator, nodes, model):
        await coordinator.run(until_tuned=True)
        state = coordinator.jobs[JOB]
        caps = [node.power_cap_w() for node in nodes]
    scored = [t for t in state.trials if t.score is not None]
    assert len(scored) >= 4, [t.status for t in state.trials]
    return state, caps, model


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("capture", "limits"),
    [(MI300X, (375.0, 750.0)), (GAUDI, (150.0, 350.0))],
    ids=["amd-mi300x", "gaudi-hl205"],
)
async def test_the_coordinator_caps_power_and_minimises_energy(
    mosquitto: Mosquitto, capture: Path, limits: tuple[float, float]
) -> None:
    assert demo_power_limits_w(capture) == limits
    state, caps, model = await tuned_for_energy(mosquitto, capture, search_power_cap=True)
    tried = {t.settings["power_cap_w"] for t in state.trials if "power_cap_w" in t.settings}
    assert len(tried) >= 3 and all(limits[0] <= w <= limits[1] for w in tried), tried
    best = state.best
    assert best is not None
    assert caps == [best[0]["power_cap_w"]] * 2  # every node's devices at the best cap
    assert state.gain is not None and state.gain > 0, state.gain
    model_gain = model.score(best[0], "energy") / model.score(state.trials[0].settings, "energy")
    assert model_gain > 1
    print(
        f"{capture.name}: {len(state.trials)} trials, caps tried {sorted(tried)} W, "
        f"best {best[0]} at {best[1]:.4g} samples/J, measured gain {state.gain:+.1%}, "
        f"model gain {model_gain - 1:+.1%}"
    )


INTEL_MAX = FIXTURES / "replay" / "intel-max1550-documented"


@pytest.mark.timeout(240)
async def test_the_coordinator_minimises_energy_on_intel_gpu_max_telemetry(
    mosquitto: Mosquitto,
) -> None:
    """Intel Data Center GPU Max through xpu-smi (telemetry only, no cap set): the energy
    objective reads the devices' energy counters from the fake xpu-smi's dumps, every trial
    is scored in samples per joule within 2% of what the job model draws, and the best is
    within 3% of the tried settings the model rates best (trials closer than that trade
    places under load)."""
    assert demo_power_limits_w(INTEL_MAX) == (300.0, 600.0)
    state, caps, model = await tuned_for_energy(mosquitto, INTEL_MAX, search_power_cap=False)
    scored = [t for t in state.trials if t.score is not None]
    assert all("power_cap_w" not in t.settings for t in state.trials)
    assert caps == [600.0, 600.0]  # nothing capped the devices
    for trial in scored:  # samples per joule of the devices' own counters, as the job does
        assert trial.score == pytest.approx(model.score(trial.settings, "energy"), rel=0.02)
    best = state.best
    assert best is not None and state.gain is not None and state.gain >= 0, state.gain
    modelled = max(model.score(t.settings, "energy") for t in scored)
    assert model.score(best[0], "energy") >= 0.97 * modelled  # the model's best, within noise
    print(
        f"{INTEL_MAX.name}: {len(state.trials)} trials, best {best[0]} at {best[1]:.4g}"
        f" samples/J, measured gain {state.gain:+.1%}"
    )
