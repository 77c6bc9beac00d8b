"""A picture of one job's tuning, drawn from its journal: ``hyperagent report JOURNAL --out F``.

The journal (see :mod:`hyperagent.tuner.journal`) is read, never written: a torn last line of a
journal that a coordinator is still writing is left out, as the coordinator itself would cut it
off, and only the last round of tuning (after the last ``start`` entry) is drawn. The figure
shows each trial's score coloured by outcome (``ok``, ``aborted``, ``stopped_early``: a search
trial whose measurement stopped once it was judged worse or better than the best before it,
and every other status as failed, drawn on the lower edge because it has no score), the best
score so far, the baseline (trial 0, the starting settings) as a line, and one small panel per
knob with the value each trial tried and the chosen value. The title names the chosen settings
(the ``final`` entry's, or while tuning runs the best measured ones) and their gain over the
baseline.

``.png`` writes the figure; ``.html`` writes a self-contained page embedding it (base64) above a
table of the trials. Matplotlib draws with its Agg canvas, without pyplot's global state.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from hyperagent import durable
from hyperagent.errors import HyperagentError
from hyperagent.tuner.cost import Cost, round_cost
from hyperagent.tuner.space import KNOBS
from hyperagent.tuner.trial import interval_text

SCORED_STATUSES = ("ok", "aborted", "stopped_early")
STATUS_COLOURS = {
    "ok": "tab:blue",
    "aborted": "tab:orange",
    "stopped_early": "tab:olive",
    "failed": "tab:red",
}
CHOSEN_COLOUR = "tab:purple"
KNOB_LABELS = {
    "bucket_mb": "bucket (MiB)",
    "chunk_kb": "chunk (KiB)",
    "power_cap_w": "power cap (W)",
    "allreduce": "allreduce",
}
LOG2_KNOBS = ("bucket_mb", "chunk_kb")
OUTPUT_SUFFIXES = (".png", ".html")
DPI = 100
WIDTH_IN = 10.0


class ReportError(HyperagentError):
    """A journal that cannot be drawn, or an output that cannot be written; names the file
    (and the line, for a bad journal entry)."""


@dataclass(frozen=True)
class Trial:
    """One finished trial as the journal records it."""

    index: int
    version: int | None
    settings: dict[str, Any]
    score: float | None
    status: str
    seconds: float | None
    confirmation: bool = False
    """A re-measurement of the baseline or the best settings after the trial budget."""
    verdict: str | None = None
    """A trial stopped early: ``worse`` or ``better`` than the best before it."""

    @property
    def outcome(self) -> str:
        """``ok``, ``aborted``, ``stopped_early`` or ``failed`` (every other status): the
        colour it is drawn in."""
        return self.status if self.status in SCORED_STATUSES else "failed"


@dataclass(frozen=True)
class ReportSummary:
    """What the report shows, in numbers."""

    journal: Path
    out: Path
    job: str
    trials: int
    statuses: dict[str, int]
    """Trials per journal status (ok, aborted, no_ack, ...)."""
    finished: bool
    """True when the journal has a ``final`` entry for this round."""
    baseline: float | None
    """Trial 0's score (the starting settings), or the final entry's baseline."""
    best: float | None
    """The final entry's score, or while tuning runs the best ``ok`` score."""
    chosen: dict[str, Any] | None
    """The final settings, or while tuning runs the best measured ones."""
    gain: float | None
    """``best / baseline - 1``; None without both. Once confirmed, both were measured the same
    way (interleaved re-measurements), and it is 0 when no setting was better."""
    knobs: tuple[str, ...] = field(default=())
    in_flight: int | None = None
    """The index of a trial published but not finished yet."""
    confirmations: int = 0
    """Re-measurements of the baseline and the best settings after the trial budget."""
    interval: tuple[float, float] | None = None
    """The confirmed gain's interval (the best trial's, also when it was no better)."""
    candidate_gain: float | None = None
    """The best trial's confirmed gain, also when its interval reached zero or below."""
    cost: Cost | None = None
    """What the tuning cost the job against its start, and its break-even (None before the
    start was measured)."""

    def outcome(self) -> str:
        """The gain in words: with its interval once confirmed, or that no setting was better."""
        if self.interval is not None and self.candidate_gain is not None:
            text = interval_text(*self.interval)
            if self.interval[0] > 0:
                gain = f"gain {self.candidate_gain:+.1%} ({text})"
                return f"{gain} over the starting settings, confirmed"
            return (
                "no setting was better than the starting settings (the best candidate "
                f"measured {self.candidate_gain:+.1%}, {text})"
            )
        if self.gain is None:
            return "no gain yet (no baseline)"
        return f"gain {self.gain:+.1%} over the starting settings, not confirmed"


@dataclass
class _Round:
    job: str
    trials: list[Trial] = field(default_factory=list)
    final: dict[str, Any] | None = None
    in_flight: int | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    """The round's trial entries as journaled (for its cost)."""
    start: dict[str, Any] | None = None


def _number(entry: Mapping[str, Any], key: str, optional: bool = False) -> float | None:
    value = entry.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{key!r} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{key!r} must be finite, got {value!r}")
    return number


def _integer(entry: Mapping[str, Any], key: str, optional: bool = False) -> int | None:
    value = entry.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {value!r}")
    return value


def _settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    settings = entry.get("settings")
    if not isinstance(settings, dict):
        raise ValueError(f"'settings' must be an object, got {settings!r}")
    for knob, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real | str | None):
            raise ValueError(f"setting {knob!r} must be a number or a name, got {value!r}")
    return settings


def _trial(entry: Mapping[str, Any]) -> Trial:
    status = entry.get("status")
    if not isinstance(status, str) or not status:
        raise ValueError(f"'status' must be a non-empty string, got {status!r}")
    index = _integer(entry, "index")
    assert index is not None
    if index < 0:
        raise ValueError(f"'index' must be >= 0, got {index}")
    return Trial(
        index=index,
        version=_integer(entry, "version", optional=True),
        settings=_settings(entry),
        score=_number(entry, "score", optional=True),
        status=status,
        seconds=_number(entry, "seconds", optional=True),
        confirmation=entry.get("confirmation") is True,
        verdict=entry["verdict"] if isinstance(entry.get("verdict"), str) else None,
    )


def _apply(state: _Round, entry: object) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"expected a JSON object, got {type(entry).__name__}")
    kind = entry.get("type")
    if kind == "start":
        state.trials, state.final, state.in_flight = [], None, None
        state.entries, state.start = [], entry
        if isinstance(entry.get("job"), str):
            state.job = entry["job"]
    elif kind == "published":
        _integer(entry, "version")
        _settings(entry)
        trial = _integer(entry, "trial", optional=True)
        state.in_flight = trial
    elif kind == "trial":
        trial_ = _trial(entry)
        if any(t.index == trial_.index for t in state.trials):
            raise ValueError(f"trial {trial_.index} recorded twice")
        state.trials.append(trial_)
        state.entries.append(entry)
        if state.in_flight == trial_.index:
            state.in_flight = None
    elif kind in ("paused", "confirm", "ended"):
        pass  # a run that was not a trial; the confirmations' order; the job ended
    elif kind == "final":
        _settings(entry)
        _number(entry, "score", optional=True)
        _number(entry, "baseline", optional=True)
        for key in ("gain", "gain_low", "gain_high"):
            _number(entry, key, optional=True)
        state.final, state.in_flight = dict(entry), None
    else:
        raise ValueError(f"unknown entry type {kind!r}")


def read_journal(path: Path) -> tuple[str, list[Trial], dict[str, Any] | None, int | None]:
    """(job, trials, final entry or None, in-flight trial index or None) of the journal's last
    round, with the entries this process appended written first. Raises ReportError naming the
    file, and the line for a bad entry."""
    state = _read_round(path)
    return state.job, state.trials, state.final, state.in_flight


def _read_round(path: Path) -> _Round:
    durable.wait()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such journal file") from None
    except OSError as e:
        raise ReportError(f"{path}: cannot read the journal: {e.strerror}") from e
    if not data.strip():
        raise ReportError(f"{path}: the journal is empty")
    state = _Round(job=path.stem)
    lines = data.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            _apply(state, orjson.loads(line))
        except (orjson.JSONDecodeError, ValueError) as e:
            torn = number == len(lines) and not line.endswith(b"\n")
            if torn and isinstance(e, orjson.JSONDecodeError):
                break  # being written right now, or cut by a crash: the coordinator drops it
            raise ReportError(f"{path}:{number}: not a journal entry: {e}") from None
    if not state.trials:
        raise ReportError(f"{path}: the journal has no finished trial to draw yet")
    return state


def _summarise(
    journal: Path,
    out: Path,
    job: str,
    trials: Sequence[Trial],
    final: Mapping[str, Any] | None,
    in_flight: int | None,
) -> ReportSummary:
    first = next((t for t in trials if t.index == 0), None)
    baseline = first.score if first is not None and first.status == "ok" else None
    measured = [
        t for t in trials if t.status == "ok" and t.score is not None and not t.confirmation
    ]
    top = max(measured, key=lambda t: t.score or 0.0) if measured else None
    if final is not None:
        if final.get("baseline") is not None:
            baseline = float(final["baseline"])
        best = float(final["score"]) if final.get("score") is not None else None
        chosen: dict[str, Any] | None = dict(final["settings"])
    else:
        best = top.score if top is not None else None
        chosen = dict(top.settings) if top is not None else None
    gain = best / baseline - 1 if best is not None and baseline else None
    interval, candidate = None, None
    if final is not None and final.get("gain_low") is not None:
        interval = (float(final["gain_low"]), float(final["gain_high"]))
        candidate = float(final["gain"])
    present = {k for t in trials for k in t.settings}
    knobs = tuple(k for k in KNOBS if k in present) + tuple(sorted(present - set(KNOBS)))
    return ReportSummary(
        journal=journal,
        out=out,
        job=job,
        trials=sum(not t.confirmation for t in trials),
        statuses=dict(sorted(Counter(t.status for t in trials).items())),
        finished=final is not None,
        baseline=baseline,
        best=best,
        chosen=chosen,
        gain=gain,
        knobs=knobs,
        in_flight=in_flight,
        confirmations=sum(t.confirmation for t in trials),
        interval=interval,
        candidate_gain=candidate,
    )


def describe_settings(settings: Mapping[str, Any]) -> str:
    """Settings in words: ``bucket 64 MiB, chunk 8192 KiB, cap 250 W, ring``."""
    units = {
        "bucket_mb": ("bucket", "MiB"),
        "chunk_kb": ("chunk", "KiB"),
        "power_cap_w": ("cap", "W"),
    }
    parts = []
    for knob in (*[k for k in KNOBS if k in settings], *sorted(set(settings) - set(KNOBS))):
        value = settings[knob]
        if knob in units and value is not None:
            name, unit = units[knob]
            parts.append(
                f"{name} {value:g} {unit}" if isinstance(value, float) else f"{name} {value} {unit}"
            )
        elif knob == "allreduce":
            parts.append(str(value))
        else:
            parts.append(f"{knob} {value}")
    return ", ".join(parts)


def _title(summary: ReportSummary) -> str:
    state = "finished" if summary.finished else "running"
    head = f"{summary.job}: {summary.trials} trials, {state}"
    if summary.in_flight is not None:
        head += f" (trial {summary.in_flight} in flight)"
    if summary.chosen is None:
        return f"{head}\nno successful trial yet"
    word = "chosen" if summary.finished else "best so far"
    best = f"{summary.best:.4g}" if summary.best is not None else "-"
    text = f"{head}\n{word}: {describe_settings(summary.chosen)}, score {best}\n{summary.outcome()}"
    if summary.cost is not None:
        text += f"\ncost: {summary.cost.describe()}"
    return text


def _draw_scores(ax: Axes, trials: Sequence[Trial], summary: ReportSummary) -> None:
    scored = [t for t in trials if t.score is not None]
    values = [t.score for t in scored if t.score is not None]
    if summary.baseline is not None:
        values.append(summary.baseline)
    if summary.best is not None:
        values.append(summary.best)
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (high - low) * 0.08 or abs(high) * 0.05 or 1.0
    floor = low - pad
    for outcome, colour in STATUS_COLOURS.items():
        group = [t for t in trials if t.outcome == outcome]
        if not group:
            continue
        xs = [t.index for t in group]
        ys = [t.score if t.score is not None else floor for t in group]
        marker = "x" if outcome == "failed" else "o"
        ax.scatter(xs, ys, c=colour, marker=marker, s=28, label=outcome, zorder=3)
    best_x: list[int] = []
    best_y: list[float] = []
    running: float | None = None
    for t in sorted(trials, key=lambda t: t.index):
        if t.score is not None and (t.status == "ok" or t.verdict == "better"):
            running = t.score if running is None else max(running, t.score)
        if running is not None:
            best_x.append(t.index)
            best_y.append(running)
    if best_x:
        ax.step(best_x, best_y, where="post", color="tab:green", label="best so far", zorder=2)
    if summary.baseline is not None:
        ax.axhline(summary.baseline, color="grey", linestyle="--", label="baseline (trial 0)")
    ax.set_ylim(floor - pad * 0.5, high + pad)
    ax.set_ylabel("score (higher is better)")
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color=CHOSEN_COLOUR, linewidth=1.2, label="chosen value"))
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncols=len(handles),
        fontsize="small",
        frameon=False,
    )


def _draw_knob(
    ax: Axes, knob: str, trials: Sequence[Trial], chosen: Mapping[str, Any] | None
) -> None:
    tried = [
        (t.index, t.settings[knob], t.outcome) for t in trials if t.settings.get(knob) is not None
    ]
    numeric = all(isinstance(v, numbers.Real) for _, v, _ in tried)
    names: list[str] = []
    if not numeric:
        names = sorted({str(v) for _, v, _ in tried})

    def position(value: Any) -> float:
        return float(value) if numeric else float(names.index(str(value)))

    for outcome, colour in STATUS_COLOURS.items():
        points = [(i, position(v)) for i, v, o in tried if o == outcome]
        if points:
            xs, ys = zip(*points, strict=True)
            marker = "x" if outcome == "failed" else "o"
            ax.scatter(xs, ys, c=colour, marker=marker, s=14, zorder=3)
    if (
        chosen is not None
        and chosen.get(knob) is not None
        and (numeric or str(chosen[knob]) in names)
    ):
        ax.axhline(position(chosen[knob]), color=CHOSEN_COLOUR, linewidth=1.2)
    if numeric and knob in LOG2_KNOBS:
        ax.set_yscale("log", base=2)
    if not numeric:
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(-0.5, len(names) - 0.5)
    ax.set_ylabel(KNOB_LABELS.get(knob, knob), fontsize="small")
    ax.tick_params(labelsize="small")
    ax.grid(True, alpha=0.3)


def draw(trials: Sequence[Trial], summary: ReportSummary) -> Figure:
    """The report's figure: scores on top, one panel per knob below, sharing the trial axis."""
    panels = len(summary.knobs)
    height = 4.5 + 1.4 * panels
    figure = Figure(figsize=(WIDTH_IN, height), dpi=DPI)
    ratios = [3.0] + [1.0] * panels
    margins = {
        "left": 1.5 / WIDTH_IN,
        "right": 1 - 0.25 / WIDTH_IN,
        "top": 1 - 1.05 / height,
        "bottom": 0.55 / height,
        "hspace": 0.12,
    }
    grid = figure.add_gridspec(panels + 1, 1, height_ratios=ratios, **margins)
    axes = grid.subplots(sharex=True, squeeze=False)[:, 0]
    _draw_scores(axes[0], trials, summary)
    for ax, knob in zip(axes[1:], summary.knobs, strict=True):
        _draw_knob(ax, knob, trials, summary.chosen)
    axes[-1].set_xlabel("trial")
    figure.suptitle(_title(summary), fontsize="medium", y=1 - 0.1 / height, va="top")
    return figure


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _html(png: bytes, trials: Sequence[Trial], summary: ReportSummary) -> str:
    title = html.escape(_title(summary)).replace("\n", "<br>")
    heads = ["trial", "version", "status", "score", *summary.knobs, "seconds"]
    rows = []
    for t in sorted(trials, key=lambda t: t.index):
        status = f"{t.status} (confirmation)" if t.confirmation else t.status
        if t.verdict is not None:
            status = f"{status} ({t.verdict})"
        cells = [t.index, t.version, status, t.score, *(t.settings.get(k) for k in summary.knobs)]
        cells.append(t.seconds)
        row = "".join(f"<td>{_cell(c)}</td>" for c in cells)
        rows.append(f'<tr class="{t.outcome}">{row}</tr>')
    header = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    image = base64.b64encode(png).decode("ascii")
    source = html.escape(str(summary.journal))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>hyperagent report: {html.escape(summary.job)}</title>\n"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "tr.aborted{background:#fff3e0}tr.stopped_early{background:#f4f6e0}"
        "tr.failed{background:#fdecea}</style>\n"
        "</head>\n<body>\n"
        f"<h1>{title}</h1>\n<p>From <code>{source}</code>.</p>\n"
        f'<img alt="scores and settings per trial" src="data:image/png;base64,{image}">\n'
        f"<table>\n<thead><tr>{header}</tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody>\n</table>\n</body>\n</html>\n"
    )


def render_report(journal_path: Path, out: Path) -> ReportSummary:
    """Draw the tuning recorded in ``journal_path`` into ``out`` (``.png``, or ``.html`` for a
    self-contained page with the picture and a table of trials); return its summary.

    Raises ReportError for a missing, empty or corrupt journal (naming the file and line), a
    journal without a finished trial, an unknown output suffix, or an output that cannot be
    written.
    """
    suffix = out.suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise ReportError(
            f"{out}: the report is written as .png or .html, not {suffix or 'no suffix'!r}"
        )
    state = _read_round(journal_path)
    job, trials, final, in_flight = state.job, state.trials, state.final, state.in_flight
    summary = _summarise(journal_path, out, job, trials, final, in_flight)
    nodes = len((state.start or {}).get("nodes") or []) or None
    try:
        cost = round_cost(state.entries, final, nodes=nodes, start_entry=state.start)
    except (TypeError, ValueError, AttributeError):
        cost = None  # a hand-written or older journal without the reports' fields
    summary = dataclasses.replace(summary, cost=cost)
    png = _png(draw(trials, summary))
    data = png if suffix == ".png" else _html(png, trials, summary).encode("utf-8")
    try:
        out.write_bytes(data)
    except OSError as e:
        raise ReportError(f"{out}: cannot write the report: {e.strerror}") from e
    return summary
