"""The trial in play and the settings channel it runs over. Pure.

:class:`Runner` publishes a job's settings under versions that only go up (above any version
an agent already applies: a jump), keeps the version in play and who acked it, starts each
trial's :class:`~hyperagent.tuner.trialrun.Run` (its settings asked of the tuner, or given:
a confirmation, a retry), feeds the run the acks and reports of its version, and ends it
with its :class:`~hyperagent.tuner.jobstate.TrialRecord`. What the nodes send changes the
job's membership (a node answered, stalled, did not ack or measure): each call takes the
membership and hands back the new one with its changes, in order (:class:`Taken`).
:class:`~hyperagent.tuner.tuning.JobTuning` records an ended trial and moves the lifecycle on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyperagent.config import JobTuningSection
from hyperagent.tuner import lifecycle
from hyperagent.tuner.events import Ask, Asked, Effect, Journal, Publish, Say
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.lifecycle import TRIALS
from hyperagent.tuner.membership import Answered, Change, Membership, Stalled, step
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.trial import MeasurementPlan
from hyperagent.tuner.trialrun import Judge, Run, measurement_plan


@dataclass(frozen=True)
class Taken:
    """What the runner made of what came in: the job's membership after it and the changes
    to it, effects to carry out (a jump's publish), the line of a trial stopped early, and
    the run's record once it ended."""

    members: Membership
    changes: tuple[Change, ...] = ()
    effects: tuple[Effect, ...] = ()
    stopped: str | None = None
    record: TrialRecord | None = None


class Runner:
    """A job's settings versions and the run of its trial in play."""

    def __init__(self, job: str, version: int = 0) -> None:
        self.job = job
        self.version = version
        """The last version published or seen: the next goes above it."""
        self.current: dict[str, Any] = {}
        """The settings last published."""
        self.published: Publish | None = None
        """The version in play: only its acks and reports count."""
        self.published_at = 0.0
        self.acks: dict[int, dict[str, Mapping[str, Any]]] = {}
        """The acks of the version in play (only), by node."""
        self.cap_latency_s: float | None = None
        """The slowest power-cap latency an agent measured."""
        self.run: Run | None = None
        self.retrying: dict[str, Any] | None = None
        """The settings of the run a pause will retry."""
        self.trial_started: float | None = None
        """When the running trial's settings went out (on the event's clock)."""
        self.asking: int | None = None
        """The token of the tuner's answer the next run waits for."""
        self._tokens = 0
        self.last_errors: dict[str, str] = {}
        """What the refusing nodes of the last run said."""
        self.last_version = 0
        """The version of the last run."""

    def publish(
        self,
        settings: dict[str, Any],
        plan: MeasurementPlan | None,
        trial: int | None,
        nodes: tuple[str, ...],
        at: float,
    ) -> list[Effect]:
        """Journal, then publish ``settings`` to ``nodes`` under the next version (``plan``
        None: apply without measuring), at ``at`` on the coordinator's clock."""
        self.version += 1
        self.current = dict(settings)
        publish = Publish(self.version, dict(settings), plan, trial, nodes)
        self.published = publish
        self.published_at = at
        self.acks = {self.version: {}}
        entry = {"type": "published", "version": self.version, "trial": trial, "settings": settings}
        return [Journal(entry), publish]

    def in_play(self, version: int) -> bool:
        return self.published is not None and version == self.published.version

    def settled(self, active: tuple[str, ...], now: float, ack_timeout_s: float) -> bool:
        """The version in play acked by every node in ``active``, or its ack deadline passed."""
        published = self.published
        if published is None:
            return True
        if set(active) <= set(self.acks.get(published.version, {})):
            return True
        return now - self.published_at >= ack_timeout_s

    def start(
        self,
        trial: lifecycle.Trial,
        settings: dict[str, Any] | None,
        tuner: Tuner | None,
        config: JobTuningSection,
        at: float,
        now: float,
    ) -> list[Effect]:
        """Run ``trial`` with ``settings`` from ``now``; None: ask ``tuner`` for them first."""
        if settings is None:
            assert tuner is not None
            self._tokens += 1
            self.asking = self._tokens
            return [Ask(self._tokens, tuner)]
        return self._launch(trial, settings, config, at, now)

    def asked(
        self, event: Asked, state: lifecycle.State, config: JobTuningSection, at: float
    ) -> list[Effect]:
        """The tuner's answer: run the trial in play with it (if it still waits for it)."""
        if event.token != self.asking or not isinstance(state, lifecycle.Trial):
            return []
        self.asking = None
        return self._launch(state, dict(event.settings), config, at, event.now)

    def _launch(
        self,
        trial: lifecycle.Trial,
        settings: dict[str, Any],
        config: JobTuningSection,
        at: float,
        now: float,
    ) -> list[Effect]:
        self.retrying = settings
        plan = measurement_plan(config.plan, self.current, settings, self.cap_latency_s)
        out = self.publish(settings, plan, trial.trial, tuple(config.nodes), at)
        self.trial_started = now
        deadline = now + config.ack_timeout_s
        self.run = Run(trial.trial, trial.phase, settings, self.version, plan, now, deadline)
        return out

    def stop(self) -> None:
        """The job ended or failed: no run, no answer awaited."""
        self.run = None
        self.asking = None
        self.trial_started = None

    def ack(
        self, now: float, at: float, message: Mapping[str, Any], job: Membership, judge: Judge
    ) -> Taken:
        """A node's ack (or refusal) of a version: counted when it is the version in play;
        an agent that applies a newer version already makes the same settings go out again
        above it."""
        node, version = str(message["node"]), int(message["version"])
        if node not in job.nodes or not self.in_play(version):
            return Taken(job)
        applied = message.get("applied") or {}
        latency = applied.get("power_cap_latency_s")
        if isinstance(latency, int | float) and 0 <= latency < 60:
            self.cap_latency_s = max(self.cap_latency_s or 0.0, float(latency))
        newer = applied.get("version")
        if not message["ok"] and isinstance(newer, int) and newer >= version:
            return Taken(job, effects=tuple(self._jump(newer, at)))
        self.acks.setdefault(version, {})[node] = message
        answer = Stalled(node, version) if message.get("stalled") is True else None
        job, changes = step(job, answer or Answered(node, "its ack"))
        run = self.run
        if run is None or run.version != message["version"]:
            return Taken(job, tuple(changes))
        run.acks[node] = message
        return self._look(now, job, judge, changes)

    def _jump(self, applied: int, at: float) -> list[Effect]:
        """Agents apply a version this coordinator did not know of (its journal lost, or
        retained settings not seen yet): publish the same again above it."""
        published = self.published
        if published is None or applied < published.version:
            return []
        self.version = max(self.version, applied)
        text = f"{self.job}: agents apply v{applied} already; publishing again above it"
        run = self.run
        out: list[Effect] = [Say(logging.WARNING, text)]
        out += self.publish(
            published.settings, published.plan, published.trial, published.nodes, at
        )
        if run is not None:
            run.renumber(self.version)
        return out

    def report(
        self, now: float, message: Mapping[str, Any], job: Membership, judge: Judge
    ) -> Taken:
        """A node's measurement of the version in play (partial, final, or its job stalled)."""
        node, version = str(message["node"]), int(message["version"])
        if node not in job.nodes or not self.in_play(version):
            return Taken(job)
        answer = Stalled(node, version) if message.get("stalled") is True else None
        job, changes = step(job, answer or Answered(node, "its report"))
        if self.run is not None:
            self.run.took_report(node, message)
        return self._look(now, job, judge, changes)

    def look(self, now: float, job: Membership, judge: Judge) -> Taken:
        """Whether the run in play is over at ``now`` (:meth:`.trialrun.Run.step`)."""
        return self._look(now, job, judge, [])

    def _look(self, now: float, job: Membership, judge: Judge, changes: list[Change]) -> Taken:
        run = self.run
        if run is None:
            return Taken(job, tuple(changes))
        looked = run.step(now, job, judge)
        changes += looked.changes
        if looked.outcome is None:
            return Taken(looked.members, tuple(changes))
        self.run = None
        self.trial_started = None
        record = run.record(now, looked.outcome)
        self.last_errors = looked.outcome.errors
        self.last_version = run.version
        if record.status in TRIALS:
            self.retrying = None
        return Taken(looked.members, tuple(changes), stopped=looked.stopped, record=record)
