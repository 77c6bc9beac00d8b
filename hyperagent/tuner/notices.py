"""What a job's tuning tells its operator: the log and status lines of its moments. Pure.

Each method of :class:`Notices` gives the :class:`~hyperagent.tuner.events.Say` and
:class:`~hyperagent.tuner.events.Status` effects of one moment (a node out of scoring or back,
a pause, a retry that worked, the end), every line led by the job's name.
:class:`~hyperagent.tuner.tuning.JobTuning` decides when; the wording lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hyperagent.tuner import lifecycle
from hyperagent.tuner.cost import Cost
from hyperagent.tuner.events import Effect, Say, Status
from hyperagent.tuner.membership import Change


class Notices:
    """The lines of one job's tuning."""

    def __init__(self, job: str) -> None:
        self.job = job

    def line(self, level: int, text: str) -> Say:
        return Say(level, f"{self.job}: {text}")

    def status(self, text: str) -> Status:
        return Status(f"{self.job}: {text}")

    def changes(self, changes: Sequence[Change]) -> list[Effect]:
        """A node excluded from scoring (a warning) or back in it, and why."""
        out: list[Effect] = []
        for change in changes:
            if change.after is None:
                back = f"{change.why}; it was out: {change.before}"
                out.append(self.line(logging.INFO, f"node {change.node} is back ({back})"))
            else:
                why = f"{change.after}: {change.why}"
                text = f"node {change.node} excluded from scoring ({why})"
                out.append(self.line(logging.WARNING, text))
        return out

    def waiting(self, missing: str) -> list[Effect]:
        return [
            self.line(logging.WARNING, f"waiting for {missing}"),
            self.status(f"waiting for {missing}"),
        ]

    def paused(
        self, paused: lifecycle.Paused, errors: Mapping[str, str], delay_s: float
    ) -> list[Effect]:
        """A run could not be measured: why, which nodes (and what they said), when the
        same settings are tried again."""
        nodes = ", ".join(paused.nodes)
        said = "".join(f"; {n}: {e}" for n, e in errors.items())
        text = (
            f"paused ({paused.reason}: {nodes or 'no node answered'}{said}); "
            f"retrying the same settings in {delay_s:.0f}s, then with back-off"
        )
        status = f"paused, {paused.reason}: {nodes or 'no node'}"
        return [self.line(logging.WARNING, text), self.status(status)]

    def resumed_round(self, trials: int) -> Say:
        return self.line(logging.INFO, f"resumed {trials} trials")

    def starts_over(self) -> Say:
        """The journal's unfinished round does not fit the job as it is now."""
        return self.line(
            logging.WARNING,
            "the journal's round does not fit this job's space "
            "(objective, power limits, knobs or nodes changed); the tuning starts over",
        )

    def retuning(self) -> Say:
        return self.line(logging.WARNING, "throughput drifted below the tuned score; re-tuning")

    def resumed(self, paused: lifecycle.Paused) -> list[Effect]:
        attempts = paused.attempt + 1
        retries = f"{attempts} retr{'y' if attempts == 1 else 'ies'}"
        return [self.line(logging.INFO, f"resumed after {retries} ({paused.reason})")]

    def quorum_lost(self, lost: Mapping[str, str]) -> list[Effect]:
        out = ", ".join(f"{n} {why}" for n, why in sorted(lost.items()))
        text = f"fewer than half the nodes answer (out: {out}); waiting for them"
        return [self.line(logging.WARNING, text), self.status("paused, waiting for nodes")]

    def ended(self, reason: str, failed: bool) -> list[Effect]:
        what = "failed" if failed else "ended"
        level = logging.ERROR if failed else logging.INFO
        return [self.line(level, f"{what}: {reason}"), self.status(f"{what}, {reason}")]

    def rollback(self, why: str, good: Mapping[str, Any], gone: str, quiet: bool) -> Say:
        """Going back to the last good settings, or (``gone``: a rank died, the job is over
        or restarting) not."""
        level = logging.DEBUG if quiet else logging.WARNING
        if gone:
            return self.line(level, f"{why}; {gone}: not rolling back")
        return self.line(level, f"{why}; rolling back to {good}")

    def progress(
        self, confirmation: bool, done: int, budget: int, best: tuple[Any, float] | None
    ) -> Status:
        """How far the search (or the confirmations) got, and the best score so far."""
        what = "confirm" if confirmation else "trial"
        score = f"{best[1]:.4g}" if best else "none"
        return self.status(f"{what} {done}/{budget}, best {score}")

    def recommending(self, settings: Mapping[str, Any], why: str) -> list[Effect]:
        return [
            self.line(logging.INFO, f"recommend {settings} because {why}"),
            self.status(f"recommending {settings}"),
        ]

    def tuned(
        self,
        final: Mapping[str, Any],
        score: float | None,
        gain: float | None,
        spent: Cost | None,
    ) -> Say:
        cost = f"; {spent.describe()}" if spent else ""
        return self.line(logging.INFO, f"best {final} score {score} gain {gain}{cost}")
