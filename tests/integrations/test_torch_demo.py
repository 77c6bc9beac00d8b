"""The torch-ddp demo end to end through a real mosquitto: real ranks, agent, coordinator."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest
from demo_cli import check_cost, run_demo_command

from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.lifecycle import MEASURED
from hyperagent.tuner.tuning import JobTuning as JobState

from conftest import BUSY, Mosquitto

try:
    import torch  # noqa: F401

    from hyperagent.demo_torch import NODE, run_torch_demo

    TORCH_MISSING = ""
except ImportError as e:
    TORCH_MISSING = str(e)


@pytest.fixture(autouse=True)
def _torch_installed() -> None:
    if TORCH_MISSING:
        pytest.fail(
            f"PyTorch is missing ({TORCH_MISSING}): .venv/bin/pip install torch==2.13.0 "
            "(bash .ci/run does)"
        )


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@BUSY
@pytest.mark.long(16)
async def test_the_demo_tunes_two_real_ranks_and_stops_them(mosquitto: Mosquitto) -> None:
    seen: list[TrialRecord] = []

    def on_trial(state: JobState, record: TrialRecord) -> None:
        seen.append(record)

    async with asyncio.timeout(240):
        result = await run_torch_demo(mosquitto.url, trials=2, seed=0, on_trial=on_trial)

    state = result.state
    # two trials, then (unless the defaults stayed best) the defaults and the best trial's
    # settings measured again, interleaved, and shown as confirmations
    assert state.done and seen == [*state.trials, *state.confirmations]
    assert len(state.trials) == 2 and not any(r.confirmation for r in state.trials)
    assert all(r.confirmation for r in state.confirmations)
    assert state.knobs == {NODE: ("bucket_mb", "chunk_kb")}  # what TunedDDP announced
    assert state.trials[0].settings == {"bucket_mb": 32, "chunk_kb": 32768, "allreduce": "ring"}
    for record in [*state.trials, *result.confirmations]:
        assert record.acks[NODE]["ok"], record
        assert record.status in MEASURED, record  # ok, aborted or stopped early
        assert record.score is not None and record.score > 0
        assert record.reports[NODE]["throughput"] > 0
    assert state.final_version is not None and state.acks[state.final_version][NODE]["ok"]
    if result.candidate is not None:
        start, best = result.start_settings, result.candidate
        assert [r.settings for r in result.confirmations] == [start, best, best, start]
    assert result.gain is not None and math.isfinite(result.gain)
    summary = "\n".join(result.summary())
    confirmed = state.confirmed
    if confirmed is not None and confirmed.better:
        assert result.best_settings == result.candidate and result.gain > 0
        assert "confirmed gain over PyTorch's defaults: +" in summary
        assert "95% interval +" in summary
    else:
        assert result.best_settings == result.start_settings and result.gain == 0
        assert "no setting was better" in summary

    assert result.ranks_consistent
    ran = set(result.versions_by_rank[0])
    assert {r.version for r in [*state.trials, *result.confirmations]} <= ran
    for steps in result.rank_steps.values():
        for s in steps:
            assert 0 <= s["comm_s"] <= s["step_s"]

    assert result.returncodes == [0, 0]
    assert not any(is_running(pid) for pid in result.pids)


@BUSY
@pytest.mark.long(18)
def test_the_demo_command_keeps_its_journal_and_serves_the_cost(tmp_path: Path) -> None:
    """``hyperagent demo --workload torch-ddp`` on its embedded broker, as a user runs it."""
    state_dir = tmp_path / "state"
    args = ["--workload", "torch-ddp", "--trials", "2", "--state-dir", str(state_dir)]
    run = run_demo_command(args, timeout_s=240)
    assert run.returncode == 0, run.out
    assert "PyTorch defaults: bucket 32 MiB, chunk 32768 KiB" in run.out
    check_cost(run, state_dir, "torch-ddp", tmp_path)
    assert (state_dir / "agent" / "applied-settings.json").is_file()  # the agent's state too
