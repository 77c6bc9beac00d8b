"""One job's tuning as a pure machine: events in, effects out (as etcd's raft ``Step``/``Ready``).

:class:`JobTuning` is the glue of the job's parts: its lifecycle
(:mod:`~hyperagent.tuner.lifecycle`), its node membership (:mod:`~hyperagent.tuner.membership`),
the run of the trial in play and its outcome (:mod:`~hyperagent.tuner.trialrun`), the round's
tuner, trials and best (:mod:`~hyperagent.tuner.rounds`), the confirmations after the search
(:mod:`~hyperagent.tuner.confirm`), the drift watch once tuned (:mod:`~hyperagent.tuner.drift`)
and the resume from the journal (:mod:`~hyperagent.tuner.resume`). It never reads a clock,
sleeps or touches the network or the disk: time comes in every event (the coordinator's clock
of time connected to the broker, so that an outage pauses a trial rather than failing it), and
what is to be done comes out as effects (:mod:`~hyperagent.tuner.events`), which the
coordinator carries out in order (journal before publish). :meth:`JobTuning.wake_at` says when
it next needs a :class:`Tick`. A restarted coordinator rebuilds the machine from the journal,
which holds everything resuming needs.

The trial protocol: ask -> journal + publish settings v -> every active node acks v -> the
agents settle and measure (partial reports after each window) -> every active node reports
v, or the trial aborts early below ``abort_below`` x the baseline, or (``early_stop``) a search
trial's windows so far are clearly worse or better than the incumbent's (the best trial so far,
:mod:`~hyperagent.tuner.early`) and it stops there -> score -> journal -> tell.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from hyperagent.config import JobTuningSection
from hyperagent.tuner import drift, lifecycle
from hyperagent.tuner import membership as members
from hyperagent.tuner.confirm import CONFIRM_ROUNDS, CONFIRM_RUNS
from hyperagent.tuner.cost import Cost
from hyperagent.tuner.discovery import JobView
from hyperagent.tuner.events import (
    Ack,
    Ask,
    Asked,
    Begin,
    Effect,
    Event,
    Journal,
    Measured,
    NodeStatus,
    Publish,
    Report,
    Say,
    Seen,
    Status,
    Steps,
    Tick,
    VersionSeen,
)
from hyperagent.tuner.jobstate import Progress, TrialRecord
from hyperagent.tuner.journal import JournalState
from hyperagent.tuner.lifecycle import MEASURED, TRIALS
from hyperagent.tuner.membership import Membership
from hyperagent.tuner.notices import Notices
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.resume import replay, resumable, space_from, waits_on
from hyperagent.tuner.rounds import Round, recommendation, start_entry
from hyperagent.tuner.runner import Runner, Taken
from hyperagent.tuner.space import SearchSpace
from hyperagent.tuner.trial import Gain
from hyperagent.tuner.trialrun import Judge, Run

TrialCallback = Callable[["JobTuning", TrialRecord], None]
"""Called with the machine and each trial (or confirmation) it measured."""


def rules_of(config: JobTuningSection, backoff: lifecycle.Backoff | None = None) -> lifecycle.Rules:
    """The lifecycle's rules for a tuning of ``config``."""
    return lifecycle.Rules(
        trials=config.trials,
        confirm_best=config.confirm_best,
        confirm_runs=CONFIRM_RUNS,
        max_retries=config.max_retries,
        ranks_wait_s=config.ranks_wait_s,
        backoff=backoff or lifecycle.Backoff(),
    )


class JobTuning:
    """One job's tuning, from the moment it is found until it is tuned, ended or failed."""

    def __init__(
        self,
        job: str,
        config: JobTuningSection,
        journal: JournalState | None = None,
        now: float = 0.0,
        backoff: lifecycle.Backoff | None = None,
    ) -> None:
        """``config`` is the job's tuning as the policy resolves it before its nodes are
        known; ``journal`` what its journal held when the coordinator found the job."""
        self.job = job
        self.config = config
        self.backoff = backoff or lifecycle.Backoff()
        self.rules = rules_of(config)
        self.restored = journal or JournalState()
        self.state: lifecycle.State = lifecycle.WaitingForRanks(now)
        self.members = Membership(())
        self.space: SearchSpace | None = None
        self.round = Round()
        """The round in play: its tuner, trials, best and confirmations."""
        self.rounds = self.restored.rounds
        self.runner = Runner(job, self.restored.version)
        """The settings versions and the run of the trial in play."""
        self.say = Notices(job)
        self.start: dict[str, Any] | None = None
        self.final_version: int | None = None
        self.retries = 0
        self.recommendation: dict[str, Any] | None = None
        self.why = ""
        self.notes: tuple[str, ...] = ()
        """What narrowed the space (a node's bounds, a knob not announced), one line each."""
        self.knobs: dict[str, tuple[str, ...]] = {}
        """node -> the knobs its ranks said they apply, when the tuning began."""
        self.progress: dict[str, Progress] = {}
        self.watch = drift.DriftWatch()
        self._empty_since: float | None = None
        self._view: JobView | None = None
        self.ended_at: float | None = None
        self.clock_now = now
        """The latest time an event carried."""

    # -- what the coordinator asks -------------------------------------------------------

    @property
    def terminal(self) -> bool:
        return isinstance(self.state, lifecycle.TERMINAL)

    @property
    def done(self) -> bool:
        """Tuned (its settings out, or in recommend mode reported), ended or failed."""
        return isinstance(self.state, lifecycle.Tuned | lifecycle.Ended | lifecycle.Failed)

    @property
    def paused(self) -> lifecycle.Paused | None:
        state = self.state
        if isinstance(state, lifecycle.WaitingForQuorum):
            return state.paused
        return state if isinstance(state, lifecycle.Paused) else None

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.members.nodes

    @property
    def lost(self) -> Mapping[str, str]:
        """The nodes out of scoring, and why."""
        return self.members.out

    @property
    def version(self) -> int:
        """The last settings version published or seen: the next goes above it."""
        return self.runner.version

    @version.setter
    def version(self, version: int) -> None:
        self.runner.version = version

    @property
    def current(self) -> dict[str, Any]:
        """The settings last published."""
        return self.runner.current

    @property
    def published(self) -> Publish | None:
        return self.runner.published

    @property
    def acks(self) -> dict[int, dict[str, Mapping[str, Any]]]:
        return self.runner.acks

    @property
    def run(self) -> Run | None:
        return self.runner.run

    @property
    def trial_started(self) -> float | None:
        return self.runner.trial_started

    @property
    def tuner(self) -> Tuner | None:
        return self.round.tuner

    @property
    def trials(self) -> list[TrialRecord]:
        """The round's search trials."""
        return self.round.trials

    @property
    def confirmations(self) -> list[TrialRecord]:
        return self.round.confirmations

    @property
    def confirmed(self) -> Gain | None:
        """The confirmations' gain, once judged."""
        return self.round.confirmation.confirmed

    @property
    def best(self) -> tuple[dict[str, Any], float] | None:
        """The best settings and their score (once confirmed: the confirmed ones)."""
        return self.round.best

    @property
    def baseline(self) -> float | None:
        return self.round.baseline

    @property
    def incumbent(self) -> TrialRecord | None:
        return self.round.incumbent

    @property
    def gain(self) -> float | None:
        """Best score over the baseline, minus one (once confirmed: 0 when no setting was
        better)."""
        return self.round.gain

    def cost(self) -> Cost | None:
        """What the round's tuning cost so far (:meth:`.rounds.Round.cost`)."""
        return self.round.cost(self.config.objective, len(self.config.nodes))

    def job_throughput(self, previous: Mapping[str, Progress]) -> float | None:
        """The job's samples/s since ``previous``, in a trial score's unit
        (:func:`.drift.job_throughput`)."""
        return drift.job_throughput(self.progress, previous, self.members, len(self.config.nodes))

    def resuming_on(self, now: float) -> tuple[str, ...]:
        """The nodes a job waiting for its ranks waits for besides them: those of the
        journal's unfinished round, for ``ranks_wait_s`` (after a restart the nodes'
        telemetry comes back one by one; a job resumes where its round ran, rather than
        start over on the first nodes heard from). Empty when none."""
        state = self.state
        if not isinstance(state, lifecycle.WaitingForRanks):
            return ()
        return waits_on(self.restored, now - state.since, self.rules.ranks_wait_s)

    def wake_at(self) -> float | None:
        """When the machine needs a :class:`Tick` next (None: only events)."""
        times: list[float] = []
        state = self.state
        if self.run is not None:
            times.append(self.run.deadline)
        if isinstance(state, lifecycle.Paused):
            times.append(state.retry_at)
        elif isinstance(state, lifecycle.WaitingForRanks) and not state.said:
            times.append(state.since + self.rules.ranks_wait_s)
        elif isinstance(state, lifecycle.Tuned) and self.watch.at is not None:
            times.append(self.watch.at)
        if self._empty_since is not None and not self.terminal:
            times.append(self._empty_since + self.config.end_after_s)
        return min(times) if times else None

    def settled(self, now: float) -> bool:
        """Done, and its last settings acked by every active node (or their ack deadline
        passed): a coordinator asked to stop once the jobs are tuned stops here."""
        if not self.done:
            return False
        if self.terminal:
            return True
        return self.runner.settled(self.members.active, now, self.config.ack_timeout_s)

    def in_play(self, version: int) -> bool:
        return self.runner.in_play(version)

    # -- events --------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Effect]:
        """Take one event; returns what to do, in order."""
        out: list[Effect] = []
        self.clock_now = max(self.clock_now, getattr(event, "now", self.clock_now))
        if isinstance(event, VersionSeen):
            self.version = max(self.version, event.version)
            return out
        if self.terminal:
            return out
        if isinstance(event, Seen):
            self._seen(event, out)
        elif isinstance(event, Begin):
            self._begin(event, out)
        elif isinstance(event, Asked):
            out += self.runner.asked(event, self.state, self.config, self.clock_now)
        elif isinstance(event, Ack):
            taken = self.runner.ack(
                event.now, self.clock_now, event.message, self.members, self._judge()
            )
            self._took(event.now, taken, out)
        elif isinstance(event, Report):
            taken = self.runner.report(event.now, event.message, self.members, self._judge())
            self._took(event.now, taken, out)
        elif isinstance(event, NodeStatus):
            change = members.Online(event.node) if event.online else members.Offline(event.node)
            self._membership(change, out)
            self._progress_run(event.now, out)
            self._tick_pause(event.now, out)
        elif isinstance(event, Steps):
            before = self.progress.get(event.node)
            self.progress[event.node] = event.progress
            if before is not None and event.progress.samples > before.samples:
                self._membership(members.Answered(event.node, "its job steps"), out)
                self._tick_pause(event.now, out)
        if isinstance(event, Tick):
            self._tick(event.now, out)
        return out

    # -- discovery -----------------------------------------------------------------------

    def _seen(self, event: Seen, out: list[Effect]) -> None:
        view = event.view
        self._view = view
        if view.attached > 0:
            self._empty_since = None
        elif self._empty_since is None:
            self._empty_since = event.now
        for node in self.members.nodes:
            change = members.Rejoined(node) if node in view.nodes else members.Left(node)
            self._membership(change, out)
        self._tick(event.now, out)

    def _begin(self, event: Begin, out: list[Effect]) -> None:
        """Every rank is attached: resume the journal's round, or start one."""
        if not isinstance(self.state, lifecycle.WaitingForRanks):
            return
        cfg = self.config = event.config
        self.rules = rules_of(cfg, self.backoff)
        self.members = Membership.of(cfg.nodes, {n: "offline" for n in event.offline})
        view = self._view
        if view is not None:
            self.knobs = {n: s.knobs for n, s in view.sightings.items() if s.knobs is not None}
        self.notes = event.plan.notes
        for note in event.plan.notes:
            out.append(self.say.line(logging.INFO, note))
        if event.plan.failure is not None or event.plan.space is None:
            self._advance(lifecycle.Fail(event.plan.failure or "no search space"), out)
            return
        space = event.plan.space
        self.start = space.snap(event.start)
        journal = self.restored
        resume = None
        if resumable(journal, space, cfg):
            space = space_from(journal.start["space"]) if journal.start else space
            resumed = replay(journal, space, cfg, self.start, self.rules)
            self.rounds, self.round = resumed.number, resumed.round
            self.runner.retrying = resumed.retrying
            resume = (resumed.state, resumed.actions)
            out.append(self.say.resumed_round(len(journal.trials)))
        else:
            if journal.trials and journal.final is None:
                out.append(self.say.starts_over())
            self._new_round(space, out)
        self.space = space
        if cfg.mode == "recommend":
            self._recommend(out)
            self._advance(
                lifecycle.Ready(event.now, (lifecycle.Tuned(max(self.rounds, 1)), ())), out
            )
            return
        self._advance(lifecycle.Ready(event.now, resume), out)

    def _new_round(
        self, space: SearchSpace, out: list[Effect], start: dict[str, Any] | None = None
    ) -> None:
        self.rounds += 1
        runs, last_good = self.rules.confirm_runs, self.round.last_good
        self.round = Round.begin(
            space, self.config, self.rounds, start or self.start, runs, last_good
        )
        self.restored = JournalState(version=self.version)
        out.append(Journal(start_entry(self.config, space, self.rounds)))

    def _recommend(self, out: list[Effect]) -> None:
        assert self.space is not None and self.start is not None
        final = self.restored.final
        self.recommendation, self.why = recommendation(self.space, self.start, self.config, final)
        out += self.say.recommending(self.recommendation, self.why)

    # -- the lifecycle -------------------------------------------------------------------

    def _advance(self, event: lifecycle.Event, out: list[Effect]) -> None:
        before = self.state
        self.state, actions = lifecycle.advance(self.state, event, self.rules)
        quiet = (
            isinstance(before, lifecycle.Trial)
            and before.retrying is not None
            and not any(isinstance(a, lifecycle.Pause) for a in actions)
        )
        for action in actions:
            self._act(action, quiet, out)
        if (
            isinstance(self.state, lifecycle.Trial)
            and self.run is None
            and self.runner.asking is None
        ):
            self._start_run(event_now(event), out)
        if isinstance(self.state, lifecycle.Tuned):
            self.watch.arm(event_now(event), self.progress)

    def _act(self, action: lifecycle.Action, quiet: bool, out: list[Effect]) -> None:
        if isinstance(action, lifecycle.SayMissing):
            out += self.say.waiting(action.missing)
        elif isinstance(action, lifecycle.Rollback):
            self._rollback(action, quiet, out)
        elif isinstance(action, lifecycle.Pause):
            self._pause(action.paused, out)
        elif isinstance(action, lifecycle.Retry):
            self.retries += 1
        elif isinstance(action, lifecycle.Resume):
            out += self.say.resumed(action.paused)
        elif isinstance(action, lifecycle.Confirm):
            self._begin_confirm(out)
        elif isinstance(action, lifecycle.Finish):
            self._conclude(out)
        elif isinstance(action, lifecycle.Retune):
            out.append(self.say.retuning())
            assert self.space is not None
            self._new_round(self.space, out, start=self.best[0] if self.best else None)
            self.watch.disarm()
        elif isinstance(action, lifecycle.Stop):
            self.runner.stop()
            failed = isinstance(self.state, lifecycle.Failed)
            out.append(Journal({"type": "ended", "reason": action.reason, "failed": failed}))
            out += self.say.ended(action.reason, failed)

    def _rollback(self, action: lifecycle.Rollback, quiet: bool, out: list[Effect]) -> None:
        good = self.round.last_good or self._first_settings()
        missing = self._view.missing if self._view is not None else ""
        # a rank died: the job is over or restarting; nothing to roll back on it
        gone = missing or ("no rank attached" if self._empty_since is not None else "")
        out.append(self.say.rollback(action.why, good, gone, quiet))
        if not gone:
            out += self.runner.publish(good, None, None, self.nodes, self.clock_now)

    def _pause(self, paused: lifecycle.Paused, out: list[Effect]) -> None:
        errors = self.runner.last_errors
        entry = {
            "type": "paused",
            "trial": paused.trial,
            "version": self.runner.last_version,
            "reason": paused.reason,
            "nodes": list(paused.nodes),
            "errors": errors,
        }
        out.append(Journal(entry))
        out += self.say.paused(paused, errors, self.backoff.delay_s(paused.attempt))

    def _tick(self, now: float, out: list[Effect]) -> None:
        if self.terminal:
            return
        if self._empty_since is not None and now - self._empty_since >= self.config.end_after_s:
            self.ended_at = now
            self._advance(lifecycle.Left(now), out)
            return
        state = self.state
        if isinstance(state, lifecycle.WaitingForRanks):
            view = self._view
            missing = view.missing if view is not None else "its ranks"
            self._advance(lifecycle.RanksTick(now, missing or "its ranks"), out)
        elif self.run is not None:
            self._progress_run(now, out)
        elif isinstance(state, lifecycle.Paused | lifecycle.WaitingForQuorum):
            self._tick_pause(now, out)
        elif isinstance(state, lifecycle.Tuned):
            self._watch(now, out)

    def _tick_pause(self, now: float, out: list[Effect]) -> None:
        if isinstance(self.state, lifecycle.Paused | lifecycle.WaitingForQuorum):
            before = self.state
            self._advance(lifecycle.Tick(now, self.members.quorum()), out)
            if (
                isinstance(before, lifecycle.Paused)
                and isinstance(self.state, lifecycle.WaitingForQuorum)
                and before.attempt == 0
            ):
                out += self.say.quorum_lost(self.members.out)

    def _watch(self, now: float, out: list[Effect]) -> None:
        tuned = self.best[1] if self.best is not None else None
        reading = self.watch.check(now, self.progress, self.members, self.config, tuned)
        if reading is None:
            return
        if reading.below:
            out.append(self.say.line(logging.DEBUG, reading.describe()))
        self._advance(lifecycle.Drift(now, reading.below, self.config.drift_sustained_s), out)

    # -- runs ----------------------------------------------------------------------------

    def _start_run(self, now: float, out: list[Effect]) -> None:
        state = self.state
        assert isinstance(state, lifecycle.Trial)
        settings: dict[str, Any] | None
        if state.phase == "confirm":
            settings = self.round.confirmation.settings(state.trial - state.confirm_from)
        else:
            settings = self.runner.retrying
        out += self.runner.start(state, settings, self.tuner, self.config, self.clock_now, now)

    def _judge(self) -> Judge:
        return Judge(self.config, self.round.baseline, self.round.incumbent)

    def _membership(self, event: members.Event, out: list[Effect]) -> None:
        self.members, changes = members.step(self.members, event)
        out += self.say.changes(changes)

    def _progress_run(self, now: float, out: list[Effect]) -> None:
        """See whether the run in play is over, and end it."""
        self._took(now, self.runner.look(now, self.members, self._judge()), out)

    def _took(self, now: float, taken: Taken, out: list[Effect]) -> None:
        """Carry out what the runner made of an event; record the run it ended."""
        out += taken.effects
        self.members = taken.members
        out += self.say.changes(taken.changes)
        if taken.stopped is not None:
            out.append(self.say.line(logging.INFO, taken.stopped))
        record = taken.record
        if record is None:
            return
        if record.status in TRIALS:
            out.append(Journal(record.to_journal()))
            self.round.add(record)
            out.append(Measured(record))
            if record.confirmation:
                done, budget = len(self.confirmations), self.rules.confirm_runs
            else:
                done, budget = len(self.trials), self.config.trials
            out.append(self.say.progress(record.confirmation, done, budget, self.best))
        event = lifecycle.RunEnded(
            record.status,
            now,
            record.nodes,
            converged=not record.confirmation and self.round.converged(self.config.patience),
            candidate=self._to_confirm() is not None,
        )
        self._advance(event, out)

    def _first_settings(self) -> dict[str, Any]:
        return self.round.first_settings(self.start, self.space)

    # -- confirmations and the end -------------------------------------------------------

    def _to_confirm(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return self.round.to_confirm(self._first_settings())

    def _begin_confirm(self, out: list[Effect]) -> None:
        state = self.state
        assert isinstance(state, lifecycle.Trial)
        order = self.round.plan_confirmations(self._first_settings())
        if order is not None:
            out.append(Journal({"type": "confirm", "from": state.confirm_from, "order": order}))

    def _conclude(self, out: list[Effect]) -> None:
        """The round's end: judge the confirmations (if any), publish the final settings."""
        tuned, cfg = self.round, self.config
        judged, final = tuned.conclude(self._first_settings(), cfg.objective, len(cfg.nodes))
        if judged is not None:
            level = logging.INFO if judged.gain is not None else logging.WARNING
            out.append(self.say.line(level, judged.text))
        out += self.runner.publish(final, None, None, self.nodes, self.clock_now)
        self.final_version = self.version
        if not tuned.final_journalled:
            tuned.final_journalled = True
            spent = self.cost()
            out.append(Journal(tuned.final_entry(self.final_version, final, spent)))
            score = tuned.best[1] if tuned.best else None
            out.append(self.say.tuned(final, score, self.gain, spent))
        tuned.last_good = final
        out.append(self.say.status("tuned"))


def event_now(event: lifecycle.Event) -> float:
    """The time an event carries (0 for one without)."""
    return float(getattr(event, "now", 0.0))


__all__ = [
    "CONFIRM_ROUNDS",
    "MEASURED",
    "Ack",
    "Ask",
    "Asked",
    "Begin",
    "Effect",
    "Event",
    "JobTuning",
    "Journal",
    "Measured",
    "NodeStatus",
    "Publish",
    "Report",
    "Say",
    "Seen",
    "Status",
    "Steps",
    "Tick",
    "TrialCallback",
    "VersionSeen",
]
