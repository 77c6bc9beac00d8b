"""A job's trial records and its nodes' progress: the records its tuning keeps and journals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

REPORT_KEYS = ("throughput", "samples", "seconds", "energy_j", "windows")
"""What the journal keeps of each node's report (None where a report lacks one) ..."""
JOURNAL_REPORT_KEYS = (*REPORT_KEYS, "window_samples", "energy_windows")
"""... and, where a report has them, its samples and energy per window (the windows of an
early judgement against this trial, after a restart too)."""


@dataclass
class TrialRecord:
    """One finished trial of one job."""

    index: int
    version: int
    settings: dict[str, Any]
    score: float | None
    status: str
    """ok, aborted, stopped_early, infeasible, rejected, refused, no_ack, timeout, no_energy,
    nonfinite_loss, xid or lost_nodes."""
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    noise: float | None = None
    """Standard error of the score, from the spread of the measurement windows."""
    confirmation: bool = False
    """A re-measurement after tuning (the baseline or the best, interleaved), not a trial of
    the budget."""
    acks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The nodes' acks of its version (not journaled)."""
    nodes: tuple[str, ...] = ()
    """The nodes behind an outcome that is not a trial (refusing, silent, not measured)."""
    errors: dict[str, str] = field(default_factory=dict)
    """What refusing nodes said."""
    verdict: str | None = None
    """For a trial stopped early (``stopped_early``): ``worse`` or ``better`` than the
    incumbent, the best trial before it."""

    def to_journal(self) -> dict[str, Any]:
        reports = {
            node: {k: r.get(k) for k in JOURNAL_REPORT_KEYS if k in r or k in REPORT_KEYS}
            for node, r in self.reports.items()
        }
        return {
            "type": "trial",
            "index": self.index,
            "version": self.version,
            "settings": self.settings,
            "score": self.score,
            "status": self.status,
            "reports": reports,
            "seconds": self.seconds,
            "noise": self.noise,
            **({"confirmation": True} if self.confirmation else {}),
            **({"verdict": self.verdict} if self.verdict is not None else {}),
        }

    @classmethod
    def from_journal(cls, entry: dict[str, Any]) -> TrialRecord:
        return cls(
            entry["index"],
            entry["version"],
            entry["settings"],
            entry["score"],
            entry["status"],
            entry.get("reports", {}),
            entry.get("seconds", 0.0),
            entry.get("noise"),
            bool(entry.get("confirmation", False)),
            verdict=entry.get("verdict"),
        )


class Progress(NamedTuple):
    """A node's running totals of one job, from its telemetry."""

    samples: float
    """Samples, summed over the node's ranks."""
    step_s: float
    """Step seconds, summed over the node's ranks."""
    ts: float
    ranks: int = 1
    """How many ranks' steps the sums count (1 when the agent does not say)."""
