"""Resuming a job's tuning from its journal after a restart. Pure.

The journal (:class:`~hyperagent.tuner.journal.JournalState`) holds everything resuming
needs: the round's start (its fingerprint and space), its trials and confirmations, the
confirmations' order, its final settings and the settings of a run in flight.
:func:`resumable` says whether the journal's round fits the job as it is now (a changed
objective, power limits, knobs or nodes start the tuning over); :func:`replay` brings a
:class:`~hyperagent.tuner.rounds.Round` up to what the journal says happened and names the
lifecycle state the round resumes in (:func:`~hyperagent.tuner.lifecycle.resumed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyperagent.config import JobTuningSection
from hyperagent.tuner import lifecycle
from hyperagent.tuner.discovery import fingerprint
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.journal import JournalState
from hyperagent.tuner.lifecycle import NOT_TRIALS
from hyperagent.tuner.rounds import Round
from hyperagent.tuner.space import SearchSpace


def waits_on(journal: JournalState, waited_s: float, wait_s: float) -> tuple[str, ...]:
    """The nodes of the journal's round, which a restarted job waiting for its ranks waits
    for too until it has waited ``wait_s`` (after a restart the nodes' telemetry comes back
    one by one; a job resumes where its round ran, rather than start over on the first
    nodes heard from). Empty when none."""
    start = journal.start
    if start is None or waited_s >= wait_s:
        return ()
    nodes = start.get("nodes")
    return tuple(n for n in nodes if isinstance(n, str)) if isinstance(nodes, list) else ()


def space_from(data: Mapping[str, Any]) -> SearchSpace:
    """A SearchSpace from its journalled form (``dataclasses.asdict``)."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return SearchSpace(**fields)


def resumable(journal: JournalState, space: SearchSpace, config: JobTuningSection) -> bool:
    """The journal's round can go on: it measured something, its tuning's fingerprint and
    space are this job's, and every trial it holds is a trial of that space."""
    start = journal.start
    if start is None or (not journal.trials and journal.final is None):
        return False
    if start.get("fingerprint") != fingerprint(config) or "space" not in start:
        return False
    try:
        saved = space_from(start["space"])
    except (TypeError, ValueError):
        return False
    if saved != space:
        return False
    if any(t["status"] in NOT_TRIALS for t in journal.trials):
        return False
    return all(saved.contains(t["settings"]) for t in journal.trials)


@dataclass(frozen=True)
class Resumed:
    """Where a journal puts a restarted job: its round (``number``) as the journal tells
    it, the settings of the run it had in flight (retried first), and the lifecycle state
    with what to do first."""

    round: Round
    number: int
    retrying: dict[str, Any] | None
    state: lifecycle.State
    actions: tuple[lifecycle.Action, ...]


def replay(
    journal: JournalState,
    space: SearchSpace,
    config: JobTuningSection,
    start: dict[str, Any] | None,
    rules: lifecycle.Rules,
) -> Resumed:
    """Bring a round's tuner and running best up to what the journal says happened, and
    name the state it says the round is in."""
    number = max(journal.rounds, 1)
    tuned = Round.begin(space, config, number, start, rules.confirm_runs)
    for entry in journal.trials:
        tuned.add(TrialRecord.from_journal(entry))
    if journal.confirm is not None:
        tuned.confirmation.order = [dict(s) for s in journal.confirm["order"]]
    final = journal.final is not None and journal.measured
    if final and journal.final is not None:
        tuned.best = (journal.final["settings"], journal.final["score"])
        tuned.baseline = journal.final.get("baseline")
        tuned.last_good = journal.final["settings"]
        tuned.final_journalled = True
    in_flight = journal.in_flight
    retrying = None
    if in_flight is not None and in_flight.get("settings") is not None:
        retrying = dict(in_flight["settings"])
    facts = lifecycle.Journalled(
        round=number,
        searched=len(tuned.trials),
        confirm_from=None if journal.confirm is None else int(journal.confirm["from"]),
        confirmed=len(tuned.confirmations),
        final=final,
        converged=tuned.converged(config.patience),
        candidate=tuned.to_confirm(tuned.first_settings(start, space)) is not None,
    )
    state, actions = lifecycle.resumed(facts, rules)
    return Resumed(tuned, number, retrying, state, tuple(actions))
