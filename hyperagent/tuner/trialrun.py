"""One run of a trial (or a confirmation) and its outcome, as a pure machine.

A :class:`Run` is the settings of the trial in play under one version, and what came back
for that version: acks, partial reports (after each window) and final reports. Its
:meth:`Run.step` looks at it at ``now`` with the job's :class:`~.membership.Membership` and a
:class:`Judge` (the job's tuning, its baseline, its incumbent) and says whether the run is over
and how (:class:`Outcome`: ``ok``, ``aborted``, ``stopped_early``, ``timeout``, ...), with the
membership changes the look made (nodes that did not ack or measure are out of scoring).
Nothing here reads a clock or does I/O: :class:`~.tuning.JobTuning` feeds the run what the
nodes sent and records the outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hyperagent.config import JobTuningSection, TrialPlanSection
from hyperagent.tuner import lifecycle
from hyperagent.tuner.early import EarlyStop, Verdict, told
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.membership import Change, Membership, Silent, Unmeasured, step
from hyperagent.tuner.membership import Event as MembershipEvent
from hyperagent.tuner.trial import MeasurementPlan, compare, score, score_noise, window_scores

POWER_AVERAGING_WINDOW_S = 1.0
"""NVML averages board power over about a second; a power change settles for 3x that."""

SETTINGS_REFUSALS = frozenset({"settings"})
"""Refusal kinds that are facts about the settings (outside a node's bounds, capping off)."""

STOPPED_EARLY = "stopped_early"
"""The status of a search trial whose measurement stopped once its windows were judged."""

SCORED = frozenset({"ok", STOPPED_EARLY})
"""Outcomes whose score measures the settings in full (with its noise): a best can be one."""


@dataclass(frozen=True)
class Outcome:
    """A run's result, before it is recorded."""

    status: str
    reports: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    score: float | None = None
    noise: float | None = None
    nodes: tuple[str, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)
    verdict: str | None = None
    """A trial stopped early: worse or better than the incumbent."""


@dataclass(frozen=True)
class RunStep:
    """What a look at the run found: its ``outcome`` (None: it goes on), the job's
    membership after it and the changes it made, and for a trial stopped early the line
    that says why (``stopped``)."""

    outcome: Outcome | None
    members: Membership
    changes: tuple[Change, ...] = ()
    stopped: str | None = None


class _Members:
    """The job's membership as a look at the run steps it, with every change made."""

    def __init__(self, start: Membership) -> None:
        self.now = start
        self.changes: list[Change] = []

    def step(self, event: MembershipEvent) -> None:
        self.now, changes = step(self.now, event)
        self.changes += changes


@dataclass(frozen=True)
class Judge:
    """What a run is judged with: the job's tuning, its baseline (trial 0's score) and the
    incumbent (the best search trial so far, whose windows an early judgement compares with)."""

    config: JobTuningSection
    baseline: float | None = None
    incumbent: TrialRecord | None = None

    def score(self, reports: list[Mapping[str, Any]]) -> float | None:
        cfg = self.config
        return score(reports, cfg.objective, len(cfg.nodes), cfg.power_budget_w)

    def needs_energy(self) -> bool:
        return self.config.objective == "energy" or self.config.power_budget_w is not None

    def should_abort(self, run: Run, active: tuple[str, ...]) -> bool:
        """Every active node's partial measurement puts the search trial below the abort
        line."""
        if run.phase != "search" or self.baseline is None or not self.config.abort_below:
            return False
        if not active or not set(active) <= set(run.partials):
            return False
        partial = self.score([run.partials[n] for n in active])
        return partial is not None and partial < self.config.abort_below * self.baseline

    def early(self, run: Run, active: tuple[str, ...]) -> Outcome | None:
        """The run stopped early (:mod:`~hyperagent.tuner.early`): a search trial but the
        baseline, every active node's windows so far (its final report, else its latest
        partial) clearly worse than the incumbent's, or clearly better where the rule allows:
        for throughput; for energy when every node reports energy per window; never under a
        power budget, which a partial report cannot tell a trial keeps. None: measure on."""
        cfg = self.config
        incumbent = self.incumbent
        if not cfg.early_stop or run.phase != "search" or run.trial == 0 or incumbent is None:
            return None
        reports: dict[str, Mapping[str, Any]] = {}
        for node in active:
            report = run.reports.get(node) or run.partials.get(node)
            if report is None or report.get("stalled") or report.get("nonfinite_loss"):
                return None
            reports[node] = report
        if not reports:
            return None
        windows, against = self._windows(reports, incumbent)
        if cfg.power_budget_w is not None:
            rule = EarlyStop(stop_better=False)
        else:
            rule = EarlyStop.for_objective(cfg.objective, energy_windows=bool(windows))
        verdict = rule.judge(windows, against)
        if verdict is Verdict.MEASURE_ON:
            return None
        mean, noise = told(windows)
        return Outcome(STOPPED_EARLY, dict(reports), mean, noise, verdict=str(verdict))

    def stopped_text(self, run: Run, outcome: Outcome) -> str:
        """Why a trial stopped early, against the incumbent, for the log."""
        incumbent = self.incumbent
        assert incumbent is not None
        windows, against = self._windows(outcome.reports, incumbent)
        gain = compare(against, windows)
        judged = f" ({gain.describe()})" if gain is not None else ""
        return (
            f"trial {run.trial} stopped after {len(windows)} windows: "
            f"{outcome.verdict} than trial {incumbent.index}{judged}"
        )

    def _windows(
        self, reports: Mapping[str, Mapping[str, Any]], incumbent: TrialRecord
    ) -> tuple[list[float], list[float]]:
        """The window scores of ``reports`` and of the incumbent's."""
        objective, nodes = self.config.objective, len(self.config.nodes)
        windows = window_scores(list(reports.values()), objective, nodes)
        against = window_scores(list(incumbent.reports.values()), objective, nodes)
        return windows, against

    def acks_outcome(self, run: Run, job: _Members) -> Outcome | None:
        """Why the run cannot be measured, after its acks; None: it goes on to measuring."""
        acks = run.acks
        refused = {n: a for n, a in acks.items() if not a["ok"]}
        if refused:
            errors = {n: str(a.get("error")) for n, a in refused.items()}
            kinds = {a.get("refusal") for a in refused.values()}
            status = "rejected" if kinds <= SETTINGS_REFUSALS else "refused"
            return Outcome(status, nodes=tuple(sorted(refused)), errors=errors)
        silent = tuple(n for n in job.now.active if n not in acks)
        if silent:
            job.step(Silent(silent, run.version))
        if not acks:
            return Outcome("no_ack", nodes=tuple(job.now.nodes))
        if not job.now.quorum():
            return Outcome("lost_nodes", nodes=tuple(n for n in job.now.nodes if n not in acks))
        return None

    def measured_outcome(self, run: Run, job: _Members) -> Outcome:
        """The outcome of a run whose measurements are in, whose deadline passed, or whose
        partial measurements put it below the abort line."""
        active = job.now.active
        if self.should_abort(run, active) and not set(active) <= set(run.reports):
            reports = {n: run.partials[n] for n in active}
            return Outcome("aborted", reports, self.score(list(reports.values())))
        measured = {n: r for n, r in run.reports.items() if not r.get("stalled")}
        unmeasured = [n for n in active if n not in measured]
        if unmeasured:
            job.step(Unmeasured(tuple(unmeasured), run.version))
        blind: list[str] = []
        if self.needs_energy():
            blind = [n for n in job.now.active if measured[n].get("energy_j") is None]
            if blind:
                job.step(Unmeasured(tuple(blind), run.version, "no energy reading"))
        reports = {n: measured[n] for n in job.now.active if n in measured}
        usable = list(reports.values())
        if not usable or not job.now.quorum():
            missing = tuple(n for n in job.now.nodes if n not in reports)
            no_energy = bool(missing) and set(missing) <= set(blind)
            return Outcome("no_energy" if no_energy else "timeout", nodes=missing)
        if any(r["nonfinite_loss"] for r in usable):
            return Outcome("nonfinite_loss", reports)
        if any(r.get("xid_errors") for r in usable):
            return Outcome("xid", reports)
        value = self.score(usable)
        noise = score_noise(usable, self.config.objective, len(self.config.nodes))
        return Outcome("ok" if value is not None else "infeasible", reports, value, noise)


@dataclass
class Run:
    """One run of the trial in play: its settings under ``version``, and what came back."""

    trial: int
    phase: lifecycle.Phase
    settings: dict[str, Any]
    version: int
    plan: MeasurementPlan
    began: float
    deadline: float
    measuring: bool = False
    """Every active node acked: the agents settle and measure until ``deadline``."""
    acks: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    reports: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    partials: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def took_report(self, node: str, message: Mapping[str, Any]) -> None:
        """A node's report of this run: its job stalled, a partial one, or its final one."""
        if message.get("stalled") is True:
            self.partials.pop(node, None)
            self.reports[node] = message
        else:
            table = self.partials if message.get("partial") else self.reports
            table[node] = message

    def record(self, now: float, outcome: Outcome) -> TrialRecord:
        """The run's record, ended at ``now`` with ``outcome``."""
        return TrialRecord(
            self.trial,
            self.version,
            self.settings,
            outcome.score,
            outcome.status,
            {n: dict(r) for n, r in outcome.reports.items()},
            now - self.began,
            outcome.noise,
            confirmation=self.phase == "confirm",
            acks={n: dict(a) for n, a in self.acks.items()},
            nodes=outcome.nodes,
            errors=outcome.errors,
            verdict=outcome.verdict,
        )

    def renumber(self, version: int) -> None:
        """The same settings went out again as ``version``: what came back counts no more."""
        self.version = version
        self.acks.clear()
        self.reports.clear()
        self.partials.clear()

    def step(self, now: float, job: Membership, judge: Judge) -> RunStep:
        """Whether the run is over at ``now``: its acks in (or their deadline), its
        measurements in (or theirs, or an early abort), or its windows judged."""
        active = set(job.active)
        look = _Members(job)
        stopped = None
        if not self.measuring:
            if not active <= set(self.acks) and now < self.deadline:
                return RunStep(None, job)
            outcome = judge.acks_outcome(self, look)
            if outcome is None:
                self.measuring = True
                self.deadline = now + judge.config.trial_timeout_s
        elif (
            active <= set(self.reports)
            or now >= self.deadline
            or judge.should_abort(self, job.active)
        ):
            outcome = judge.measured_outcome(self, look)
        else:
            outcome = judge.early(self, job.active)
            if outcome is None:
                return RunStep(None, job)
            stopped = judge.stopped_text(self, outcome)
        return RunStep(outcome, look.now, tuple(look.changes), stopped)


def measurement_plan(
    plan: TrialPlanSection,
    current: Mapping[str, Any],
    settings: Mapping[str, Any],
    cap_latency_s: float | None,
) -> MeasurementPlan:
    """The agents' plan for measuring ``settings`` after ``current``: a changed power cap
    settles for the agents' measured cap latency plus NVML's averaging window (3 windows
    when no latency was measured yet), or the plan's settling time if longer."""
    settle_s = plan.settle_s
    if current.get("power_cap_w") != settings.get("power_cap_w"):
        cap_settle = (
            3 * POWER_AVERAGING_WINDOW_S
            if cap_latency_s is None
            else cap_latency_s + POWER_AVERAGING_WINDOW_S
        )
        settle_s = max(settle_s, cap_settle)
    return MeasurementPlan(
        plan.settle_steps,
        settle_s,
        plan.measure_steps,
        plan.measure_s,
        plan.windows,
        plan.target_rel_se,
        plan.max_windows,
    )
