"""A job's tuning as readings for /metrics: its trials by outcome, scores, settings, nodes,
state, cost and pause."""

from __future__ import annotations

import time
from collections import Counter

from hyperagent.readings import Kind, Reading
from hyperagent.tuner import lifecycle
from hyperagent.tuner.tuning import JobTuning


def job_readings(state: JobTuning) -> list[Reading]:
    """The tuning of one job as readings (trials by outcome, scores, settings, nodes)."""
    job = {"job_id": state.job}
    scored = {**job, "objective": state.config.objective}
    out = [
        Reading("hyperagent_tuner_settings_version", state.version, job),
        Reading("hyperagent_tuner_done", float(state.done), job),
        Reading("hyperagent_tuner_rounds_total", state.rounds, job, Kind.COUNTER),
        Reading("hyperagent_tuner_lost_nodes", len(state.members.out), job),
        Reading("hyperagent_tuner_nodes", len(state.nodes), job),
        Reading(
            "hyperagent_tuner_trial_deadline_seconds",
            state.config.ack_timeout_s + state.config.trial_timeout_s,
            job,
        ),
    ]
    for status, count in sorted(Counter(t.status for t in state.trials).items()):
        out.append(
            Reading("hyperagent_tuner_trials_total", count, {**job, "status": status}, Kind.COUNTER)
        )
    stopped = Counter(t.verdict for t in state.trials if t.status == "stopped_early")
    for verdict in ("better", "worse"):
        out.append(
            Reading(
                "hyperagent_tuner_trials_stopped_early_total",
                stopped.get(verdict, 0),
                {**job, "verdict": verdict},
                Kind.COUNTER,
            )
        )
    if state.baseline is not None:
        out.append(Reading("hyperagent_tuner_baseline_score", state.baseline, scored))
    if state.best is not None:
        out.append(Reading("hyperagent_tuner_best_score", state.best[1], scored))
    spent = state.cost()
    if spent is not None:
        out.append(Reading("hyperagent_tuner_tuning_seconds", spent.seconds, scored))
        out.append(Reading("hyperagent_tuner_samples_lost", spent.lost, scored))
        out.append(Reading("hyperagent_tuner_samples_lost_ratio", spent.lost_ratio, scored))
        if spent.break_even_s is not None:
            out.append(Reading("hyperagent_tuner_break_even_seconds", spent.break_even_s, scored))
    last = next((t for t in reversed(state.trials) if t.score is not None), None)
    if last is not None and last.score is not None:
        out.append(Reading("hyperagent_tuner_last_score", last.score, scored))
    if state.trial_started is not None:
        started = time.time() - (state.clock_now - state.trial_started)
        out.append(Reading("hyperagent_tuner_trial_started_timestamp_seconds", started, job))
    for metric, settings in (
        ("hyperagent_tuner_setting", state.current),
        ("hyperagent_tuner_recommended_setting", state.recommendation or {}),
    ):
        for knob in ("bucket_mb", "chunk_kb", "power_cap_w"):
            value = settings.get(knob)
            if isinstance(value, int | float):
                out.append(Reading(metric, float(value), {**job, "knob": knob}))
    if "allreduce" in state.current:
        algorithm = {**job, "algorithm": str(state.current["allreduce"])}
        out.append(Reading("hyperagent_tuner_allreduce_info", 1.0, algorithm, Kind.INFO))
    out.append(
        Reading("hyperagent_tuner_state", 1.0, {**job, "state": lifecycle.name(state.state)})
    )
    out.append(Reading("hyperagent_tuner_retries_total", state.retries, job, Kind.COUNTER))
    paused = state.paused
    if paused is not None:
        reason = {**job, "reason": paused.reason}
        out.append(Reading("hyperagent_tuner_paused", 1.0, reason))
        for node in paused.nodes:
            out.append(Reading("hyperagent_tuner_paused_node", 1.0, {**reason, "node": node}))
        retry_at = time.time() + paused.retry_at - state.clock_now
        out.append(Reading("hyperagent_tuner_retry_timestamp_seconds", retry_at, job))
    return out
