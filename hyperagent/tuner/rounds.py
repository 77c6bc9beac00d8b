"""One round of a job's tuning: its tuner, what it measured, and where it stands. Pure.

A round is a search (the tuner asked and told trial by trial), then its confirmations
(:mod:`~hyperagent.tuner.confirm`), then its final settings. :class:`Round` keeps the tuner,
the search trials, the running best, the baseline (trial 0's score), the incumbent (the best
search trial, whose windows early judgements compare with), the last known good settings
(which carry over to the next round), and the round's cost; it writes the journal's
``start`` and ``final`` entries. A drift starts a new round from the best. Recommend mode
runs no round: :func:`recommendation` says what it recommends instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hyperagent.config import JobTuningSection
from hyperagent.tuner.confirm import Confirmation, Judgement, candidate
from hyperagent.tuner.cost import Cost, round_cost
from hyperagent.tuner.discovery import fingerprint
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import SearchSpace
from hyperagent.tuner.trialrun import SCORED


def start_entry(config: JobTuningSection, space: SearchSpace, number: int) -> dict[str, Any]:
    """The journal's entry for the start of round ``number``: what a restart checks the
    round still fits (the tuning's fingerprint, its space, its nodes)."""
    return {
        "type": "start",
        "fingerprint": fingerprint(config),
        "space": dataclasses.asdict(space),
        "nodes": list(config.nodes),
        "round": number,
    }


def recommendation(
    space: SearchSpace,
    start: dict[str, Any],
    config: JobTuningSection,
    final: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], str]:
    """What recommend mode recommends, measuring nothing, and why: the settings of the
    journal's ``final`` entry (the last finished tuning of this job), else BACKGROUND.md's
    table for the job's nodes over ``start``."""
    if final is not None:
        return final["settings"], "the last finished tuning of this job"
    nodes = len(config.nodes)
    table = space.recommended(nodes, start)
    why = (
        f"BACKGROUND.md's table for {nodes} nodes on {config.backend} "
        f"({table.get('allreduce')}, {table.get('chunk_kb')} KiB chunks, "
        f"{table['bucket_mb']} MiB buckets) over the starting settings; "
        "no measurement yet"
    )
    return table, why


@dataclass
class Round:
    """A round's tuner and trials, its best and baseline so far, and its confirmations."""

    tuner: Tuner | None = None
    trials: list[TrialRecord] = field(default_factory=list)
    confirmation: Confirmation = field(default_factory=Confirmation)
    best: tuple[dict[str, Any], float] | None = None
    baseline: float | None = None
    incumbent: TrialRecord | None = None
    """The best search trial so far, whose windows an early judgement compares with."""
    last_good: dict[str, Any] | None = None
    """The settings a rollback goes back to: the first measured, then the best."""
    final_journalled: bool = False
    _cost: tuple[tuple[int, int, bool], Cost | None] | None = field(default=None, repr=False)

    @classmethod
    def begin(
        cls,
        space: SearchSpace,
        config: JobTuningSection,
        number: int,
        start: dict[str, Any] | None,
        confirm_runs: int,
        last_good: dict[str, Any] | None = None,
    ) -> Round:
        """Round ``number``'s start: its tuner, seeded by the number, starting at ``start``."""
        tuner = Tuner(space, seed=config.seed + number - 1, start=start, objective=config.objective)
        return cls(tuner, confirmation=Confirmation(confirm_runs), last_good=last_good)

    @property
    def confirmations(self) -> list[TrialRecord]:
        return self.confirmation.records

    @property
    def gain(self) -> float | None:
        """Best score over the baseline, minus one (once confirmed: 0 when no setting was
        better)."""
        confirmed = self.confirmation.confirmed
        if confirmed is not None:
            return confirmed.value if confirmed.better else 0.0
        if self.best is None or not self.baseline:
            return None
        return self.best[1] / self.baseline - 1

    def add(self, record: TrialRecord) -> None:
        """A measured confirmation, or a finished search trial (:meth:`record`)."""
        if record.confirmation:
            self.confirmation.records.append(record)
        else:
            self.record(record)

    def record(self, trial: TrialRecord) -> None:
        """Account a finished search trial in the tuner and the running best: a full
        measurement with its noise, an aborted one (a real, bad partial measurement) as it
        scored, one without a score as half the worst score told so far."""
        assert self.tuner is not None
        self.trials.append(trial)
        if trial.score is not None and trial.status in SCORED:
            self.tuner.tell(trial.settings, trial.score, noise=trial.noise)
            if self.baseline is None and trial.index == 0 and trial.status == "ok":
                self.baseline = trial.score
            if self.best is None or (trial.score > self.best[1] and trial.verdict != "worse"):
                self.best = (trial.settings, trial.score)
                self.incumbent = trial
            if self.last_good is None or self.best[0] == trial.settings:
                self.last_good = trial.settings
        elif trial.score is not None:
            self.tuner.tell(trial.settings, trial.score)
        else:
            scores = [s for _, s in self.tuner.observations]
            self.tuner.tell(trial.settings, 0.5 * min(scores) if scores else 0.0)

    def converged(self, patience: int) -> bool:
        """The tuner, told ``patience`` trials or more, sees no more progress."""
        tuner = self.tuner
        return (
            self.best is not None
            and tuner is not None
            and tuner.n_told >= patience
            and tuner.converged(patience)
        )

    def first_settings(
        self, start: dict[str, Any] | None, space: SearchSpace | None
    ) -> dict[str, Any]:
        """Trial 0's settings; before it, ``start``, else the space's defaults."""
        if self.trials:
            return self.trials[0].settings
        if start is not None:
            return start
        assert space is not None
        return space.snap(space.defaults())

    def to_confirm(self, first: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The start (``first``) and the settings to confirm against it
        (:func:`~hyperagent.tuner.confirm.candidate`); None when there is nothing to compare."""
        if self.best is None or self.tuner is None:
            return None
        return candidate(first, (self.tuner.best or self.best)[0], self.trials)

    def plan_confirmations(self, first: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Plan the confirmations of the round's best against its start (``first``), once:
        their order, or None when they were planned already (a resumed round)."""
        if self.confirmation.order:
            return None
        pair = self.to_confirm(first)
        assert pair is not None
        return self.confirmation.plan(*pair)

    def conclude(
        self, first: dict[str, Any], objective: str, nodes: int
    ) -> tuple[Judgement | None, dict[str, Any]]:
        """The round's end: the confirmations' verdict once all were measured (None before),
        whose best and baseline replace the search's when they could compare; and the final
        settings: the best, else the last good, else the start (``first``)."""
        judged = None
        if self.confirmation.complete:
            judged = self.confirmation.judge(objective, nodes)
            if judged.gain is not None:
                self.baseline, self.best = judged.baseline, judged.best
        if self.best is None and self.trials:
            self.best = (first, self.baseline or 0.0)
        final = self.best[0] if self.best else (self.last_good or first)
        return judged, final

    def cost(self, objective: str, nodes: int) -> Cost | None:
        """What the round's tuning cost so far against its start (:mod:`.cost`), the
        break-even at its final settings once it has them; None before the start was
        measured."""
        key = (len(self.trials), len(self.confirmations), self.final_journalled)
        if self._cost is not None and self._cost[0] == key:
            return self._cost[1]  # /metrics asks on every journal write, of every job
        entries = sorted(
            (t.to_journal() for t in (*self.trials, *self.confirmations)),
            key=lambda e: e["index"],
        )
        final = None
        if self.final_journalled and self.best is not None:
            final = {"settings": self.best[0], "score": self.best[1], "baseline": self.baseline}
        cost = round_cost(entries, final, objective, nodes)
        self._cost = (key, cost)
        return cost

    def final_entry(
        self, version: int, settings: dict[str, Any], spent: Cost | None
    ) -> dict[str, Any]:
        """The journal's entry for the round's final ``settings`` under ``version``: their
        score, the baseline, the confirmed gain and the round's cost where there are."""
        confirmed = self.confirmation.confirmed
        entry: dict[str, Any] = {
            "type": "final",
            "version": version,
            "settings": settings,
            "score": self.best[1] if self.best else None,
            "baseline": self.baseline,
        }
        if confirmed is not None:
            entry |= {
                "gain": confirmed.value,
                "gain_low": confirmed.low,
                "gain_high": confirmed.high,
                "better": confirmed.better,
            }
        if spent is not None:
            entry["cost"] = {
                "seconds": spent.seconds,
                "samples_lost": spent.lost,
                "samples_lost_ratio": spent.lost_ratio,
                "break_even_s": spent.break_even_s,
            }
        return entry
