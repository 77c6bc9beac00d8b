"""What a tuning cost the job, and how long its result takes to pay that back. Pure.

Every trial runs the job at settings other than its start for the trial's whole wall time
(publish to result: acks, settling and measuring). Against running the start for the same
time, a tuning loses (or gains) samples:

- throughput objective: ``lost = sum(start_rate * s_i - rate_i * s_i)`` over the trials'
  seconds ``s_i`` at their measured job throughputs ``rate_i``, as a fraction of
  ``start_rate * sum(s_i)`` (the samples the start would have trained in that time);
- energy objective: the same in joules: the samples the tuning's energy would have bought at
  the start's samples per joule, minus the samples it trained, as a fraction of the former.

A trial with nothing measured (refused by a node, a loss that went non-finite before a
window closed) counts as the start's, since the job went back to its last good settings.
Confirmations are part of the tuning and count too.

The break-even is the time at the chosen settings that wins the loss back: ``lost / (best -
start)`` in the objective's unit of resource (seconds, or joules turned into seconds at the
chosen settings' power); 0 when nothing was lost, None when the chosen settings are not better
than the start (the loss is never won back).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hyperagent.tuner.journal import JournalState


@dataclass(frozen=True)
class Span:
    """A stretch of the job's wall time at one trial's settings: ``seconds`` at a job
    throughput (samples/s) and GPU power (W); None for what was not measured."""

    seconds: float
    throughput: float | None
    power_w: float | None = None


@dataclass(frozen=True)
class Cost:
    """A tuning's cost against running the start for the same time."""

    objective: str
    seconds: float
    """The tuning's wall time (every trial's, confirmations included)."""
    start: float
    """The start's score: samples/s (throughput) or samples/J (energy)."""
    best: float | None
    """The chosen (or best so far) settings' score, in the same unit."""
    lost: float
    """Samples lost; negative when the tuning trained more than the start would have."""
    lost_ratio: float
    """``lost`` over the samples the start would have trained in the tuning's time (or for
    its energy)."""
    break_even_s: float | None
    """Seconds at ``best`` to win ``lost`` back: 0 when nothing was lost, None never."""
    unmeasured_s: float = 0.0
    """Seconds of trials with nothing measured (counted as the start's)."""

    def describe(self) -> str:
        """``lost 3.1% of 412 s (1.2e+04 samples), break-even 37 min``."""
        if self.break_even_s is None:
            even = "never breaks even"
        else:
            even = f"break-even {duration_text(self.break_even_s)}"
        return (
            f"lost {self.lost_ratio:.1%} of {duration_text(self.seconds)}"
            f" ({self.lost:.3g} samples), {even}"
        )


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``2.1 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def tuning_cost(
    spans: Iterable[Span],
    objective: str,
    start_score: float,
    best_score: float | None,
    start_power_w: float | None = None,
    best_power_w: float | None = None,
) -> Cost:
    """The cost of ``spans`` against the start, whose score is ``start_score`` (samples/s,
    or samples/J at ``start_power_w`` for energy); the break-even at ``best_score`` (for
    energy at ``best_power_w``, the start's when None). Raises ValueError for an unknown
    objective, a start score that is not positive, or (energy) a start without a power."""
    if objective not in ("throughput", "energy"):
        raise ValueError(f"unknown objective {objective!r}; choose throughput or energy")
    if not start_score > 0:
        raise ValueError(f"the start's score must be positive, got {start_score}")
    if objective == "energy" and not (start_power_w is not None and start_power_w > 0):
        raise ValueError("the start's power is not measured")
    start_w = start_power_w or 0.0
    seconds = unmeasured = resource = trained = 0.0
    for span in spans:
        seconds += span.seconds
        if objective == "throughput":
            used = span.seconds
            measured = span.throughput is not None
        else:
            measured = span.throughput is not None and span.power_w is not None
            used = (span.power_w or start_w if measured else start_w) * span.seconds
        resource += used
        if measured:
            assert span.throughput is not None
            trained += span.throughput * span.seconds
        else:
            unmeasured += span.seconds
            trained += start_score * used
    expected = start_score * resource
    lost = expected - trained
    ratio = lost / expected if expected > 0 else 0.0
    break_even: float | None
    if lost <= 0:
        break_even = 0.0
    elif best_score is None or best_score <= start_score:
        break_even = None
    else:
        break_even = lost / (best_score - start_score)
        if objective == "energy":
            break_even /= best_power_w or start_w
    return Cost(objective, seconds, start_score, best_score, lost, ratio, break_even, unmeasured)


def trial_span(entry: Mapping[str, Any], nodes: int | None = None) -> Span:
    """A journal ``trial`` entry as a span: its seconds, the job throughput of its nodes'
    reports (their sum scaled to ``nodes``, as :func:`hyperagent.tuner.trial.score` does) and
    their GPU power (None when a node has no energy reading)."""
    reports = [r for r in (entry.get("reports") or {}).values() if r]
    seconds = float(entry.get("seconds") or 0.0)
    rates = [r.get("throughput") for r in reports]
    if not reports or any(not isinstance(v, int | float) for v in rates):
        return Span(seconds, None)
    scale = (nodes or len(reports)) / len(reports)
    throughput = sum(float(v) for v in rates if v is not None) * scale
    powers = []
    for r in reports:
        energy, measured_s = r.get("energy_j"), r.get("seconds")
        if not isinstance(energy, int | float) or not measured_s:
            return Span(seconds, throughput)
        powers.append(float(energy) / float(measured_s))
    return Span(seconds, throughput, sum(powers) * scale)


def journal_cost(
    state: JournalState, objective: str | None = None, nodes: int | None = None
) -> Cost | None:
    """The cost of a journal's current round (see :func:`round_cost`); ``nodes``: the job's
    node count (the round's when None), ``objective`` as :func:`objective_of` says when None."""
    if nodes is None and state.start is not None:
        nodes = len(state.start.get("nodes") or []) or None
    return round_cost(state.trials, state.final, objective, nodes, state.start)


def round_cost(
    trials: Sequence[Mapping[str, Any]],
    final: Mapping[str, Any] | None,
    objective: str | None = None,
    nodes: int | None = None,
    start_entry: Mapping[str, Any] | None = None,
) -> Cost | None:
    """The cost of one round's journal ``trial`` entries (and its ``final`` entry, if any):
    its trials and confirmations so far against its start (trial 0), the break-even at its
    final settings once it has them (their confirmed score against the confirmed baseline),
    else at the best trial so far. None before the start was measured, or for energy without
    the start's energy reading."""
    first = _first(trials)
    if first is None or first.get("status") != "ok" or first.get("score") is None:
        return None
    objective = objective or objective_of(trials, start_entry, nodes)
    start = trial_span(first, nodes)
    if objective == "energy" and start.power_w is None:
        return None
    start_score = float(first["score"])
    best_score, best_settings = _best(final, trials)
    if final is not None and final.get("baseline") is not None:
        start_score = float(final["baseline"])
    if not start_score > 0:
        return None
    power = _power_at(trials, best_settings, nodes)
    spans = [trial_span(t, nodes) for t in trials]
    return tuning_cost(spans, objective, start_score, best_score, start.power_w, power)


def objective_of(
    trials: Sequence[Mapping[str, Any]],
    start_entry: Mapping[str, Any] | None = None,
    nodes: int | None = None,
) -> str:
    """The round's objective: its ``start`` entry's ``objective``, else what trial 0's score
    is (the job's throughput from its reports: throughput; else energy)."""
    if start_entry is not None and start_entry.get("objective") in ("throughput", "energy"):
        return str(start_entry["objective"])
    first = _first(trials)
    if first is None or first.get("score") is None:
        return "throughput"
    rate = trial_span(first, nodes).throughput
    score = float(first["score"])
    if rate is not None and abs(rate - score) <= 1e-6 * max(abs(score), 1.0):
        return "throughput"
    return "energy" if trial_span(first, nodes).power_w is not None else "throughput"


def _first(trials: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """Trial 0: the start."""
    return next((t for t in trials if t.get("index") == 0 and not t.get("confirmation")), None)


def _best(
    final: Mapping[str, Any] | None, trials: Sequence[Mapping[str, Any]]
) -> tuple[float | None, Mapping[str, Any] | None]:
    if final is not None and final.get("score") is not None:
        return float(final["score"]), final.get("settings")
    scored = [t for t in trials if t.get("status") == "ok" and t.get("score") is not None]
    if not scored:
        return None, None
    best = max(scored, key=lambda t: float(t["score"]))
    return float(best["score"]), best.get("settings")


def _power_at(
    trials: Sequence[Mapping[str, Any]], settings: Mapping[str, Any] | None, nodes: int | None
) -> float | None:
    powers = [
        span.power_w
        for t in trials
        if settings is not None
        and t.get("settings") == settings
        and (span := trial_span(t, nodes)).power_w is not None
    ]
    return sum(p for p in powers if p is not None) / len(powers) if powers else None
