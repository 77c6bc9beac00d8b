"""One job's tuning lifecycle as a pure state machine: states, events, transitions.

Each state is a small frozen model; :func:`advance` takes a state and an event and returns
the next state with the actions the coordinator (the I/O around it: MQTT, journal, metrics,
timers) performs. Nothing here reads a clock or touches the network: time comes in events.

    Trial --Ended(a trial)---------> Trial (next) | Trial (confirming) | Tuned    [+ Rollback]
    Trial --Ended(not a trial)-----> Paused                              [Rollback, Pause]
    Paused --Tick(due, quorum)-----> Trial (the same one again)          [Retry]
    Paused --Tick(due, no quorum)--> WaitingForQuorum
    WaitingForQuorum --Tick(quorum)> Trial (the same one again)          [Retry]
    Tuned --Drift(sustained)-------> Trial (a new round)                 [Retune]

A refusal, a missing ack and a missing measurement say nothing about the settings: they are
not trials (not counted, not told to the tuner, never "converged"); the job pauses, names the
reason and the nodes, and retries the same settings with exponential back-off. Any other pair
of state and event is an :class:`IllegalTransition`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

RETRY_FIRST_S = 5.0
RETRY_MAX_S = 300.0

MEASURED = frozenset({"ok", "aborted"})
"""Outcomes with a measurement of the settings: only these can make a tuning converge."""

TRIALS = MEASURED | {"infeasible", "nonfinite_loss", "xid"}
"""Outcomes that are trials of the settings (counted in the budget, told to the tuner)."""

NOT_TRIALS = {
    "refused": "refused",
    "no_ack": "no ack",
    "lost_nodes": "no ack",
    "timeout": "no measurement",
}
"""Outcomes that are not trials, and the reason the job pauses for."""

ROLLBACK_ON = frozenset({"nonfinite_loss", "xid", *NOT_TRIALS})
"""Outcomes after which the job goes back to its last known good settings at once."""

Phase = Literal["search", "confirm"]


@dataclass(frozen=True)
class Backoff:
    """Retry delays: ``first_s``, doubling each attempt, at most ``max_s``."""

    first_s: float = RETRY_FIRST_S
    max_s: float = RETRY_MAX_S

    def delay_s(self, attempt: int) -> float:
        return min(self.max_s, self.first_s * 2.0 ** min(attempt, 64))


# -- states --------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class WaitingForQuorum:
    """A pause whose retry is due, but fewer than half the nodes answer."""

    paused: Paused


@dataclass(frozen=True)
class Trial:
    """Run ``trial`` (its settings out, the nodes acking, settling and measuring): one of the
    search's budget (``phase`` "search") or a confirmation after it ("confirm")."""

    round: int = 1
    phase: Phase = "search"
    trial: int = 0
    retrying: Paused | None = None
    """The pause this run retries after (None: a first run)."""


@dataclass(frozen=True)
class Tuned:
    """The chosen settings are out; the drift watch compares throughput with the tuned score."""

    round: int = 1
    drifting_since: float | None = None


State = Trial | Paused | WaitingForQuorum | Tuned


def name(state: State | None) -> str:
    """The state's name on /metrics and in the status line."""
    if state is None:
        return "starting"
    if isinstance(state, Trial):
        if state.phase == "confirm":
            return "confirming"
        return "retuning" if state.round > 1 else "searching"
    if isinstance(state, Paused):
        return "paused"
    if isinstance(state, WaitingForQuorum):
        return "waiting_for_quorum"
    return "tuned"


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ended:
    """A run of the current trial ended with ``status``; ``nodes`` are the ones behind a
    not-trial. ``more``: the phase has runs left after this one (the search's budget, or
    confirmations); ``converged``: the tuner, told this outcome, sees no more progress;
    ``confirm``: the search's end goes on to confirmations."""

    status: str
    now: float
    nodes: tuple[str, ...] = ()
    more: bool = True
    converged: bool = False
    confirm: bool = False


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


Event = Ended | Tick | Drift


# -- actions -------------------------------------------------------------------------------


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


Action = Rollback | Pause | Retry | Resume | Confirm | Finish | Retune


class IllegalTransition(ValueError):
    """An event the state does not take."""

    def __init__(self, state: State, event: Event) -> None:
        super().__init__(f"{name(state)} ({state}) does not take {event}")
        self.state, self.event = state, event


# -- transitions ---------------------------------------------------------------------------


DEFAULT_BACKOFF = Backoff()


def advance(
    state: State, event: Event, backoff: Backoff = DEFAULT_BACKOFF
) -> tuple[State, list[Action]]:
    """The next state after ``event`` and what to do for it; raises IllegalTransition."""
    if isinstance(state, Trial) and isinstance(event, Ended):
        return _ended(state, event, backoff)
    if isinstance(state, Paused | WaitingForQuorum) and isinstance(event, Tick):
        return _tick(state, event)
    if isinstance(state, Tuned) and isinstance(event, Drift):
        return _drift(state, event)
    raise IllegalTransition(state, event)


def _ended(state: Trial, event: Ended, backoff: Backoff) -> tuple[State, list[Action]]:
    what = "confirmation" if state.phase == "confirm" else "trial"
    reason = NOT_TRIALS.get(event.status)
    if reason is not None:
        before = state.retrying
        attempt = 0 if before is None else before.attempt + 1
        paused = Paused(
            state.round,
            state.phase,
            state.trial,
            reason,
            event.nodes,
            event.now + backoff.delay_s(attempt),
            attempt,
        )
        actions: list[Action] = [Rollback(f"{what} {state.trial} {event.status}")]
        if before is None or (before.reason, before.nodes) != (reason, event.nodes):
            actions.append(Pause(paused))
        return paused, actions
    if event.status not in TRIALS:
        raise IllegalTransition(state, event)
    actions = [] if state.retrying is None else [Resume(state.retrying)]
    if event.status in ROLLBACK_ON:
        actions.append(Rollback(f"{what} {state.trial} {event.status}"))
    converged = event.converged and event.status in MEASURED and state.phase == "search"
    if event.more and not converged:
        return Trial(state.round, state.phase, state.trial + 1), actions
    if state.phase == "search" and event.confirm:
        return Trial(state.round, "confirm", state.trial + 1), [*actions, Confirm()]
    return Tuned(state.round), [*actions, Finish()]


def _tick(state: Paused | WaitingForQuorum, event: Tick) -> tuple[State, list[Action]]:
    paused = state.paused if isinstance(state, WaitingForQuorum) else state
    if event.now < paused.retry_at:
        return state, []
    if not event.quorum:
        return WaitingForQuorum(paused), []
    return Trial(paused.round, paused.phase, paused.trial, retrying=paused), [Retry(paused)]


def _drift(state: Tuned, event: Drift) -> tuple[State, list[Action]]:
    if not event.below:
        return replace(state, drifting_since=None), []
    since = event.now if state.drifting_since is None else state.drifting_since
    if event.now - since < event.sustained_s:
        return replace(state, drifting_since=since), []
    return Trial(state.round + 1), [Retune()]
