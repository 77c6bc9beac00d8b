"""One job's lifecycle as a pure state machine: states, events, transitions.

Each state is a small frozen model; :func:`advance` takes a state, an event and the job's
:class:`Rules` and returns the next state with the actions the coordinator (the I/O around
it: MQTT, journal, metrics, timers) performs. Nothing here reads a clock or touches the
network: time comes in events.

    WaitingForRanks --Ready---------------> Trial (round 1, or where the journal stopped)
    WaitingForRanks --RanksTick(overdue)--> WaitingForRanks                [SayMissing, once]
    Trial --RunEnded(a trial)-------------> Trial (next) | Trial (confirming) | Tuned
    Trial --RunEnded(not a trial)---------> Paused                        [Rollback, Pause]
    Trial --RunEnded(not a trial, retries spent)-> Failed                 [Rollback, Stop]
    Paused --Tick(due, quorum)------------> Trial (the same one again)    [Retry]
    Paused --Tick(due, no quorum)---------> WaitingForQuorum
    WaitingForQuorum --Tick(quorum)-------> Trial (the same one again)    [Retry]
    Tuned --Drift(sustained)--------------> Trial (a new round)           [Retune]
    any but Ended/Failed --Left-----------> Ended                         [Stop]
    any but Ended/Failed --Fail-----------> Failed                        [Stop]

The search runs ``Rules.trials`` trials, or fewer when the tuner says it converged; then, when
there is a candidate better than the start and ``Rules.confirm_best``, ``Rules.confirm_runs``
confirmations (the start and the best measured again, interleaved), then the chosen settings
(Tuned). A refusal, a missing ack and a missing measurement say nothing about the settings:
they are not trials (not counted, not told to the tuner, never "converged"); the job pauses,
names the reason and the nodes, and retries the same settings with exponential back-off, at
most ``Rules.max_retries`` times. A node that refuses the settings themselves (outside its
bounds) answers the trial: it is a trial ("rejected"), told to the tuner as infeasible. Any
other pair of state and event is an :class:`IllegalTransition`. :func:`resumed` is the state a
journal's facts put a restarted job in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

RETRY_FIRST_S = 5.0
RETRY_MAX_S = 300.0

MEASURED = frozenset({"ok", "aborted", "stopped_early"})
"""Outcomes with a measurement of the settings: only these can make a tuning converge."""

TRIALS = MEASURED | {"infeasible", "rejected", "nonfinite_loss", "xid"}
"""Outcomes that are trials of the settings (counted in the budget, told to the tuner)."""

NOT_TRIALS = {
    "refused": "refused",
    "no_ack": "no ack",
    "lost_nodes": "no ack",
    "timeout": "no measurement",
    "no_energy": "no energy reading",
}
"""Outcomes that are not trials, and the reason the job pauses for."""

ROLLBACK_ON = frozenset({"nonfinite_loss", "xid", "rejected", *NOT_TRIALS})
"""Outcomes after which the job goes back to its last known good settings at once."""

Phase = Literal["search", "confirm"]


@dataclass(frozen=True)
class Backoff:
    """Retry delays: ``first_s``, doubling each attempt, at most ``max_s``."""

    first_s: float = RETRY_FIRST_S
    max_s: float = RETRY_MAX_S

    def delay_s(self, attempt: int) -> float:
        return min(self.max_s, self.first_s * 2.0 ** min(attempt, 64))


@dataclass(frozen=True)
class Rules:
    """What one job's tuning is allowed: its budget and its patience with faults."""

    trials: int = 30
    """Search trials at most."""
    confirm_best: bool = True
    confirm_runs: int = 4
    """Confirmations after the search (the start and the best, interleaved)."""
    max_retries: int = 20
    """Retries of one run that cannot be measured, before the job fails."""
    ranks_wait_s: float = 120.0
    """How long a job waits for its ranks before it says which are missing."""
    backoff: Backoff = Backoff()


# -- states --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WaitingForRanks:
    """Found, waiting until every rank of the job's world size is attached (since ``since``);
    ``said``: the missing ranks were named once the wait was overdue."""

    since: float
    said: bool = False


@dataclass(frozen=True)
class Paused:
    """A run could not be measured (``reason``, ``nodes``); it is tried again at
    ``retry_at``, the ``attempt``-th retry."""

    round: int
    phase: Phase
    trial: int
    reason: str
    nodes: tuple[str, ...]
    retry_at: float
    attempt: int = 0
    confirm_from: int = 0


@dataclass(frozen=True)
class WaitingForQuorum:
    """A pause whose retry is due, but fewer than half the nodes answer."""

    paused: Paused


@dataclass(frozen=True)
class Trial:
    """Run ``trial`` (its settings out, the nodes acking, settling and measuring): one of the
    search's budget (``phase`` "search") or a confirmation after it ("confirm"), the
    confirmations being numbered from ``confirm_from`` (the search's trial count)."""

    round: int = 1
    phase: Phase = "search"
    trial: int = 0
    retrying: Paused | None = None
    """The pause this run retries after (None: a first run)."""
    confirm_from: int = 0


@dataclass(frozen=True)
class Tuned:
    """The chosen settings are out; the drift watch compares throughput with the tuned score."""

    round: int = 1
    drifting_since: float | None = None


@dataclass(frozen=True)
class Ended:
    """Every rank of the job left: nothing more is done for it."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The job cannot be tuned, for ``reason``; nothing more is done for it."""

    reason: str


State = WaitingForRanks | Trial | Paused | WaitingForQuorum | Tuned | Ended | Failed
TERMINAL = (Ended, Failed)


def name(state: State | None) -> str:
    """The state's name on /metrics and in the status line."""
    if state is None:
        return "starting"
    if isinstance(state, WaitingForRanks):
        return "waiting_for_ranks"
    if isinstance(state, Trial):
        if state.phase == "confirm":
            return "confirming"
        return "retuning" if state.round > 1 else "searching"
    if isinstance(state, Paused):
        return "paused"
    if isinstance(state, WaitingForQuorum):
        return "waiting_for_quorum"
    if isinstance(state, Ended):
        return "ended"
    if isinstance(state, Failed):
        return "failed"
    return "tuned"


STATES = (
    "waiting_for_ranks",
    "searching",
    "confirming",
    "tuned",
    "retuning",
    "paused",
    "waiting_for_quorum",
    "ended",
    "failed",
)
"""Every name :func:`name` gives."""


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Every rank of the world size is attached; ``resume``: where the journal says the job
    was (None: a new tuning)."""

    now: float
    resume: tuple[State, tuple[Action, ...]] | None = None


@dataclass(frozen=True)
class RanksTick:
    """Waiting for ranks at ``now``; ``missing`` names the ranks not attached."""

    now: float
    missing: str = ""


@dataclass(frozen=True)
class RunEnded:
    """A run of the current trial ended with ``status``; ``nodes`` are the ones behind a
    not-trial. ``converged``: the tuner, told this outcome, sees no more progress;
    ``candidate``: there are settings other than the start to confirm."""

    status: str
    now: float
    nodes: tuple[str, ...] = ()
    converged: bool = False
    candidate: bool = True


@dataclass(frozen=True)
class Tick:
    """Time passed or a node came back: ``now``, and whether half the nodes answer."""

    now: float
    quorum: bool


@dataclass(frozen=True)
class Drift:
    """The drift watch's reading: whether throughput is ``below`` the tuned line now."""

    now: float
    below: bool
    sustained_s: float


@dataclass(frozen=True)
class Left:
    """No rank of the job is attached anywhere any more."""

    now: float


@dataclass(frozen=True)
class Fail:
    """The job cannot be tuned (no node can run any point of its space, ...)."""

    reason: str


Event = Ready | RanksTick | RunEnded | Tick | Drift | Left | Fail


# -- actions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SayMissing:
    """Say which ranks the job still waits for (once per wait)."""

    missing: str


@dataclass(frozen=True)
class Rollback:
    """Publish the last known good settings, without measuring."""

    why: str


@dataclass(frozen=True)
class Pause:
    """Say the job is paused, why, for which nodes and until when (once per pause)."""

    paused: Paused


@dataclass(frozen=True)
class Retry:
    """Run the paused trial again (the same settings, a new version)."""

    paused: Paused


@dataclass(frozen=True)
class Resume:
    """Say the job answers again after a pause."""

    paused: Paused


@dataclass(frozen=True)
class Confirm:
    """The search ended: measure the start and the best again, interleaved."""


@dataclass(frozen=True)
class Finish:
    """Publish the chosen settings and journal them as final."""


@dataclass(frozen=True)
class Retune:
    """Throughput drifted: start a new round from the current best."""


@dataclass(frozen=True)
class Stop:
    """The job ended or failed: stop its run, publish nothing more, journal why."""

    reason: str


Action = SayMissing | Rollback | Pause | Retry | Resume | Confirm | Finish | Retune | Stop


class IllegalTransition(ValueError):
    """An event the state does not take."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"{name(state)} ({state}) does not take {event}")
        self.state, self.event = state, event


# -- transitions ---------------------------------------------------------------------------


DEFAULT_RULES = Rules()


def advance(state: State, event: Event, rules: Rules = DEFAULT_RULES) -> tuple[State, list[Action]]:
    """The next state after ``event`` and what to do for it; raises IllegalTransition."""
    if isinstance(state, TERMINAL):
        raise IllegalTransition(state, event)
    if isinstance(event, Left):
        return Ended("every rank left"), [Stop("every rank left")]
    if isinstance(event, Fail):
        return Failed(event.reason), [Stop(event.reason)]
    if isinstance(state, WaitingForRanks):
        if isinstance(event, Ready):
            if event.resume is not None:
                resumed_state, actions = event.resume
                return resumed_state, list(actions)
            return Trial(), []
        if isinstance(event, RanksTick):
            if state.said or event.now - state.since < rules.ranks_wait_s:
                return state, []
            return replace(state, said=True), [SayMissing(event.missing)]
    if isinstance(state, Trial) and isinstance(event, RunEnded):
        return _ended(state, event, rules)
    if isinstance(state, Paused | WaitingForQuorum) and isinstance(event, Tick):
        return _tick(state, event)
    if isinstance(state, Tuned) and isinstance(event, Drift):
        return _drift(state, event)
    raise IllegalTransition(state, event)


def after_search(
    round_: int, searched: int, candidate: bool, rules: Rules
) -> tuple[State, list[Action]]:
    """Where a search of ``searched`` trials goes: confirmations when there is a candidate
    to confirm (and ``confirm_best``), else the end."""
    if rules.confirm_best and candidate:
        return Trial(round_, "confirm", searched, confirm_from=searched), [Confirm()]
    return Tuned(round_), [Finish()]


def _ended(state: Trial, event: RunEnded, rules: Rules) -> tuple[State, list[Action]]:
    what = "confirmation" if state.phase == "confirm" else "trial"
    reason = NOT_TRIALS.get(event.status)
    if reason is not None:
        before = state.retrying
        attempt = 0 if before is None else before.attempt + 1
        rollback = Rollback(f"{what} {state.trial} {event.status}")
        if attempt > rules.max_retries:
            why = f"{reason} ({', '.join(event.nodes) or 'no node answered'}) {attempt} times"
            return Failed(why), [rollback, Stop(why)]
        paused = Paused(
            state.round,
            state.phase,
            state.trial,
            reason,
            event.nodes,
            event.now + rules.backoff.delay_s(attempt),
            attempt,
            state.confirm_from,
        )
        actions: list[Action] = [rollback]
        if before is None or (before.reason, before.nodes) != (reason, event.nodes):
            actions.append(Pause(paused))
        return paused, actions
    if event.status not in TRIALS:
        raise IllegalTransition(state, event)
    actions = [] if state.retrying is None else [Resume(state.retrying)]
    if event.status in ROLLBACK_ON:
        actions.append(Rollback(f"{what} {state.trial} {event.status}"))
    following = state.trial + 1
    if state.phase == "confirm":
        if following - state.confirm_from < rules.confirm_runs:
            return Trial(
                state.round, "confirm", following, confirm_from=state.confirm_from
            ), actions
        return Tuned(state.round), [*actions, Finish()]
    converged = event.converged and event.status in MEASURED
    if following < rules.trials and not converged:
        return Trial(state.round, "search", following), actions
    then, more = after_search(state.round, following, event.candidate, rules)
    return then, [*actions, *more]


def _tick(state: Paused | WaitingForQuorum, event: Tick) -> tuple[State, list[Action]]:
    paused = state.paused if isinstance(state, WaitingForQuorum) else state
    if event.now < paused.retry_at:
        return state, []
    if not event.quorum:
        return WaitingForQuorum(paused), []
    again = Trial(paused.round, paused.phase, paused.trial, paused, paused.confirm_from)
    return again, [Retry(paused)]


def _drift(state: Tuned, event: Drift) -> tuple[State, list[Action]]:
    if not event.below:
        return replace(state, drifting_since=None), []
    since = event.now if state.drifting_since is None else state.drifting_since
    if event.now - since < event.sustained_s:
        return replace(state, drifting_since=since), []
    return Trial(state.round + 1), [Retune()]


@dataclass(frozen=True)
class Journalled:
    """What a journal says of the job's current round, for :func:`resumed`."""

    round: int = 1
    searched: int = 0
    """Search trials recorded."""
    confirm_from: int | None = None
    """Where the confirmations began (their first index), if they did."""
    confirmed: int = 0
    """Confirmations recorded."""
    final: bool = False
    """The round's chosen settings were published (and a trial of it measured)."""
    converged: bool = False
    """The tuner, told the recorded trials, sees no more progress."""
    candidate: bool = True
    """There are settings other than the start to confirm."""


def resumed(journal: Journalled, rules: Rules = DEFAULT_RULES) -> tuple[State, list[Action]]:
    """The state a restarted job resumes in, and what to do first: tuned after a final; the
    next confirmation once confirmations began (never back to searching); after a search
    whose budget was spent or that converged, its end; else the next search trial."""
    if journal.final:
        return Tuned(journal.round), [Finish()]
    if journal.confirm_from is not None:
        index = journal.confirm_from + journal.confirmed
        if journal.confirmed >= rules.confirm_runs:
            return Tuned(journal.round), [Finish()]
        confirm = Trial(journal.round, "confirm", index, confirm_from=journal.confirm_from)
        return confirm, []
    if journal.searched >= rules.trials or (journal.searched and journal.converged):
        return after_search(journal.round, journal.searched, journal.candidate, rules)
    return Trial(journal.round, "search", journal.searched), []
