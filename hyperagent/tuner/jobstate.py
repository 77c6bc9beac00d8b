"""What the coordinator knows about one job's tuning: its trials, where its lifecycle is, its
nodes (progress, acks, reports of the version in play), and the readings that describe it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hyperagent.config import JobTuningSection
from hyperagent.job import common_knobs
from hyperagent.readings import Kind, Reading
from hyperagent.tuner import lifecycle
from hyperagent.tuner.journal import Journal
from hyperagent.tuner.lifecycle import Tuned
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import SearchSpace
from hyperagent.tuner.trial import Gain


@dataclass
class TrialRecord:
    """One finished trial of one job."""

    index: int
    version: int
    settings: dict[str, Any]
    score: float | None
    status: str
    """ok, aborted, infeasible, refused, no_ack, timeout, nonfinite_loss, xid or lost_nodes."""
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    noise: float | None = None
    """Standard error of the score, from the spread of the measurement windows."""
    confirmation: bool = False
    """A re-measurement after tuning (the baseline or the best, interleaved), not a trial of
    the budget."""
    acks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The nodes' acks of its version (not journaled)."""
    nodes: tuple[str, ...] = ()
    """The nodes behind an outcome that is not a trial (refusing, silent, not measured)."""
    errors: dict[str, str] = field(default_factory=dict)
    """What refusing nodes said."""

    def to_journal(self) -> dict[str, Any]:
        reports = {
            node: {k: r.get(k) for k in ("throughput", "samples", "seconds", "energy_j", "windows")}
            for node, r in self.reports.items()
        }
        return {
            "type": "trial",
            "index": self.index,
            "version": self.version,
            "settings": self.settings,
            "score": self.score,
            "status": self.status,
            "reports": reports,
            "seconds": self.seconds,
            "noise": self.noise,
            **({"confirmation": True} if self.confirmation else {}),
        }

    @classmethod
    def from_journal(cls, entry: dict[str, Any]) -> TrialRecord:
        return cls(
            entry["index"],
            entry["version"],
            entry["settings"],
            entry["score"],
            entry["status"],
            entry.get("reports", {}),
            entry.get("seconds", 0.0),
            entry.get("noise"),
            bool(entry.get("confirmation", False)),
        )


class Progress(NamedTuple):
    """A node's running totals of one job, from its telemetry."""

    samples: float
    """Samples, summed over the node's ranks."""
    step_s: float
    """Step seconds, summed over the node's ranks."""
    ts: float
    ranks: int = 1
    """How many ranks' steps the sums count (1 when the agent does not say)."""


@dataclass
class JobState:
    """What the coordinator knows about one job's tuning."""

    config: JobTuningSection
    space: SearchSpace
    tuner: Tuner
    journal: Journal
    version: int = 0
    trials: list[TrialRecord] = field(default_factory=list)
    confirmations: list[TrialRecord] = field(default_factory=list)
    """The baseline and the best settings measured again after tuning, interleaved."""
    confirmed: Gain | None = None
    """The best settings' gain over the baseline from the confirmations; None without them."""
    baseline: float | None = None
    best: tuple[dict[str, Any], float] | None = None
    final_version: int | None = None
    phase: lifecycle.State | None = None
    """Where the tuning is (None: not started)."""
    rounds: int = 0
    current: dict[str, Any] = field(default_factory=dict)
    """The settings last published."""
    last_good: dict[str, Any] | None = None
    trial_started: float | None = None
    """Unix time the running trial's settings went out; None between trials."""
    recommendation: dict[str, Any] | None = None
    why: str = ""
    lost: dict[str, str] = field(default_factory=dict)
    """Nodes excluded from scoring, and why: "offline" (its status says so; back when it says
    online), "silent" (no ack; back at its next ack) or "no measurement" (its job reported
    nothing in time; back at its next report)."""
    acks: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    reports: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    partials: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    progress: dict[str, Progress] = field(default_factory=dict)
    """node -> its last telemetry's totals, for drift and to see it step."""
    running: dict[str, Any] | None = None
    """The settings of the trial being run (a retry runs them again)."""
    confirm_order: list[dict[str, Any]] = field(default_factory=list)
    """The settings the confirmations measure, in order."""
    start_settings: dict[str, Any] | None = None
    """Where the search starts (a warm start, or the configured start), once known."""
    rollback: tuple[int, dict[str, dict[str, Any]]] | None = None
    """The last rollback's version and the acks it got."""
    retries: int = 0
    """Runs retried after a pause."""
    cap_latency_s: float | None = None
    """The slowest power-cap change a node measured (its acks' ``power_cap_latency_s``)."""
    knobs: dict[str, tuple[str, ...] | None] = field(default_factory=dict)
    """node -> the knobs its job's ranks said they apply (None: they did not say)."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _members: tuple[tuple[str, ...], frozenset[str]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def has_node(self, node: str) -> bool:
        """Whether ``node`` is one of the job's nodes (a set lookup: telemetry from thousands
        of nodes asks this for every message)."""
        nodes = self.config.nodes
        members = self._members
        if members is None or members[0] is not nodes:
            members = self._members = (nodes, frozenset(nodes))
        return node in members[1]

    @property
    def done(self) -> bool:
        """The tuning ended: its settings are out (or, in recommend mode, reported)."""
        return isinstance(self.phase, Tuned)

    @property
    def paused(self) -> lifecycle.Paused | None:
        """The pause the job is in, if any."""
        phase = self.phase
        if isinstance(phase, lifecycle.WaitingForQuorum):
            return phase.paused
        return phase if isinstance(phase, lifecycle.Paused) else None

    def in_play(self, version: int) -> bool:
        """Whether acks and reports of ``version`` still matter: only the latest published
        (a trial's, a rollback's or the final settings') does."""
        return version == self.version

    def prune(self) -> None:
        """Forget acks, reports and partials of versions no longer in play."""
        for table in (self.acks, self.reports, self.partials):
            for version in [v for v in table if not self.in_play(v)]:
                del table[version]

    @property
    def active_nodes(self) -> list[str]:
        return [n for n in self.config.nodes if n not in self.lost]

    @property
    def gain(self) -> float | None:
        """Best score over the baseline (the starting settings), minus one: once confirmed,
        both measured the same way (0 when no setting was better than the baseline)."""
        if self.confirmed is not None:
            return self.confirmed.value if self.confirmed.better else 0.0
        if self.best is None or not self.baseline:
            return None
        return self.best[1] / self.baseline - 1

    @property
    def announced_knobs(self) -> tuple[str, ...] | None:
        """The knobs the job applies on every node whose ranks said (None: none said)."""
        return common_knobs(self.knobs.values())

    def record(self, trial: TrialRecord, penalty: float | None) -> None:
        """Account a finished trial in the tuner and the running best."""
        self.trials.append(trial)
        if trial.score is not None and trial.status == "ok":
            self.tuner.tell(trial.settings, trial.score, noise=trial.noise)
            if self.baseline is None and trial.index == 0:
                self.baseline = trial.score
            if self.best is None or trial.score > self.best[1]:
                self.best = (trial.settings, trial.score)
            if self.last_good is None or self.best[0] == trial.settings:
                self.last_good = trial.settings
        elif trial.score is not None:  # aborted: a real, bad partial measurement
            self.tuner.tell(trial.settings, trial.score)
        else:
            self.tuner.tell(trial.settings, penalty if penalty is not None else 0.0)


TrialCallback = Callable[[JobState, TrialRecord], None]


def job_readings(state: JobState) -> list[Reading]:
    """The tuning of one job as readings (trials by outcome, scores, settings, nodes)."""
    job = {"job_id": state.config.id}
    scored = {**job, "objective": state.config.objective}
    out = [
        Reading("hyperagent_tuner_settings_version", state.version, job),
        Reading("hyperagent_tuner_done", float(state.done), job),
        Reading("hyperagent_tuner_rounds_total", state.rounds, job, Kind.COUNTER),
        Reading("hyperagent_tuner_lost_nodes", len(state.lost), job),
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
    if state.baseline is not None:
        out.append(Reading("hyperagent_tuner_baseline_score", state.baseline, scored))
    if state.best is not None:
        out.append(Reading("hyperagent_tuner_best_score", state.best[1], scored))
    last = next((t for t in reversed(state.trials) if t.score is not None), None)
    if last is not None and last.score is not None:
        out.append(Reading("hyperagent_tuner_last_score", last.score, scored))
    if state.trial_started is not None:
        out.append(
            Reading("hyperagent_tuner_trial_started_timestamp_seconds", state.trial_started, job)
        )
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
        Reading("hyperagent_tuner_state", 1.0, {**job, "state": lifecycle.name(state.phase)})
    )
    out.append(Reading("hyperagent_tuner_retries_total", state.retries, job, Kind.COUNTER))
    paused = state.paused
    if paused is not None:
        reason = {**job, "reason": paused.reason}
        out.append(Reading("hyperagent_tuner_paused", 1.0, reason))
        for node in paused.nodes:
            out.append(Reading("hyperagent_tuner_paused_node", 1.0, {**reason, "node": node}))
        retry_at = time.time() + paused.retry_at - time.monotonic()
        out.append(Reading("hyperagent_tuner_retry_timestamp_seconds", retry_at, job))
    return out
