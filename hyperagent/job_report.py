"""A jobstats-like report of one job from Prometheus:
``hyperagent report --job ID --prometheus URL [--out F.png] [--since 7d | --start T --end T]``.

Every job holding GPUs has the agent's per-job series (``hyperagent_job_gpus``,
``hyperagent_job_gpu_*``, labelled ``job_id``, ``user``, ``slurm_job``, ``slurm_step``) and
``hyperagent_gpu_job_info`` per GPU it holds, whether it reports steps or was found from the
scheduler. The report finds the job's first and last sample of ``hyperagent_job_gpus`` in the
range (coarsely, then from the raw samples at both ends: a job is found however short), then
reads every series with ``query_range`` over that span, each point half a step after a sample
and the last raw sample of the step before it (``last_over_time(x[step])``): no point outlives
the job by Prometheus' five-minute lookback, a sample is neither missed nor counted twice for
the scrapes' jitter, and a counter's points telescope to its exact increase. The step is the
scrape interval, or coarser so that no series has more than :data:`MAX_POINTS` points.

Figures: the user and Slurm job, nodes, GPUs held and GPU-hours (the count integrated over
time), utilisation mean and 10th percentile for the job (GPUs weighted by node) and for each
GPU, the time the job's mean stayed below :data:`LOW_UTILIZATION`, the peak memory used, the
GPUs' energy in kWh (from ``hyperagent_job_gpu_energy_joules_total``: its increase, plus its
first value when the job began inside the range, the counter starting with the job) and J per
sample where the job reports samples. The picture (PNG, Matplotlib's Agg canvas) draws
utilisation, memory and power with the energy used so far, over time.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib.dates as mdates
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from hyperagent.errors import HyperagentError

LOW_UTILIZATION = 0.10
"""Below this mean utilisation the job's GPUs count as idle (as HyperagentJobGpusIdle)."""
LEGEND_GPUS = 16
"""GPUs named in the picture's legend at most (more: the job's mean alone)."""
MAX_POINTS = 10_000
"""Points per series at most (Prometheus refuses more than 11 000)."""
DEFAULT_SINCE_S = 7 * 86400.0
FIND_POINTS = 1000
"""Points at most of the first look for a job's span."""
DEFAULT_INTERVAL_S = 15.0
"""The scrape interval assumed for a job seen once (rules/prometheus.yml's)."""
TIMEOUT_S = 30.0
GIB = 1024**3
JOULES_PER_KWH = 3.6e6
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


class JobReportError(HyperagentError):
    """Why a job's report cannot be made: Prometheus unreachable or refusing a query, a job it
    has no series of, a range without samples, a picture that cannot be written."""


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration (``90s``, ``30m``, ``1h30m``, ``7d``)."""
    parts = _DURATION.findall(text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"{text!r} is no duration (like 30m, 6h, 7d, 1h30m)")
    return sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def parse_time(text: str) -> float:
    """Unix seconds from Unix seconds or an RFC 3339 / ISO 8601 time (UTC unless it says)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as e:
        raise ValueError(f"{text!r} is no time (Unix seconds or 2026-12-04T18:00:00Z)") from e
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


@dataclass(frozen=True)
class Series:
    """One series of a query: its labels and its points (Unix seconds, value)."""

    labels: Mapping[str, str]
    times: tuple[float, ...]
    values: tuple[float, ...]


class PrometheusApi:
    """The few calls of Prometheus' HTTP API the report makes (``/api/v1/query``,
    ``query_range``, ``series``); every failure is a :class:`JobReportError` naming the URL."""

    def __init__(self, url: str, timeout_s: float = TIMEOUT_S) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise JobReportError(f"--prometheus {url!r}: not an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: Sequence[tuple[str, str]]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                reason = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                reason = f"HTTP {e.code} {e.reason}"
            raise JobReportError(f"Prometheus at {self.url} refused {path}: {reason}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise JobReportError(f"cannot reach Prometheus at {self.url}: {reason}") from e
        try:
            body = json.loads(raw)
            status, data = body["status"], body.get("data")
        except (ValueError, KeyError, TypeError) as e:
            raise JobReportError(
                f"{self.url}{path} answered no Prometheus API response: {raw[:80]!r}"
            ) from e
        if status != "success":
            raise JobReportError(f"Prometheus at {self.url}: {body.get('error', status)}")
        return data

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        """``expr`` evaluated every ``step`` seconds from ``start`` to ``end``."""
        data = self._get(
            "/api/v1/query_range",
            [
                ("query", expr),
                ("start", f"{start:.3f}"),
                ("end", f"{end:.3f}"),
                ("step", f"{step:.3f}"),
            ],
        )
        return [_series(item) for item in data["result"]]

    def raw(self, selector: str, end: float, range_s: float) -> list[Series]:
        """The raw samples of ``selector`` in (end - range_s, end]."""
        data = self._get(
            "/api/v1/query",
            [("query", f"{selector}[{max(1, math.ceil(range_s))}s]"), ("time", f"{end:.3f}")],
        )
        return [_series(item) for item in data["result"]]

    def series_exist(self, selector: str) -> bool:
        """Whether the TSDB holds any series of ``selector``, at any time."""
        return bool(self._get("/api/v1/series", [("match[]", selector)]))


def _series(item: Mapping[str, Any]) -> Series:
    points = item.get("values") or []
    return Series(
        labels=dict(item["metric"]),
        times=tuple(float(t) for t, _ in points),
        values=tuple(float(v) for _, v in points),
    )


@dataclass(frozen=True)
class GpuStats:
    """One GPU the job held."""

    instance: str
    gpu: str
    uuid: str
    mean: float | None
    p10: float | None
    low_fraction: float | None
    """Share of the GPU's points below :data:`LOW_UTILIZATION`."""
    memory_peak_bytes: float | None


@dataclass(frozen=True)
class Timeline:
    """What the picture draws: the job's points over time."""

    times: tuple[float, ...]
    utilization: tuple[float | None, ...]
    """The job's mean utilisation at each point (its GPUs weighted by node)."""
    gpu_utilization: Mapping[str, Series]
    gpu_memory_bytes: Mapping[str, Series]
    """Per GPU (``instance GPU n``)."""
    gpu_power_watts: tuple[float | None, ...]
    node_power_watts: tuple[float | None, ...]
    energy_joules: tuple[float | None, ...]
    """GPU energy used since the start of the report, at each point."""


@dataclass(frozen=True)
class JobReport:
    """The report's figures, in base units."""

    job_id: str
    prometheus: str
    user: str
    slurm_job: str
    slurm_step: str
    clusters: tuple[str, ...]
    nodes: tuple[str, ...]
    start: float
    """The job's first sample in the range (Unix seconds)."""
    end: float
    step_s: float
    gpus: int
    """The most GPUs the job held at once, all nodes."""
    gpu_hours: float
    mean_utilization: float | None
    p10_utilization: float | None
    low_seconds: float | None
    """Time the job's mean utilisation stayed below :data:`LOW_UTILIZATION`."""
    memory_peak_bytes: float | None
    """The most memory its GPUs used at once, all nodes."""
    energy_joules: float | None
    samples: float | None
    per_gpu: tuple[GpuStats, ...]
    timeline: Timeline

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def energy_kwh(self) -> float | None:
        return None if self.energy_joules is None else self.energy_joules / JOULES_PER_KWH

    @property
    def joules_per_sample(self) -> float | None:
        if self.energy_joules is None or not self.samples:
            return None
        return self.energy_joules / self.samples

    def text(self) -> str:
        """The summary as printed: one figure a line, then a table of the GPUs."""
        who = [f"user {self.user or '?'}"]
        if self.slurm_job:
            step = f" step {self.slurm_step}" if self.slurm_step else ""
            who.append(f"Slurm job {self.slurm_job}{step}")
        low = "?"
        if self.low_seconds is not None and self.seconds > 0:
            low = f"{_duration(self.low_seconds)} ({self.low_seconds / self.seconds:.1%})"
        kwh = self.energy_kwh
        energy = (
            "not exported" if kwh is None else f"{kwh:.3f} kWh" if kwh >= 0.1 else f"{kwh:.3g} kWh"
        )
        if self.joules_per_sample is not None:
            energy += f", {self.joules_per_sample:.4g} J per sample ({self.samples:.0f} samples)"
        lines = [
            f"Job {self.job_id}: {', '.join(who)}",
            f"  cluster:       {', '.join(self.clusters) or '-'}",
            f"  nodes:         {', '.join(self.nodes)}",
            f"  time:          {_when(self.start)} to {_when(self.end)}"
            f" ({_duration(self.seconds)}, every {self.step_s:g} s)",
            f"  GPUs:          {self.gpus} ({self.gpu_hours:.2f} GPU-hours)",
            f"  utilisation:   mean {_percent(self.mean_utilization)},"
            f" p10 {_percent(self.p10_utilization)}",
            f"  below {LOW_UTILIZATION:.0%}:     {low}",
            f"  memory peak:   {_gib(self.memory_peak_bytes)} (all GPUs)",
            f"  GPU energy:    {energy}",
            "  per GPU:",
            f"    {'node':<24} {'GPU':>4} {'uuid':<42} {'mean':>7} {'p10':>7}"
            f" {'<' + format(LOW_UTILIZATION, '.0%'):>7} {'memory peak':>12}",
        ]
        for g in self.per_gpu:
            lines.append(
                f"    {g.instance:<24} {g.gpu:>4} {g.uuid:<42} {_percent(g.mean):>7}"
                f" {_percent(g.p10):>7} {_percent(g.low_fraction):>7}"
                f" {_gib(g.memory_peak_bytes):>12}"
            )
        return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{value:.1%}"


def _gib(value: float | None) -> str:
    return "?" if value is None else f"{value / GIB:.1f} GiB"


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _selector(job_id: str, cluster: str | None) -> str:
    labels = [f"job_id={json.dumps(job_id)}"]
    if cluster:
        labels.append(f"cluster={json.dumps(cluster)}")
    return "{" + ", ".join(labels) + "}"


def _p10(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, 10)) if values else None


def counter_so_far(values: Sequence[float], from_zero: bool) -> list[float]:
    """A counter's increase up to each of its points, resets counted as restarts from zero;
    with ``from_zero`` the first value counts too (the counter began with the range)."""
    total = values[0] if from_zero and values else 0.0
    out = [total] if values else []
    for before, after in itertools.pairwise(values):
        total += after - before if after >= before else after
        out.append(total)
    return out


def counter_increase(values: Sequence[float], from_zero: bool) -> float:
    """A counter's increase over its points (see :func:`counter_so_far`)."""
    so_far = counter_so_far(values, from_zero)
    return so_far[-1] if so_far else 0.0


def _on_grid(series: Sequence[Series], grid: Sequence[float]) -> list[list[float | None]]:
    """Each series' value at each grid time (None where it has no point)."""
    index = {t: i for i, t in enumerate(grid)}
    out: list[list[float | None]] = []
    for s in series:
        row: list[float | None] = [None] * len(grid)
        for t, v in zip(s.times, s.values, strict=True):
            if t in index:
                row[index[t]] = v
        out.append(row)
    return out


def _sum_points(rows: Sequence[Sequence[float | None]], width: int) -> list[float | None]:
    sums: list[float | None] = []
    for i in range(width):
        present = [row[i] for row in rows if row[i] is not None]
        sums.append(sum(v for v in present if v is not None) if present else None)
    return sums


def _trapezoid(times: Sequence[float], values: Sequence[float | None], gap_s: float) -> float:
    """The integral of ``values`` over time, between neighbouring points no further apart than
    ``gap_s`` (a longer gap: the job held nothing there)."""
    total = 0.0
    points = zip(times, values, strict=True)
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if v0 is not None and v1 is not None and t1 - t0 <= gap_s:
            total += (v0 + v1) / 2 * (t1 - t0)
    return total


def _since(series: Series, first: float) -> Series:
    """``series`` without its points before ``first``."""
    keep = [i for i, t in enumerate(series.times) if t >= first]
    if len(keep) == len(series.times):
        return series
    return Series(
        series.labels,
        tuple(series.times[i] for i in keep),
        tuple(series.values[i] for i in keep),
    )


def _node(series: Series) -> str:
    return series.labels.get("instance", "")


def _gpu_key(labels: Mapping[str, str]) -> tuple[str, str, str]:
    return (labels.get("instance", ""), labels.get("gpu", ""), labels.get("uuid", ""))


def _gpu_sort(key: tuple[str, str, str]) -> tuple[str, int, str, str]:
    instance, gpu, uuid = key
    return (instance, int(gpu) if gpu.isdigit() else -1, gpu, uuid)


def _weighted_utilization(
    gpus: Sequence[Series],
    gpus_rows: Sequence[Sequence[float | None]],
    utilization: Sequence[Series],
    grid: Sequence[float],
) -> list[float | None]:
    """The job's mean utilisation at each grid point: each node's mean weighted by the GPUs
    the job holds there."""
    rows = dict(zip((_node(s) for s in utilization), _on_grid(utilization, grid), strict=True))
    out: list[float | None] = []
    for i in range(len(grid)):
        num = den = 0.0
        for g_series, g_row in zip(gpus, gpus_rows, strict=True):
            u_row, held_here = rows.get(_node(g_series)), g_row[i]
            if u_row is not None and held_here is not None and (u := u_row[i]) is not None:
                num, den = num + u * held_here, den + held_here
        out.append(num / den if den > 0 else None)
    return out


def _gpu_stats(
    key: tuple[str, str, str], utilization: Series | None, memory: Series | None
) -> GpuStats:
    values = list(utilization.values) if utilization is not None else []
    used = memory.values if memory is not None else ()
    return GpuStats(
        instance=key[0],
        gpu=key[1],
        uuid=key[2],
        mean=statistics.fmean(values) if values else None,
        p10=_p10(values),
        low_fraction=sum(v < LOW_UTILIZATION for v in values) / len(values) if values else None,
        memory_peak_bytes=max(used) if used else None,
    )


def _span(
    api: PrometheusApi, selector: str, start: float, end: float
) -> tuple[list[Series], float, float, float]:
    """The series of ``selector`` above 0 in (start, end], its first and last raw sample
    above 0 and its scrape interval: where it is, from at most :data:`FIND_POINTS` points,
    then exactly, from the raw samples around the first and the last. (An ended job's
    ``hyperagent_job_gpus`` is 0 until its series are released.)"""
    coarse = float(max(60, math.ceil((end - start) / FIND_POINTS)))
    n = math.floor((end - start) / coarse)  # the first window reaches back before start
    found = [
        s
        for s in api.query_range(
            f"max_over_time({selector}[{coarse:.0f}s]) > 0", end - n * coarse, end, coarse
        )
        if s.times
    ]
    if not found:
        return [], 0.0, 0.0, 0.0
    first_point = min(s.times[0] for s in found)
    last_point = max(s.times[-1] for s in found)
    head = api.raw(selector, first_point, max(0.0, min(coarse, first_point - start)))
    tail = api.raw(selector, last_point, coarse)
    first = min(
        (t for s in head for t, v in zip(s.times, s.values, strict=True) if v > 0),
        default=first_point,
    )
    last = max(
        (t for s in tail for t, v in zip(s.times, s.values, strict=True) if v > 0),
        default=last_point,
    )
    diffs = [b - a for s in (*head, *tail) for a, b in itertools.pairwise(s.times)]
    return found, first, last, statistics.median(diffs) if diffs else DEFAULT_INTERVAL_S


def _held(
    api: PrometheusApi, job_id: str, selector: str, start: float, end: float
) -> tuple[list[Series], float, float, float]:
    """:func:`_span` of the job's ``hyperagent_job_gpus``; JobReportError where it held none."""
    held, first, last, interval = _span(api, f"hyperagent_job_gpus{selector}", start, end)
    if held:
        return held, first, last, interval
    if api.series_exist(f"hyperagent_job_gpus{selector}"):
        raise JobReportError(
            f"job {job_id!r} held no GPUs between {_when(start)} and {_when(end)} "
            f"(Prometheus at {api.url} has its series at other times: widen --since or "
            "--start/--end)"
        )
    raise JobReportError(
        f"unknown job {job_id!r}: Prometheus at {api.url} has no hyperagent_job_gpus"
        f"{selector} (the agent exports it for every job holding GPUs)"
    )


@dataclass(frozen=True)
class _Queries:
    """The range queries of a job's span, on one grid of points."""

    api: PrometheusApi
    selector: str
    first: float
    start: float
    end: float
    step: float
    instances: str

    @classmethod
    def over(
        cls,
        api: PrometheusApi,
        selector: str,
        nodes: Sequence[str],
        first: float,
        last: float,
        interval: float,
    ) -> _Queries:
        """At most :data:`MAX_POINTS` points from ``first`` to ``last``, each half a step after
        a sample: its window (one step) holds that sample alone, whatever the scrapes' jitter;
        the first holds the job's first sample."""
        step = max(interval, (last - first) / MAX_POINTS)
        step = math.ceil(step * 1000) / 1000
        count = math.floor((last - first) / step + 0.5)
        end = last + step / 2
        instances = "|".join(re.escape(n) for n in nodes)
        return cls(api, selector, first, end - count * step, end, step, instances)

    @property
    def window(self) -> str:
        return f"{max(1, round(self.step * 1000))}ms"

    def points(self, expr: str) -> list[Series]:
        # the first point's window may reach back before the job's first sample: left out
        return [
            _since(s, self.first)
            for s in self.api.query_range(expr, self.start, self.end, self.step)
        ]

    def per_job(self, metric: str) -> list[Series]:
        """A per-job series, as the agent exports it."""
        return self.points(f"last_over_time({metric}{self.selector}[{self.window}])")

    def per_gpu(self, metric: str) -> list[Series]:
        """A per-GPU series of the GPUs the job held."""
        on_gpu = "on (cluster, instance, gpu, uuid) group_right ()"
        window = self.window
        return self.points(
            f"last_over_time({metric}{{instance=~{json.dumps(self.instances)}}}[{window}])"
            f" * {on_gpu} last_over_time(hyperagent_gpu_job_info{self.selector}[{window}])"
        )


def _increase(series: Sequence[Series], from_zero: bool) -> float | None:
    """How much the counters of ``series`` grew together; None without a series."""
    return sum(counter_increase(s.values, from_zero) for s in series) if series else None


def _per_gpu(
    queries: _Queries,
) -> tuple[dict[tuple[str, str, str], Series], dict[tuple[str, str, str], Series], list[GpuStats]]:
    """Utilisation and memory of each GPU the job held, by GPU, and their figures."""
    util_gpu = {_gpu_key(s.labels): s for s in queries.per_gpu("hyperagent_gpu_utilization_ratio")}
    mem_gpu = {_gpu_key(s.labels): s for s in queries.per_gpu("hyperagent_gpu_memory_used_bytes")}
    stats = [
        _gpu_stats(key, util_gpu.get(key), mem_gpu.get(key))
        for key in sorted(set(util_gpu) | set(mem_gpu), key=_gpu_sort)
    ]
    return util_gpu, mem_gpu, stats


def _energy(
    energy_s: Sequence[Series], grid: Sequence[float], from_zero: bool
) -> tuple[float | None, list[float | None]]:
    """The job's energy in its span, and used so far at each grid point (None without a
    series)."""
    total = _increase(energy_s, from_zero)
    index = {t: i for i, t in enumerate(grid)}
    so_far = [0.0] * len(grid)
    for s in energy_s:
        for t, used in zip(s.times, counter_so_far(s.values, from_zero), strict=True):
            if t in index:
                so_far[index[t]] += used
    return total, [e if energy_s else None for e in so_far]


def job_report(
    api: PrometheusApi,
    job_id: str,
    start: float | None = None,
    end: float | None = None,
    cluster: str | None = None,
) -> JobReport:
    """The figures of job ``job_id`` between ``start`` and ``end`` (Unix seconds; default the
    last 7 days up to now), read from ``api``."""
    end = time.time() if end is None else end
    start = end - DEFAULT_SINCE_S if start is None else start
    if start >= end:
        raise JobReportError(f"empty range: start {_when(start)} is not before end {_when(end)}")
    selector = _selector(job_id, cluster)
    held, first, last, interval = _held(api, job_id, selector, start, end)
    nodes = sorted({_node(s) for s in held})
    began_inside = first >= start + 2 * interval
    queries = _Queries.over(api, selector, nodes, first, last, interval)

    gpus_s = queries.per_job("hyperagent_job_gpus")
    grid = sorted({t for s in gpus_s for t in s.times})
    gpus_rows = _on_grid(gpus_s, grid)
    gpus_total = _sum_points(gpus_rows, len(grid))

    def summed(metric: str) -> list[float | None]:
        return _sum_points(_on_grid(queries.per_job(metric), grid), len(grid))

    util_s = queries.per_job("hyperagent_job_gpu_utilization_ratio")
    weighted = _weighted_utilization(gpus_s, gpus_rows, util_s, grid)
    job_util = [u for u in weighted if u is not None]
    memory = summed("hyperagent_job_gpu_memory_used_bytes")
    power = summed("hyperagent_job_gpu_power_watts")
    node_power = summed("hyperagent_job_node_power_watts")
    energy_total, energy_so_far = _energy(
        queries.per_job("hyperagent_job_gpu_energy_joules_total"), grid, began_inside
    )
    samples = _increase(queries.per_job("hyperagent_job_samples_total"), began_inside)
    util_gpu, mem_gpu, gpu_stats = _per_gpu(queries)
    seconds = last - first
    labels = held[0].labels
    present_memory = [m for m in memory if m is not None]
    return JobReport(
        job_id=job_id,
        prometheus=api.url,
        user=labels.get("user", ""),
        slurm_job=labels.get("slurm_job", ""),
        slurm_step=labels.get("slurm_step", ""),
        clusters=tuple(sorted({s.labels["cluster"] for s in held if "cluster" in s.labels})),
        nodes=tuple(nodes),
        start=first,
        end=last,
        step_s=queries.step,
        gpus=round(max((g for g in gpus_total if g is not None), default=0)),
        gpu_hours=_trapezoid(grid, gpus_total, max(2.5 * queries.step, 300.0)) / 3600,
        mean_utilization=statistics.fmean(job_util) if job_util else None,
        p10_utilization=_p10(job_util),
        low_seconds=(
            sum(u < LOW_UTILIZATION for u in job_util) / len(job_util) * seconds
            if job_util
            else None
        ),
        memory_peak_bytes=max(present_memory) if present_memory else None,
        energy_joules=energy_total,
        samples=samples,
        per_gpu=tuple(gpu_stats),
        timeline=Timeline(
            times=tuple(grid),
            utilization=tuple(weighted),
            gpu_utilization={_label(k): s for k, s in util_gpu.items()},
            gpu_memory_bytes={_label(k): s for k, s in mem_gpu.items()},
            gpu_power_watts=tuple(power),
            node_power_watts=tuple(node_power),
            energy_joules=tuple(energy_so_far),
        ),
    )


def _label(key: tuple[str, str, str]) -> str:
    return f"{key[0]} GPU {key[1]}"


def _dates(times: Sequence[float]) -> Any:
    return mdates.date2num([datetime.fromtimestamp(t, UTC) for t in times])


def _plot(ax: Axes, times: Sequence[float], values: Sequence[float | None], **style: Any) -> None:
    ax.plot(_dates(times), [math.nan if v is None else v for v in values], **style)


def draw(report: JobReport) -> Figure:
    """The job over time: utilisation (each GPU and the job's mean), memory per GPU, and the
    GPUs' power with the energy used so far."""
    line = report.timeline
    figure = Figure(figsize=(10, 9), dpi=100, layout="constrained")
    util_ax, mem_ax, power_ax = figure.subplots(3, 1, sharex=True)
    for name, s in sorted(line.gpu_utilization.items()):
        label = name if len(line.gpu_utilization) <= LEGEND_GPUS else "_nolegend_"
        _plot(util_ax, s.times, [v * 100 for v in s.values], linewidth=0.8, alpha=0.6, label=label)
    _plot(
        util_ax,
        line.times,
        [None if u is None else u * 100 for u in line.utilization],
        color="black",
        linewidth=2,
        label="job mean",
    )
    util_ax.axhline(LOW_UTILIZATION * 100, color="tab:red", linestyle="--", linewidth=1)
    util_ax.set_ylim(0, 105)
    util_ax.set_ylabel("GPU utilisation (%)")
    util_ax.legend(
        loc="lower left", bbox_to_anchor=(0, 1), ncol=5, fontsize="x-small", frameon=False
    )
    for name, s in sorted(line.gpu_memory_bytes.items()):
        _plot(mem_ax, s.times, [v / GIB for v in s.values], linewidth=0.8, label=name)
    mem_ax.set_ylabel("GPU memory used (GiB)")
    mem_ax.set_ylim(bottom=0)
    _plot(power_ax, line.times, line.gpu_power_watts, color="tab:orange", label="GPUs")
    if any(v is not None for v in line.node_power_watts):
        _plot(power_ax, line.times, line.node_power_watts, color="tab:brown", label="node")
    power_ax.set_ylabel("power (W)")
    power_ax.set_ylim(bottom=0)
    power_ax.legend(loc="upper left", fontsize="x-small")
    energy_ax = power_ax.twinx()
    _plot(
        energy_ax,
        line.times,
        [None if e is None else e / JOULES_PER_KWH for e in line.energy_joules],
        color="tab:green",
        linestyle="--",
    )
    energy_ax.set_ylabel("GPU energy so far (kWh)", color="tab:green")
    energy_ax.set_ylim(bottom=0)
    power_ax.set_xlabel("time (UTC)")
    for ax in (util_ax, mem_ax, power_ax):
        ax.xaxis_date(UTC)
    who = f"{report.user or '?'}" + (f", Slurm job {report.slurm_job}" if report.slurm_job else "")
    energy = "" if report.energy_kwh is None else f", {report.energy_kwh:.3f} kWh"
    figure.suptitle(
        f"Job {report.job_id} ({who}): {report.gpus} GPUs on {len(report.nodes)} node(s), "
        f"mean utilisation {_percent(report.mean_utilization)}{energy}",
        fontsize="medium",
    )
    return figure


def write_picture(report: JobReport, out: Path) -> None:
    """Draw ``report`` into ``out`` (PNG)."""
    if out.suffix.lower() != ".png":
        raise JobReportError(f"{out}: the job's picture is written as .png")
    try:
        draw(report).savefig(out, format="png", metadata={"Software": None})
    except OSError as e:
        raise JobReportError(f"{out}: cannot write the picture: {e.strerror or e}") from e


def default_out(job_id: str) -> Path:
    """``job-<id>.png`` in the working directory, the id made safe for a file name."""
    return Path(f"job-{re.sub(r'[^A-Za-z0-9._-]', '_', job_id)}.png")
