"""One job's tuning as a pure machine: events in, effects out (as etcd's raft ``Step``/``Ready``).

:class:`JobTuning` composes the job's lifecycle (:mod:`~hyperagent.tuner.lifecycle`), its node
membership (:mod:`~hyperagent.tuner.membership`), the run of the trial in play (which acks and
reports came back for its version, its deadlines), the tuner and the journal's records. It
never reads a clock, sleeps or touches the network or the disk: time comes in every event
(the coordinator's clock of time connected to the broker, so that an outage pauses a trial
rather than failing it), and what is to be done comes out as effects, which the coordinator
carries out in order (journal before publish). :meth:`JobTuning.wake_at` says when it next
needs a :class:`Tick`. A restarted coordinator rebuilds the machine from the journal
(:meth:`JobTuning.resume`), which holds everything resuming needs.

The trial protocol: ask -> journal + publish settings v -> every active node acks v -> the
agents settle and measure (partial reports after each window) -> every active node reports
v, or the trial aborts early below ``abort_below`` x the baseline, or (``early_stop``) a search
trial's windows so far are clearly worse or better than the incumbent's (the best trial so far,
:mod:`~hyperagent.tuner.early`) and it stops there -> score -> journal -> tell.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hyperagent.config import JobTuningSection
from hyperagent.tuner import lifecycle
from hyperagent.tuner import membership as members
from hyperagent.tuner.cost import Cost, round_cost
from hyperagent.tuner.discovery import JobView, SpacePlan, fingerprint
from hyperagent.tuner.early import EarlyStop, Verdict, told
from hyperagent.tuner.jobstate import Progress, TrialRecord
from hyperagent.tuner.journal import JournalState
from hyperagent.tuner.lifecycle import MEASURED, NOT_TRIALS, TRIALS
from hyperagent.tuner.membership import Membership
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import SearchSpace
from hyperagent.tuner.trial import (
    Gain,
    MeasurementPlan,
    compare,
    score,
    score_noise,
    trial_samples,
    window_scores,
)

POWER_AVERAGING_WINDOW_S = 1.0
"""NVML averages board power over about a second; a power change settles for 3x that."""

CONFIRM_ROUNDS = 2
"""After the search, the start and the best settings are each measured this many times more,
interleaved (start, best, best, start), and compared on those measurements."""

DRIFT_CHECK_S = 10.0
"""How often a tuned job's throughput is compared with its tuned score."""

SETTINGS_REFUSALS = frozenset({"settings"})
"""Refusal kinds that are facts about the settings (outside a node's bounds, capping off)."""


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """Time passed: ``now``."""

    now: float


@dataclass(frozen=True)
class Seen:
    """The agents' picture of the job changed (ranks attached or left, nodes)."""

    now: float
    view: JobView


@dataclass(frozen=True)
class Begin:
    """Every rank is attached: the job's tuning (nodes resolved), its space and its start."""

    now: float
    config: JobTuningSection
    plan: SpacePlan
    start: Mapping[str, Any]
    """The starting settings (the config's, or a finished tuning's of the same
    fingerprint)."""
    offline: frozenset[str] = frozenset()
    """Nodes whose status said offline before the tuning began."""


@dataclass(frozen=True)
class Ack:
    """A node's ack (or refusal) of a version, already checked as coming from it."""

    now: float
    message: Mapping[str, Any]


@dataclass(frozen=True)
class Report:
    """A node's measurement (``partial`` after each window, ``stalled`` when its job stopped)."""

    now: float
    message: Mapping[str, Any]


@dataclass(frozen=True)
class NodeStatus:
    now: float
    node: str
    online: bool


@dataclass(frozen=True)
class Steps:
    """A node's running totals of the job, from its telemetry."""

    now: float
    node: str
    progress: Progress


@dataclass(frozen=True)
class Asked:
    """The tuner's answer to :class:`Ask` number ``token``."""

    now: float
    token: int
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class VersionSeen:
    """A settings version of this job exists (retained on the broker, or applied by an
    agent): versions continue above it."""

    version: int


Event = Tick | Seen | Begin | Ack | Report | NodeStatus | Steps | Asked | VersionSeen


# -- effects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publish:
    """Sign and publish settings ``version`` (retained) to ``nodes``; ``plan`` None: apply
    without measuring (a rollback, the final settings)."""

    version: int
    settings: dict[str, Any]
    plan: MeasurementPlan | None
    trial: int | None
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Journal:
    """Append ``entry`` to the job's journal (before any later Publish leaves)."""

    entry: dict[str, Any]


@dataclass(frozen=True)
class Ask:
    """Ask the tuner for the next settings (it may fit a model: off the event loop), then
    hand them back as :class:`Asked` with ``token``."""

    token: int
    tuner: Tuner


@dataclass(frozen=True)
class Say:
    """One log line."""

    level: int
    text: str


@dataclass(frozen=True)
class Status:
    """The service's status line for this job."""

    text: str


@dataclass(frozen=True)
class Measured:
    """A trial (or a confirmation) was measured and recorded."""

    record: TrialRecord


Effect = Publish | Journal | Ask | Say | Status | Measured


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


STOPPED_EARLY = "stopped_early"
"""The status of a search trial whose measurement stopped once its windows were judged."""


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
        self.rules = self._rules(config)
        self.restored = journal or JournalState()
        self.state: lifecycle.State = lifecycle.WaitingForRanks(now)
        self.members = Membership(())
        self.space: SearchSpace | None = None
        self.tuner: Tuner | None = None
        self.version = self.restored.version
        self.trials: list[TrialRecord] = []
        self.confirmations: list[TrialRecord] = []
        self.confirm_order: list[dict[str, Any]] = []
        self.confirmed: Gain | None = None
        self.baseline: float | None = None
        self.best: tuple[dict[str, Any], float] | None = None
        self.incumbent: TrialRecord | None = None
        """The best search trial so far, whose windows an early judgement compares with."""
        self.last_good: dict[str, Any] | None = None
        self.start: dict[str, Any] | None = None
        self.current: dict[str, Any] = {}
        """The settings last published."""
        self.published: Publish | None = None
        """The version in play: only its acks and reports count."""
        self.published_at = 0.0
        self.acks: dict[int, dict[str, Mapping[str, Any]]] = {}
        """The acks of the version in play (only), by node."""
        self.run: Run | None = None
        self.retrying: dict[str, Any] | None = None
        """The settings of the run a pause will retry."""
        self.final_version: int | None = None
        self.final_journalled = False
        self.rounds = self.restored.rounds
        self.retries = 0
        self.recommendation: dict[str, Any] | None = None
        self.why = ""
        self.notes: tuple[str, ...] = ()
        self._cost: tuple[tuple[int, int, int, bool], Cost | None] | None = None
        """What narrowed the space (a node's bounds, a knob not announced), one line each."""
        self.knobs: dict[str, tuple[str, ...]] = {}
        """node -> the knobs its ranks said they apply, when the tuning began."""
        self.cap_latency_s: float | None = None
        self.progress: dict[str, Progress] = {}
        self._drift_from: dict[str, Progress] = {}
        self._drift_at: float | None = None
        self._empty_since: float | None = None
        self._view: JobView | None = None
        self._asking: int | None = None
        self._tokens = 0
        self.ended_at: float | None = None
        self.trial_started: float | None = None
        """When the running trial's settings went out (on the event's clock)."""
        self.clock_now = now
        """The latest time an event carried."""
        self._last_errors: dict[str, str] = {}
        self._last_version = 0
        """What the refusing nodes of the last run said."""

    @staticmethod
    def _rules(
        config: JobTuningSection, backoff: lifecycle.Backoff | None = None
    ) -> lifecycle.Rules:
        return lifecycle.Rules(
            trials=config.trials,
            confirm_best=config.confirm_best,
            confirm_runs=2 * CONFIRM_ROUNDS,
            max_retries=config.max_retries,
            ranks_wait_s=config.ranks_wait_s,
            backoff=backoff or lifecycle.Backoff(),
        )

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
    def gain(self) -> float | None:
        """Best score over the baseline, minus one (once confirmed: 0 when no setting was
        better)."""
        if self.confirmed is not None:
            return self.confirmed.value if self.confirmed.better else 0.0
        if self.best is None or not self.baseline:
            return None
        return self.best[1] / self.baseline - 1

    def resuming_on(self, now: float) -> tuple[str, ...]:
        """The nodes a job waiting for its ranks waits for besides them: those of the
        journal's unfinished round, for ``ranks_wait_s`` (after a restart the nodes'
        telemetry comes back one by one; a job resumes where its round ran, rather than
        start over on the first nodes heard from). Empty when none."""
        state = self.state
        start = self.restored.start
        if (
            not isinstance(state, lifecycle.WaitingForRanks)
            or start is None
            or now - state.since >= self.rules.ranks_wait_s
        ):
            return ()
        nodes = start.get("nodes")
        return tuple(n for n in nodes if isinstance(n, str)) if isinstance(nodes, list) else ()

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
        elif isinstance(state, lifecycle.Tuned) and self._drift_at is not None:
            times.append(self._drift_at)
        if self._empty_since is not None and not self.terminal:
            times.append(self._empty_since + self.config.end_after_s)
        return min(times) if times else None

    def settled(self, now: float) -> bool:
        """Done, and its last settings acked by every active node (or their ack deadline
        passed): a coordinator asked to stop once the jobs are tuned stops here."""
        if not self.done:
            return False
        published = self.published
        if self.terminal or published is None:
            return True
        acked = self.acks.get(published.version, {})
        if set(self.members.active) <= set(acked):
            return True
        return now - self.published_at >= self.config.ack_timeout_s

    def in_play(self, version: int) -> bool:
        return self.published is not None and version == self.published.version

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
            self._asked(event, out)
        elif isinstance(event, Ack):
            self._ack(event, out)
        elif isinstance(event, Report):
            self._report(event, out)
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
        self.rules = self._rules(cfg, self.backoff)
        self.members = Membership.of(cfg.nodes, {n: "offline" for n in event.offline})
        view = self._view
        if view is not None:
            self.knobs = {n: s.knobs for n, s in view.sightings.items() if s.knobs is not None}
        self.notes = event.plan.notes
        for note in event.plan.notes:
            out.append(Say(logging.INFO, f"{self.job}: {note}"))
        if event.plan.failure is not None or event.plan.space is None:
            self._advance(lifecycle.Fail(event.plan.failure or "no search space"), out)
            return
        space = event.plan.space
        self.start = space.snap(event.start)
        journal = self.restored
        resume = None
        if self._resumable(journal, space, cfg):
            space = _space_from(journal.start["space"]) if journal.start else space
            resume = self._replay(journal, space)
            out.append(Say(logging.INFO, f"{self.job}: resumed {len(journal.trials)} trials"))
        else:
            if journal.trials and journal.final is None:
                out.append(
                    Say(
                        logging.WARNING,
                        f"{self.job}: the journal's round does not fit this job's space "
                        "(objective, power limits, knobs or nodes changed); the tuning starts over",
                    )
                )
            self._new_round(space, out)
        self.space = space
        if cfg.mode == "recommend":
            self._recommend(out)
            self._advance(
                lifecycle.Ready(event.now, (lifecycle.Tuned(max(self.rounds, 1)), ())), out
            )
            return
        self._advance(lifecycle.Ready(event.now, resume), out)

    def _resumable(self, journal: JournalState, space: SearchSpace, cfg: JobTuningSection) -> bool:
        start = journal.start
        if start is None or (not journal.trials and journal.final is None):
            return False
        if start.get("fingerprint") != fingerprint(cfg) or "space" not in start:
            return False
        try:
            saved = _space_from(start["space"])
        except (TypeError, ValueError):
            return False
        if saved != space:
            return False
        if any(t["status"] in NOT_TRIALS for t in journal.trials):
            return False
        return all(saved.contains(t["settings"]) for t in journal.trials)

    def _new_round(
        self, space: SearchSpace, out: list[Effect], start: dict[str, Any] | None = None
    ) -> None:
        cfg = self.config
        self.rounds += 1
        self.tuner = Tuner(
            space,
            seed=cfg.seed + self.rounds - 1,
            start=start or self.start,
            objective=cfg.objective,
        )
        self.trials, self.confirmations, self.confirm_order = [], [], []
        self.best = self.baseline = self.confirmed = None
        self.incumbent = None
        self.final_journalled = False
        self.restored = JournalState(version=self.version)
        out.append(
            Journal(
                {
                    "type": "start",
                    "fingerprint": fingerprint(cfg),
                    "space": dataclasses.asdict(space),
                    "nodes": list(cfg.nodes),
                    "round": self.rounds,
                }
            )
        )

    def _replay(
        self, journal: JournalState, space: SearchSpace
    ) -> tuple[lifecycle.State, tuple[lifecycle.Action, ...]]:
        """Bring the tuner and the running best up to what the journal says happened, and the
        state it says the round is in."""
        cfg = self.config
        self.rounds = max(journal.rounds, 1)
        self.tuner = Tuner(
            space, seed=cfg.seed + self.rounds - 1, start=self.start, objective=cfg.objective
        )
        for entry in journal.trials:
            record = TrialRecord.from_journal(entry)
            if record.confirmation:
                self.confirmations.append(record)
            else:
                self._record(record)
        if journal.confirm is not None:
            self.confirm_order = [dict(s) for s in journal.confirm["order"]]
        final = journal.final is not None and journal.measured
        if final and journal.final is not None:
            self.best = (journal.final["settings"], journal.final["score"])
            self.baseline = journal.final.get("baseline")
            self.last_good = journal.final["settings"]
            self.final_journalled = True
        in_flight = journal.in_flight
        if in_flight is not None and in_flight.get("settings") is not None:
            self.retrying = dict(in_flight["settings"])
        facts = lifecycle.Journalled(
            round=self.rounds,
            searched=len(self.trials),
            confirm_from=None if journal.confirm is None else int(journal.confirm["from"]),
            confirmed=len(self.confirmations),
            final=final,
            converged=self._converged(),
            candidate=self._confirm_pair() is not None,
        )
        state, actions = lifecycle.resumed(facts, self.rules)
        return state, tuple(actions)

    def _recommend(self, out: list[Effect]) -> None:
        assert self.space is not None and self.start is not None
        if self.restored.final is not None:
            self.recommendation = self.restored.final["settings"]
            self.why = "the last finished tuning of this job"
        else:
            nodes = len(self.config.nodes)
            table = self.space.recommended(nodes, self.start)
            self.recommendation = table
            self.why = (
                f"BACKGROUND.md's table for {nodes} nodes on {self.config.backend} "
                f"({table.get('allreduce')}, {table.get('chunk_kb')} KiB chunks, "
                f"{table['bucket_mb']} MiB buckets) over the starting settings; "
                "no measurement yet"
            )
        out.append(
            Say(logging.INFO, f"{self.job}: recommend {self.recommendation} because {self.why}")
        )
        out.append(Status(f"{self.job}: recommending {self.recommendation}"))

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
        if isinstance(self.state, lifecycle.Trial) and self.run is None and self._asking is None:
            self._start_run(event_now(event), out)
        if isinstance(self.state, lifecycle.Tuned) and self._drift_at is None:
            self._drift_at = event_now(event) + DRIFT_CHECK_S
            self._drift_from = dict(self.progress)

    def _act(self, action: lifecycle.Action, quiet: bool, out: list[Effect]) -> None:
        job = self.job
        if isinstance(action, lifecycle.SayMissing):
            out.append(Say(logging.WARNING, f"{job}: waiting for {action.missing}"))
            out.append(Status(f"{job}: waiting for {action.missing}"))
        elif isinstance(action, lifecycle.Rollback):
            good = self.last_good or self._first_settings()
            level = logging.DEBUG if quiet else logging.WARNING
            missing = self._view.missing if self._view is not None else ""
            if missing or self._empty_since is not None:
                # a rank died: the job is over or restarting; nothing to roll back on it
                gone = missing or "no rank attached"
                out.append(Say(level, f"{job}: {action.why}; {gone}: not rolling back"))
                return
            out.append(Say(level, f"{job}: {action.why}; rolling back to {good}"))
            self._publish(good, None, None, out)
        elif isinstance(action, lifecycle.Pause):
            paused = action.paused
            out.append(
                Journal(
                    {
                        "type": "paused",
                        "trial": paused.trial,
                        "version": self._last_version,
                        "reason": paused.reason,
                        "nodes": list(paused.nodes),
                        "errors": self._last_errors,
                    }
                )
            )
            out.append(
                Say(
                    logging.WARNING,
                    f"{job}: paused ({paused.reason}: "
                    f"{', '.join(paused.nodes) or 'no node answered'}{self._errors_text()}); "
                    "retrying the same settings in "
                    f"{self.backoff.delay_s(paused.attempt):.0f}s, then with back-off",
                )
            )
            out.append(
                Status(f"{job}: paused, {paused.reason}: {', '.join(paused.nodes) or 'no node'}")
            )
        elif isinstance(action, lifecycle.Retry):
            self.retries += 1
        elif isinstance(action, lifecycle.Resume):
            attempts = action.paused.attempt + 1
            out.append(
                Say(
                    logging.INFO,
                    f"{job}: resumed after {attempts} retr{'y' if attempts == 1 else 'ies'} "
                    f"({action.paused.reason})",
                )
            )
        elif isinstance(action, lifecycle.Confirm):
            self._begin_confirm(out)
        elif isinstance(action, lifecycle.Finish):
            self._conclude(out)
        elif isinstance(action, lifecycle.Retune):
            out.append(
                Say(logging.WARNING, f"{job}: throughput drifted below the tuned score; re-tuning")
            )
            assert self.space is not None
            self._new_round(self.space, out, start=self.best[0] if self.best else None)
            self._drift_at = None
        elif isinstance(action, lifecycle.Stop):
            self.run = None
            self._asking = None
            self.trial_started = None
            failed = isinstance(self.state, lifecycle.Failed)
            out.append(Journal({"type": "ended", "reason": action.reason, "failed": failed}))
            level = logging.ERROR if failed else logging.INFO
            what = "failed" if failed else "ended"
            out.append(Say(level, f"{job}: {what}: {action.reason}"))
            out.append(Status(f"{job}: {what}, {action.reason}"))

    def _errors_text(self) -> str:
        errors = self._last_errors
        return "; " + "; ".join(f"{n}: {e}" for n, e in errors.items()) if errors else ""

    def _tick(self, now: float, out: list[Effect]) -> None:
        if self.terminal:
            return
        if self._empty_since is not None and now - self._empty_since >= self.config.end_after_s:
            self.ended_at = now
            self._advance(lifecycle.Left(now), out)
            return
        state = self.state
        if isinstance(state, lifecycle.WaitingForRanks):
            self._waiting(now, out)
        elif self.run is not None:
            self._progress_run(now, out)
        elif isinstance(state, lifecycle.Paused | lifecycle.WaitingForQuorum):
            self._tick_pause(now, out)
        elif isinstance(state, lifecycle.Tuned):
            self._watch(now, out)

    def _waiting(self, now: float, out: list[Effect]) -> None:
        view = self._view
        missing = view.missing if view is not None else "its ranks"
        self._advance(lifecycle.RanksTick(now, missing or "its ranks"), out)

    def _tick_pause(self, now: float, out: list[Effect]) -> None:
        if isinstance(self.state, lifecycle.Paused | lifecycle.WaitingForQuorum):
            before = self.state
            self._advance(lifecycle.Tick(now, self.members.quorum()), out)
            if (
                isinstance(before, lifecycle.Paused)
                and isinstance(self.state, lifecycle.WaitingForQuorum)
                and before.attempt == 0
            ):
                lost = ", ".join(f"{n} {why}" for n, why in sorted(self.members.out.items()))
                out.append(
                    Say(
                        logging.WARNING,
                        f"{self.job}: fewer than half the nodes answer (out: {lost});"
                        " waiting for them",
                    )
                )
                out.append(Status(f"{self.job}: paused, waiting for nodes"))

    # -- runs ----------------------------------------------------------------------------

    def _start_run(self, now: float, out: list[Effect]) -> None:
        state = self.state
        assert isinstance(state, lifecycle.Trial)
        if state.phase == "confirm":
            settings = self.confirm_order[state.trial - state.confirm_from]
        elif self.retrying is not None:
            settings = self.retrying
        else:
            assert self.tuner is not None
            self._tokens += 1
            self._asking = self._tokens
            out.append(Ask(self._tokens, self.tuner))
            return
        self._launch(now, settings, out)

    def _asked(self, event: Asked, out: list[Effect]) -> None:
        if event.token != self._asking or not isinstance(self.state, lifecycle.Trial):
            return
        self._asking = None
        self._launch(event.now, dict(event.settings), out)

    def _launch(self, now: float, settings: dict[str, Any], out: list[Effect]) -> None:
        state = self.state
        assert isinstance(state, lifecycle.Trial)
        self.retrying = settings
        plan = self._plan(settings)
        self._publish(settings, plan, state.trial, out)
        assert self.published is not None
        self.trial_started = now
        self.run = Run(
            state.trial,
            state.phase,
            settings,
            self.published.version,
            plan,
            now,
            now + self.config.ack_timeout_s,
        )

    def _publish(
        self,
        settings: dict[str, Any],
        plan: MeasurementPlan | None,
        trial: int | None,
        out: list[Effect],
    ) -> None:
        self.version += 1
        self.current = dict(settings)
        publish = Publish(self.version, dict(settings), plan, trial, self.members.nodes)
        self.published = publish
        self.published_at = self.clock_now
        self.acks = {self.version: {}}
        out.append(
            Journal(
                {"type": "published", "version": self.version, "trial": trial, "settings": settings}
            )
        )
        out.append(publish)

    def _plan(self, settings: Mapping[str, Any]) -> MeasurementPlan:
        p = self.config.plan
        settle_s = p.settle_s
        if self.current.get("power_cap_w") != settings.get("power_cap_w"):
            latency = self.cap_latency_s
            cap_settle = (
                3 * POWER_AVERAGING_WINDOW_S
                if latency is None
                else latency + POWER_AVERAGING_WINDOW_S
            )
            settle_s = max(settle_s, cap_settle)
        return MeasurementPlan(
            p.settle_steps,
            settle_s,
            p.measure_steps,
            p.measure_s,
            p.windows,
            p.target_rel_se,
            p.max_windows,
        )

    def _ack(self, event: Ack, out: list[Effect]) -> None:
        message = event.message
        node = str(message["node"])
        if node not in self.members.nodes or not self.in_play(int(message["version"])):
            return
        applied = message.get("applied") or {}
        latency = applied.get("power_cap_latency_s")
        if isinstance(latency, int | float) and 0 <= latency < 60:
            self.cap_latency_s = max(self.cap_latency_s or 0.0, float(latency))
        newer = applied.get("version")
        if not message["ok"] and isinstance(newer, int) and newer >= int(message["version"]):
            self._jump(newer, out)
            return
        run = self.run
        self.acks.setdefault(int(message["version"]), {})[node] = message
        if message.get("stalled") is True:
            self._membership(members.Stalled(node, int(message["version"])), out)
        else:
            self._membership(members.Answered(node, "its ack"), out)
        if run is not None and run.version == message["version"]:
            run.acks[node] = message
            self._progress_run(event.now, out)

    def _jump(self, applied: int, out: list[Effect]) -> None:
        """Agents apply a version this coordinator did not know of (its journal lost, or
        retained settings not seen yet): publish the same again above it."""
        published = self.published
        if published is None or applied < published.version:
            return
        self.version = max(self.version, applied)
        out.append(
            Say(
                logging.WARNING,
                f"{self.job}: agents apply v{applied} already; publishing again above it",
            )
        )
        run = self.run
        self._publish(published.settings, published.plan, published.trial, out)
        if run is not None and self.published is not None:
            run.version = self.published.version
            run.acks.clear()
            run.reports.clear()
            run.partials.clear()

    def _report(self, event: Report, out: list[Effect]) -> None:
        message = event.message
        node = str(message["node"])
        version = int(message["version"])
        run = self.run
        if node not in self.members.nodes or not self.in_play(version):
            return
        if message.get("stalled") is True:
            self._membership(members.Stalled(node, version), out)
            if run is not None:
                run.partials.pop(node, None)
                run.reports[node] = message
        else:
            self._membership(members.Answered(node, "its report"), out)
            if run is not None:
                table = run.partials if message.get("partial") else run.reports
                table[node] = message
        self._progress_run(event.now, out)

    def _membership(self, event: members.Event, out: list[Effect]) -> None:
        self.members, changes = members.step(self.members, event)
        for change in changes:
            if change.after is None:
                back = f"{change.why}; it was out: {change.before}"
                text = f"{self.job}: node {change.node} is back ({back})"
                out.append(Say(logging.INFO, text))
            else:
                why = f"{change.after}: {change.why}"
                text = f"{self.job}: node {change.node} excluded from scoring ({why})"
                out.append(Say(logging.WARNING, text))

    def _progress_run(self, now: float, out: list[Effect]) -> None:
        """See whether the run in play is over: its acks in (or their deadline), its
        measurements in (or theirs, or an early abort)."""
        run = self.run
        if run is None:
            return
        active = set(self.members.active)
        if not run.measuring:
            if not active <= set(run.acks) and now < run.deadline:
                return
            outcome = self._acks_outcome(run, out)
            if outcome is None:
                run.measuring = True
                run.deadline = now + self.config.trial_timeout_s
                return
        else:
            answered = set(run.reports)
            if active <= answered or now >= run.deadline or self._should_abort(run):
                outcome = self._measure_outcome(run, out)
            else:
                early = self._judge_early(run)
                if early is None:
                    return
                outcome = early
                self._say_stopped(run, early, out)
        self._end_run(now, run, outcome, out)

    def _acks_outcome(self, run: Run, out: list[Effect]) -> Outcome | None:
        """Why the run cannot be measured, after its acks; None: it goes on to measuring."""
        acks = run.acks
        refused = {n: a for n, a in acks.items() if not a["ok"]}
        if refused:
            errors = {n: str(a.get("error")) for n, a in refused.items()}
            kinds = {a.get("refusal") for a in refused.values()}
            status = "rejected" if kinds <= SETTINGS_REFUSALS else "refused"
            return Outcome(status, nodes=tuple(sorted(refused)), errors=errors)
        silent = tuple(n for n in self.members.active if n not in acks)
        if silent:
            self._membership(members.Silent(silent, run.version), out)
        if not acks:
            return Outcome("no_ack", nodes=tuple(self.members.nodes))
        if not self.members.quorum():
            return Outcome(
                "lost_nodes", nodes=tuple(n for n in self.members.nodes if n not in acks)
            )
        return None

    def _should_abort(self, run: Run) -> bool:
        """Every active node's partial measurement puts the search trial below the abort
        line."""
        if run.phase != "search" or self.baseline is None or not self.config.abort_below:
            return False
        active = self.members.active
        if not active or not set(active) <= set(run.partials):
            return False
        partial = self._score([run.partials[n] for n in active])
        return partial is not None and partial < self.config.abort_below * self.baseline

    def _judge_early(self, run: Run) -> Outcome | None:
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
        for node in self.members.active:
            report = run.reports.get(node) or run.partials.get(node)
            if report is None or report.get("stalled") or report.get("nonfinite_loss"):
                return None
            reports[node] = report
        if not reports:
            return None
        nodes = len(cfg.nodes)
        windows = window_scores(list(reports.values()), cfg.objective, nodes)
        against = window_scores(list(incumbent.reports.values()), cfg.objective, nodes)
        if cfg.power_budget_w is not None:
            rule = EarlyStop(stop_better=False)
        else:
            rule = EarlyStop.for_objective(cfg.objective, energy_windows=bool(windows))
        verdict = rule.judge(windows, against)
        if verdict is Verdict.MEASURE_ON:
            return None
        mean, noise = told(windows)
        return Outcome(STOPPED_EARLY, dict(reports), mean, noise, verdict=str(verdict))

    def _say_stopped(self, run: Run, outcome: Outcome, out: list[Effect]) -> None:
        incumbent = self.incumbent
        assert incumbent is not None
        cfg = self.config
        nodes = len(cfg.nodes)
        windows = window_scores(list(outcome.reports.values()), cfg.objective, nodes)
        against = window_scores(list(incumbent.reports.values()), cfg.objective, nodes)
        gain = compare(against, windows)
        judged = f" ({gain.describe()})" if gain is not None else ""
        out.append(
            Say(
                logging.INFO,
                f"{self.job}: trial {run.trial} stopped after {len(windows)} windows: "
                f"{outcome.verdict} than trial {incumbent.index}{judged}",
            )
        )

    def _measure_outcome(self, run: Run, out: list[Effect]) -> Outcome:
        active = self.members.active
        if self._should_abort(run) and not set(active) <= set(run.reports):
            reports = {n: run.partials[n] for n in active}
            return Outcome("aborted", reports, self._score(list(reports.values())))
        measured = {n: r for n, r in run.reports.items() if not r.get("stalled")}
        unmeasured = [n for n in active if n not in measured]
        if unmeasured:
            self._membership(members.Unmeasured(tuple(unmeasured), run.version), out)
        blind: list[str] = []
        if self._needs_energy():
            blind = [n for n in self.members.active if measured[n].get("energy_j") is None]
            if blind:
                event = members.Unmeasured(tuple(blind), run.version, "no energy reading")
                self._membership(event, out)
        reports = {n: measured[n] for n in self.members.active if n in measured}
        usable = list(reports.values())
        if not usable or not self.members.quorum():
            missing = tuple(n for n in self.members.nodes if n not in reports)
            no_energy = bool(missing) and set(missing) <= set(blind)
            return Outcome("no_energy" if no_energy else "timeout", nodes=missing)
        if any(r["nonfinite_loss"] for r in usable):
            return Outcome("nonfinite_loss", reports)
        if any(r.get("xid_errors") for r in usable):
            return Outcome("xid", reports)
        value = self._score(usable)
        noise = score_noise(usable, self.config.objective, len(self.config.nodes))
        return Outcome("ok" if value is not None else "infeasible", reports, value, noise)

    def _needs_energy(self) -> bool:
        return self.config.objective == "energy" or self.config.power_budget_w is not None

    def _score(self, reports: list[Mapping[str, Any]]) -> float | None:
        cfg = self.config
        return score(reports, cfg.objective, len(cfg.nodes), cfg.power_budget_w)

    def _end_run(self, now: float, run: Run, outcome: Outcome, out: list[Effect]) -> None:
        self.run = None
        self.trial_started = None
        state = self.state
        assert isinstance(state, lifecycle.Trial)
        record = TrialRecord(
            run.trial,
            run.version,
            run.settings,
            outcome.score,
            outcome.status,
            {n: dict(r) for n, r in outcome.reports.items()},
            now - run.began,
            outcome.noise,
            confirmation=run.phase == "confirm",
            acks={n: dict(a) for n, a in run.acks.items()},
            nodes=outcome.nodes,
            errors=outcome.errors,
            verdict=outcome.verdict,
        )
        self._last_errors = outcome.errors
        if record.status in TRIALS:
            self.retrying = None
            out.append(Journal(record.to_journal()))
            if record.confirmation:
                self.confirmations.append(record)
            else:
                self._record(record)
            out.append(Measured(record))
            best = f"{self.best[1]:.4g}" if self.best else "none"
            if record.confirmation:
                progress = f"confirm {len(self.confirmations)}/{self.rules.confirm_runs}"
            else:
                progress = f"trial {len(self.trials)}/{self.config.trials}"
            out.append(Status(f"{self.job}: {progress}, best {best}"))
        self._last_version = run.version
        event = lifecycle.RunEnded(
            record.status,
            now,
            record.nodes,
            converged=not record.confirmation and self._converged(),
            candidate=self._confirm_pair() is not None,
        )
        self._advance(event, out)

    def _record(self, trial: TrialRecord) -> None:
        """Account a finished search trial in the tuner and the running best."""
        assert self.tuner is not None
        self.trials.append(trial)
        if trial.score is not None and trial.status in ("ok", STOPPED_EARLY):
            self.tuner.tell(trial.settings, trial.score, noise=trial.noise)
            if self.baseline is None and trial.index == 0 and trial.status == "ok":
                self.baseline = trial.score
            if self.best is None or (trial.score > self.best[1] and trial.verdict != "worse"):
                self.best = (trial.settings, trial.score)
                self.incumbent = trial
            if self.last_good is None or self.best[0] == trial.settings:
                self.last_good = trial.settings
        elif trial.score is not None:  # aborted: a real, bad partial measurement
            self.tuner.tell(trial.settings, trial.score)
        else:
            scores = [s for _, s in self.tuner.observations]
            self.tuner.tell(trial.settings, 0.5 * min(scores) if scores else 0.0)

    def _converged(self) -> bool:
        tuner, patience = self.tuner, self.config.patience
        return (
            self.best is not None
            and tuner is not None
            and tuner.n_told >= patience
            and tuner.converged(patience)
        )

    def _first_settings(self) -> dict[str, Any]:
        if self.trials:
            return self.trials[0].settings
        if self.start is not None:
            return self.start
        assert self.space is not None
        return self.space.snap(self.space.defaults())

    # -- confirmations and the end -------------------------------------------------------

    def _confirm_pair(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The start and the settings to confirm against it: the best, or, when the start
        measured best once, the best of the others; None when there is nothing to compare."""
        if self.best is None or self.tuner is None:
            return None
        start = self._first_settings()
        best = (self.tuner.best or self.best)[0]
        if best != start:
            return start, best
        others = [
            t for t in self.trials if t.status in ("ok", STOPPED_EARLY) and t.settings != start
        ]
        if not others:
            return None
        return start, max(others, key=lambda t: t.score or 0.0).settings

    def _begin_confirm(self, out: list[Effect]) -> None:
        state = self.state
        assert isinstance(state, lifecycle.Trial)
        if not self.confirm_order:
            pair = self._confirm_pair()
            assert pair is not None
            start, best = pair
            order = [start, best, best, start] * CONFIRM_ROUNDS
            self.confirm_order = order[: self.rules.confirm_runs]
            out.append(
                Journal(
                    {"type": "confirm", "from": state.confirm_from, "order": self.confirm_order}
                )
            )

    def _conclude(self, out: list[Effect]) -> None:
        """The round's end: judge the confirmations (if any), publish the final settings."""
        if self.confirm_order and len(self.confirmations) >= self.rules.confirm_runs:
            self._judge_confirmations(out)
        if self.best is None and self.trials:
            first = self._first_settings()
            self.best = (first, self.baseline or 0.0)
        final = self.best[0] if self.best else (self.last_good or self._first_settings())
        self._publish(final, None, None, out)
        self.final_version = self.version
        if not self.final_journalled:
            confirmed = self.confirmed
            self.final_journalled = True
            spent = self.cost()
            out.append(
                Journal(
                    {
                        "type": "final",
                        "version": self.final_version,
                        "settings": final,
                        "score": self.best[1] if self.best else None,
                        "baseline": self.baseline,
                        **(
                            {
                                "gain": confirmed.value,
                                "gain_low": confirmed.low,
                                "gain_high": confirmed.high,
                                "better": confirmed.better,
                            }
                            if confirmed is not None
                            else {}
                        ),
                        **(
                            {
                                "cost": {
                                    "seconds": spent.seconds,
                                    "samples_lost": spent.lost,
                                    "samples_lost_ratio": spent.lost_ratio,
                                    "break_even_s": spent.break_even_s,
                                }
                            }
                            if spent is not None
                            else {}
                        ),
                    }
                )
            )
            out.append(
                Say(
                    logging.INFO,
                    f"{self.job}: best {final} score {self.best[1] if self.best else None} "
                    f"gain {self.gain}" + (f"; {spent.describe()}" if spent else ""),
                )
            )
        self.last_good = final
        out.append(Status(f"{self.job}: tuned"))

    def _judge_confirmations(self, out: list[Effect]) -> None:
        start, best = self.confirm_order[0], self.confirm_order[1]
        gain = self.confirmed_gain(start, best)
        self.confirmed = gain
        if gain is None:
            out.append(
                Say(
                    logging.WARNING, f"{self.job}: the confirmations measured too little to compare"
                )
            )
            return
        self.baseline = gain.baseline
        if gain.better:
            self.best = (best, gain.best)
            out.append(
                Say(logging.INFO, f"{self.job}: {gain.describe()} over the baseline, confirmed")
            )
        else:
            self.best = (start, gain.baseline)
            out.append(
                Say(
                    logging.INFO,
                    f"{self.job}: no setting was better than the baseline (best candidate "
                    f"{gain.describe()})",
                )
            )

    def cost(self) -> Cost | None:
        """What the round's tuning cost so far against its start (:mod:`.cost`), the
        break-even at its final settings once it has them; None before the start was
        measured."""
        key = (self.rounds, len(self.trials), len(self.confirmations), self.final_journalled)
        if self._cost is not None and self._cost[0] == key:
            return self._cost[1]  # /metrics asks on every journal write, of every job
        entries = sorted(
            (t.to_journal() for t in (*self.trials, *self.confirmations)),
            key=lambda e: e["index"],
        )
        final = None
        if self.final_journalled and self.best is not None:
            final = {"settings": self.best[0], "score": self.best[1], "baseline": self.baseline}
        cost = round_cost(entries, final, self.config.objective, len(self.config.nodes))
        self._cost = (key, cost)
        return cost

    def confirmed_gain(self, start: Mapping[str, Any], best: Mapping[str, Any]) -> Gain | None:
        """The best settings against the baseline from the confirmations that measured them."""
        cfg = self.config
        samples: dict[str, list[float]] = {"start": [], "best": []}
        for record in self.confirmations:
            if record.status != "ok" or record.settings not in (start, best):
                continue
            which = "start" if record.settings == start else "best"
            samples[which] += trial_samples(
                list(record.reports.values()), cfg.objective, len(cfg.nodes)
            )
        return compare(samples["start"], samples["best"])

    # -- after tuning --------------------------------------------------------------------

    def job_throughput(self, previous: Mapping[str, Progress]) -> float | None:
        """The job's samples/s since ``previous``, in a trial score's unit: a node's rate is
        the sum over its ranks, the nodes' mean scaled to the job's node count."""
        rates = []
        out = self.members.out
        for node, now in self.progress.items():
            before = previous.get(node)
            if before is not None and node not in out and node in self.members.nodes:
                d_samples, d_step = now.samples - before.samples, now.step_s - before.step_s
                if d_step > 0 and d_samples >= 0:
                    rates.append(d_samples / (d_step / now.ranks))
        if not rates:
            return None
        return statistics.fmean(rates) * len(self.config.nodes)

    def _watch(self, now: float, out: list[Effect]) -> None:
        if self._drift_at is None or now < self._drift_at:
            return
        self._drift_at = now + DRIFT_CHECK_S
        previous, self._drift_from = self._drift_from, dict(self.progress)
        cfg = self.config
        if cfg.objective != "throughput" or cfg.mode != "tune" or self.best is None:
            return
        rate = self.job_throughput(previous)
        if rate is None or not math.isfinite(rate):
            return
        tuned = self.best[1]
        below = rate < (1 - cfg.drift_threshold) * tuned
        if below:
            out.append(
                Say(
                    logging.DEBUG,
                    f"{self.job}: throughput {rate:.4g} is {100 * (1 - rate / tuned):.0f}% below"
                    f" the tuned {tuned:.4g}",
                )
            )
        self._advance(lifecycle.Drift(now, below, cfg.drift_sustained_s), out)


def event_now(event: lifecycle.Event) -> float:
    """The time an event carries (0 for one without)."""
    return float(getattr(event, "now", 0.0))


def _space_from(data: Mapping[str, Any]) -> SearchSpace:
    """A SearchSpace from its journalled form (``dataclasses.asdict``)."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return SearchSpace(**fields)


__all__ = [
    "CONFIRM_ROUNDS",
    "MEASURED",
    "Ack",
    "Ask",
    "Asked",
    "Begin",
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
    "VersionSeen",
]
