"""Per-job series in a real Prometheus with the shipped config and rules, and
``hyperagent report --job``: two Slurm jobs of two users on one 8-GPU node, 4 GPUs each.

At the end, the real agent over the replay of two Slurm jobs
(``fixtures/replay/slurm-2jobs-8gpu``, attributed from their cgroups) is scraped by Prometheus:
the job dashboard's GPU panels fill for both jobs, and the report gives the replay's
utilisation and memory per GPU and its GPUs' recorded power integrated over time.

The history (an hour, every 15 s) goes into Prometheus' TSDB as blocks written by
``promtool tsdb create-blocks-from openmetrics`` from an OpenMetrics file this test writes with
known values in the agent's per-job schema; the report's figures are checked against what
was written. Two more jobs run live: a /metrics endpoint (prometheus_client) serves their
series with values known from the time of each scrape, Prometheus scrapes it every second and
evaluates the rules, and every query of the job dashboard's GPU panels returns data for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import statistics
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import numpy as np
import pytest
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry
from test_prometheus_e2e import CLUSTER, DASHBOARDS, Prometheus
from test_slurm_attribution import ALICE as REPLAY_ALICE
from test_slurm_attribution import BOB as REPLAY_BOB
from test_slurm_attribution import NODE as REPLAY
from test_slurm_attribution import replayed

from hyperagent import cli
from hyperagent.job_report import (
    JobReportError,
    PrometheusApi,
    counter_increase,
    counter_so_far,
    job_report,
    parse_duration,
    parse_time,
    write_picture,
)

from conftest import REPO, free_port, require_binary

INSTANCE = "v100s-node:10478"
STEP_S = 15
HOUR_SAMPLES = 241
"""An hour of samples every 15 s, both ends included."""
GPUS = 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Job:
    job_id: str
    user: str
    slurm_job: str
    slurm_step: str
    gpus: tuple[int, ...]

    @property
    def labels(self) -> dict[str, str]:
        return {
            "job_id": self.job_id,
            "user": self.user,
            "slurm_job": self.slurm_job,
            "slurm_step": self.slurm_step,
        }


ALICE = Job("slurm-1001-0", "alice", "1001", "0", (0, 1, 2, 3))
BOB = Job("slurm-1002-batch", "bob", "1002", "batch", (4, 5, 6, 7))
LIVE_ALICE = Job("slurm-2001-0", "alice", "2001", "0", (0, 1, 2, 3))
LIVE_BOB = Job("slurm-2002-0", "bob", "2002", "0", (4, 5, 6, 7))
BOB_FROM, BOB_TO, BOB_RELEASED = 40, 200, 220
"""Bob's job holds its GPUs from sample 40 to 200 (10 to 50 minutes in), its series are
released at sample 220; alice's job holds its GPUs the whole hour."""
ALICE_SAMPLES_PER_S = 100.0


def uuid(gpu: int) -> str:
    return f"GPU-5c1e{gpu:04x}-0000-4000-8000-00000000v100"


@dataclass
class History:
    """What was written, per job: the values the report must find."""

    start: float
    job_util: dict[str, list[float]]
    gpu_util: dict[tuple[str, int], list[float]]
    memory_peak: dict[str, float]
    gpu_memory_peak: dict[tuple[str, int], float]
    energy_j: dict[str, float]
    energy: dict[str, list[float]]
    """The job's energy counter at each of its samples."""
    samples: dict[str, float]
    seconds: dict[str, float]


def _line(name: str, labels: dict[str, str], value: float, ts: float) -> str:
    text = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}} {value!r} {ts:.3f}"


def write_history(path: Path, start: float) -> History:
    """The hour of two jobs on the node as OpenMetrics text; returns what it holds."""
    rng = random.Random(30)
    times = [start + k * STEP_S for k in range(HOUR_SAMPLES)]
    node = {"cluster": CLUSTER, "instance": INSTANCE, "job": "hyperagent"}

    def held(job: Job, k: int) -> bool:
        return job is ALICE or BOB_FROM <= k <= BOB_TO

    # alice's GPUs busy (55-98%), bob's near idle (1-8%) for 20 minutes, then 60-90%
    util = {g: [0.0] * HOUR_SAMPLES for g in range(GPUS)}
    power = {g: [40.0] * HOUR_SAMPLES for g in range(GPUS)}
    memory = {g: [0.5 * 2**30] * HOUR_SAMPLES for g in range(GPUS)}
    for k in range(HOUR_SAMPLES):
        for g in ALICE.gpus:
            util[g][k] = round(rng.uniform(0.55, 0.98), 3)
            power[g][k] = round(100 + 150 * util[g][k], 1)
            memory[g][k] = float(rng.randrange(20, 30) * 2**30)
        if held(BOB, k):
            for g in BOB.gpus:
                busy = k >= BOB_FROM + 80
                util[g][k] = round(rng.uniform(0.6, 0.9) if busy else rng.uniform(0.01, 0.08), 3)
                power[g][k] = round(60 + 150 * util[g][k], 1)
                memory[g][k] = float(rng.randrange(4, 12) * 2**30)
    families: dict[str, list[str]] = {}

    def add(
        family: str, kind: str, sample: str, labels: dict[str, str], values: dict[int, float]
    ) -> None:
        lines = families.setdefault(f"# TYPE {family} {kind}", [])
        lines += [_line(sample, labels, v, times[k]) for k, v in sorted(values.items())]

    history = History(start, {}, {}, {}, {}, {}, {}, {}, {})
    for job in (ALICE, BOB):
        ks = [k for k in range(HOUR_SAMPLES) if held(job, k)]
        labels = {**node, **job.labels}
        job_util = [statistics.fmean(util[g][k] for g in job.gpus) for k in ks]
        job_power = [sum(power[g][k] for g in job.gpus) for k in ks]
        job_memory = [sum(memory[g][k] for g in job.gpus) for k in ks]
        energy = [0.0]  # the counter starts with the job, counting its GPUs' energy while held
        for p in job_power[:-1]:
            energy.append(energy[-1] + p * STEP_S)
        # an ended job: 0 GPUs and its energy kept until the agent releases its series
        tail = range(ks[-1] + 1, BOB_RELEASED) if job is BOB else range(0)
        gpus = {**dict.fromkeys(ks, 4), **dict.fromkeys(tail, 0)}
        add("hyperagent_job_gpus", "gauge", "hyperagent_job_gpus", labels, gpus)
        for name, values in (
            ("hyperagent_job_gpu_utilization_ratio", job_util),
            ("hyperagent_job_gpu_sm_active_ratio", [u * 0.9 for u in job_util]),
            ("hyperagent_job_gpu_memory_used_bytes", job_memory),
            ("hyperagent_job_gpu_power_watts", job_power),
        ):
            add(name, "gauge", name, labels, dict(zip(ks, values, strict=True)))
        add(
            "hyperagent_job_gpu_energy_joules",
            "counter",
            "hyperagent_job_gpu_energy_joules_total",
            labels,
            {**dict(zip(ks, energy, strict=True)), **dict.fromkeys(tail, energy[-1])},
        )
        if job is ALICE:
            samples = {k: (k - ks[0]) * STEP_S * ALICE_SAMPLES_PER_S for k in ks}
            add(
                "hyperagent_job_samples",
                "counter",
                "hyperagent_job_samples_total",
                {**node, "job_id": job.job_id},
                samples,
            )
            history.samples[job.job_id] = samples[ks[-1]]
        for g in job.gpus:
            info = {**node, "gpu": str(g), "uuid": uuid(g), **job.labels}
            add(
                "hyperagent_gpu_job_info",
                "gauge",
                "hyperagent_gpu_job_info",
                info,
                dict.fromkeys(ks, 1),
            )
            history.gpu_util[job.job_id, g] = [util[g][k] for k in ks]
            history.gpu_memory_peak[job.job_id, g] = max(memory[g][k] for k in ks)
        history.job_util[job.job_id] = job_util
        history.memory_peak[job.job_id] = max(job_memory)
        history.energy_j[job.job_id] = energy[-1]
        history.energy[job.job_id] = energy
        history.seconds[job.job_id] = (ks[-1] - ks[0]) * STEP_S
    for g in range(GPUS):
        gpu = {**node, "gpu": str(g), "uuid": uuid(g)}
        every = range(HOUR_SAMPLES)
        add(
            "hyperagent_gpu_utilization_ratio",
            "gauge",
            "hyperagent_gpu_utilization_ratio",
            gpu,
            {k: util[g][k] for k in every},
        )
        add(
            "hyperagent_gpu_memory_used_bytes",
            "gauge",
            "hyperagent_gpu_memory_used_bytes",
            gpu,
            {k: memory[g][k] for k in every},
        )
        add(
            "hyperagent_gpu_power_watts",
            "gauge",
            "hyperagent_gpu_power_watts",
            gpu,
            {k: power[g][k] for k in every},
        )
    text = "".join(head + "\n" + "\n".join(lines) + "\n" for head, lines in families.items())
    path.write_text(text + "# EOF\n")
    return history


class LiveNode:
    """The node's /metrics while two jobs run: alice's 4 GPUs at 80% and 250 W each, bob's at
    5% and 60 W; the energy counters grow with the time since the endpoint started."""

    def __init__(self) -> None:
        self.started = time.time()
        self.util = {LIVE_ALICE.job_id: 0.8, LIVE_BOB.job_id: 0.05}
        self.watts = {LIVE_ALICE.job_id: 250.0, LIVE_BOB.job_id: 60.0}
        self.memory = {LIVE_ALICE.job_id: 24 * 2**30, LIVE_BOB.job_id: 6 * 2**30}

    def describe(self) -> list[object]:
        return []

    def collect(self) -> Iterator[object]:
        now = time.time()
        per_job = ["job_id", "user", "slurm_job", "slurm_step"]
        per_gpu = ["gpu", "uuid"]
        fams = {
            "gpus": GaugeMetricFamily("hyperagent_job_gpus", "", labels=per_job),
            "util": GaugeMetricFamily("hyperagent_job_gpu_utilization_ratio", "", labels=per_job),
            "sm": GaugeMetricFamily("hyperagent_job_gpu_sm_active_ratio", "", labels=per_job),
            "mem": GaugeMetricFamily("hyperagent_job_gpu_memory_used_bytes", "", labels=per_job),
            "power": GaugeMetricFamily("hyperagent_job_gpu_power_watts", "", labels=per_job),
            "energy": CounterMetricFamily("hyperagent_job_gpu_energy_joules", "", labels=per_job),
            "info": GaugeMetricFamily("hyperagent_gpu_job_info", "", labels=per_gpu + per_job),
            "gpu_util": GaugeMetricFamily("hyperagent_gpu_utilization_ratio", "", labels=per_gpu),
            "gpu_mem": GaugeMetricFamily("hyperagent_gpu_memory_used_bytes", "", labels=per_gpu),
            "gpu_power": GaugeMetricFamily("hyperagent_gpu_power_watts", "", labels=per_gpu),
            "gpu_energy": CounterMetricFamily("hyperagent_gpu_energy_joules", "", labels=per_gpu),
            "samples": CounterMetricFamily("hyperagent_job_samples", "", labels=["job_id"]),
        }
        for job in (LIVE_ALICE, LIVE_BOB):
            values = [job.job_id, job.user, job.slurm_job, job.slurm_step]
            watts, util = self.watts[job.job_id], self.util[job.job_id]
            fams["gpus"].add_metric(values, 4)
            fams["util"].add_metric(values, util)
            fams["sm"].add_metric(values, util * 0.9)
            fams["mem"].add_metric(values, 4 * self.memory[job.job_id])
            fams["power"].add_metric(values, 4 * watts)
            fams["energy"].add_metric(values, 4 * watts * (now - self.started))
            for g in job.gpus:
                gpu = [str(g), uuid(g)]
                fams["info"].add_metric(gpu + values, 1)
                fams["gpu_util"].add_metric(gpu, util)
                fams["gpu_mem"].add_metric(gpu, self.memory[job.job_id])
                fams["gpu_power"].add_metric(gpu, watts)
                fams["gpu_energy"].add_metric(gpu, watts * (now - self.started))
        fams["samples"].add_metric([LIVE_ALICE.job_id], 120.0 * (now - self.started))
        yield from fams.values()


@contextlib.contextmanager
def served(node: LiveNode) -> Iterator[str]:
    registry = CollectorRegistry()
    registry.register(node)  # type: ignore[arg-type]
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@dataclass
class Setup:
    prometheus: Prometheus
    history: History
    live: LiveNode


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Prometheus over the history blocks, scraping the live node."""
    workdir = tmp_path_factory.mktemp("job-report")
    promtool = require_binary("promtool", "prometheus")
    start = (time.time() // 3600 - 3) * 3600  # an hour that ended two hours ago
    history = write_history(workdir / "history.om", start)
    live = LiveNode()
    with served(live) as address:
        prometheus = Prometheus(workdir, [address], [])
        subprocess.run(
            [
                promtool,
                "tsdb",
                "create-blocks-from",
                "openmetrics",
                str(workdir / "history.om"),
                str(prometheus.tsdb),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        prometheus.start()
        try:
            yield Setup(prometheus, history, live)
        finally:
            prometheus.stop()


def wait_for(prometheus: Prometheus, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        result = prometheus.get("/api/v1/query", query=expr)["result"]
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def p10(values: list[float]) -> float:
    return float(np.percentile(values, 10))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("job", [ALICE, BOB], ids=lambda j: j.user)
def test_the_report_finds_what_the_history_holds(setup: Setup, job: Job, tmp_path: Path) -> None:
    history, api = setup.history, PrometheusApi(setup.prometheus.url)
    report = job_report(api, job.job_id)
    assert (report.user, report.slurm_job, report.slurm_step) == (
        job.user,
        job.slurm_job,
        job.slurm_step,
    )
    assert report.nodes == (INSTANCE,) and report.clusters == (CLUSTER,)
    assert report.step_s == STEP_S
    assert report.seconds == history.seconds[job.job_id]
    assert report.gpus == 4
    assert report.gpu_hours == pytest.approx(4 * history.seconds[job.job_id] / 3600, rel=1e-9)
    assert report.mean_utilization == pytest.approx(statistics.fmean(history.job_util[job.job_id]))
    assert report.p10_utilization == pytest.approx(p10(history.job_util[job.job_id]))
    low = sum(u < 0.1 for u in history.job_util[job.job_id]) / len(history.job_util[job.job_id])
    assert report.low_seconds == pytest.approx(low * history.seconds[job.job_id])
    assert report.memory_peak_bytes == history.memory_peak[job.job_id]
    assert report.energy_joules == pytest.approx(history.energy_j[job.job_id], rel=1e-9)
    assert report.energy_kwh == pytest.approx(history.energy_j[job.job_id] / 3.6e6, rel=1e-9)
    if job is ALICE:
        assert report.joules_per_sample == pytest.approx(
            history.energy_j[job.job_id] / history.samples[job.job_id], rel=1e-9
        )
    else:
        assert report.samples is None and report.joules_per_sample is None
        assert 0.4 < low < 0.6  # bob's job idled half its time
    assert [(g.instance, g.gpu, g.uuid) for g in report.per_gpu] == [
        (INSTANCE, str(g), uuid(g)) for g in job.gpus
    ]
    for g in report.per_gpu:
        values = history.gpu_util[job.job_id, int(g.gpu)]
        assert g.mean == pytest.approx(statistics.fmean(values))
        assert g.p10 == pytest.approx(p10(values))
        assert g.memory_peak_bytes == history.gpu_memory_peak[job.job_id, int(g.gpu)]


@pytest.mark.timeout(120)
def test_a_range_inside_the_job_counts_only_its_part(setup: Setup) -> None:
    history, api = setup.history, PrometheusApi(setup.prometheus.url)
    start = history.start + 40 * STEP_S + 1  # after sample 40, up to sample 120 included
    report = job_report(api, ALICE.job_id, start, history.start + 120 * STEP_S, cluster=CLUSTER)
    assert (report.start, report.end) == (history.start + 41 * STEP_S, history.start + 1800)
    assert report.gpu_hours == pytest.approx(4 * 79 * STEP_S / 3600, rel=1e-9)
    assert report.mean_utilization == pytest.approx(
        statistics.fmean(history.job_util[ALICE.job_id][41:121])
    )
    # the counter's increase over the range, not the energy before it
    energy = history.energy[ALICE.job_id]
    assert report.energy_joules == pytest.approx(energy[120] - energy[41], rel=1e-9)


@pytest.mark.timeout(120)
def test_report_command_prints_the_summary_and_draws_the_picture(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "alice.png"
    argv = [
        "report",
        "--job",
        ALICE.job_id,
        "--prometheus",
        setup.prometheus.url,
        "--out",
        str(out),
    ]
    assert cli.main([*argv, "--since", "7d"]) == 0
    text = capsys.readouterr().out
    energy = setup.history.energy_j[ALICE.job_id] / 3.6e6
    assert f"Job {ALICE.job_id}: user alice, Slurm job 1001 step 0" in text
    assert "GPUs:          4 (4.00 GPU-hours)" in text
    assert f"GPU energy:    {energy:.3f} kWh" in text
    assert f"{uuid(3)}" in text and f"picture:       {out}" in text
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 30_000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1000, 900)


@pytest.mark.timeout(120)
def test_report_errors_say_what_is_wrong(
    setup: Setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, out = setup.prometheus.url, str(tmp_path / "x.png")
    cases = [
        (
            ["--job", ALICE.job_id, "--prometheus", f"http://127.0.0.1:{free_port()}"],
            "cannot reach Prometheus at http://127.0.0.1:",
        ),
        (["--job", "slurm-9999-0", "--prometheus", url], "unknown job 'slurm-9999-0'"),
        (
            ["--job", ALICE.job_id, "--prometheus", url, "--since", "30m"],
            f"job {ALICE.job_id!r} held no GPUs between",
        ),
        (
            [
                "--job",
                ALICE.job_id,
                "--prometheus",
                url,
                "--start",
                "2026-01-02T00:00:00Z",
                "--end",
                "2026-01-01T00:00:00Z",
            ],
            "empty range",
        ),
        (["--job", ALICE.job_id, "--prometheus", url, "--since", "soon"], "is no duration"),
        (["--job", ALICE.job_id, "--prometheus", "127.0.0.1:9090"], "not an http:// or https://"),
    ]
    for args, message in cases:
        assert cli.main(["report", *args, "--out", out]) in (1, 2), args
        assert message in capsys.readouterr().err, args
    assert not Path(out).exists()
    with pytest.raises(JobReportError, match="refused /api/v1/query"):
        PrometheusApi(url).raw("hyperagent_job_gpus{", time.time(), 60)


def test_durations_and_times() -> None:
    assert parse_duration("1h30m") == 5400
    assert parse_duration("7d") == 7 * 86400
    with pytest.raises(ValueError):
        parse_duration("7 days")
    assert parse_time("1796400000") == 1796400000
    assert parse_time("2026-12-04T18:00:00Z") == parse_time("2026-12-04T19:00:00+01:00")
    assert parse_time("2026-12-04T18:00:00") == 1796407200  # UTC unless it says
    with pytest.raises(ValueError):
        parse_time("yesterday")


def test_a_counter_reset_counts_as_a_restart_from_zero() -> None:
    # an agent restarted at the fourth point: its counter starts again from 0
    assert counter_so_far([100.0, 150.0, 200.0, 30.0, 80.0], from_zero=False) == [
        0.0,
        50.0,
        100.0,
        130.0,
        180.0,
    ]
    assert counter_increase([100.0, 150.0], from_zero=True) == 150.0
    assert counter_increase([], from_zero=True) == 0.0


def job_panels() -> list[tuple[str, list[str]]]:
    """(title, queries) of the job dashboard's panels of its first row (GPUs, power, energy)."""
    (path,) = [p for p in DASHBOARDS if p.stem == "hyperagent-job"]
    panels = json.loads(path.read_text())["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    assert panels[rows[0]]["title"] == "GPUs, power and energy"
    first_row = panels[rows[0] + 1 : rows[1]]
    listed = [p for p in panels if p["title"] == "GPUs of the job"]
    return [(p["title"], [t["expr"] for t in p["targets"]]) for p in first_row + listed]


def filled(expr: str, job: Job) -> str:
    values = {"cluster": CLUSTER, "job_id": job.job_id, "__rate_interval": "1m", "__range": "5m"}
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


NODE_ONLY = "hyperagent_job_node_power_watts"
"""The node's power per job: only while one job holds every GPU of the node (neither here)."""
SM_ACTIVE = "hyperagent_job_gpu_sm_active_ratio"
"""SM activity: only where the GPUs measure it (not the replayed node's V100S)."""


@pytest.mark.timeout(120)
def test_job_dashboard_panels_and_rules_fill_for_both_live_jobs(setup: Setup) -> None:
    prometheus = setup.prometheus
    for job in (LIVE_ALICE, LIVE_BOB):
        selector = f'{{cluster="{CLUSTER}", job_id="{job.job_id}"}}'
        assert wait_for(prometheus, f"job_id:hyperagent_gpu_energy_joules:rate5m{selector}")
        for title, queries in job_panels():
            for expr in queries:
                if NODE_ONLY in expr:
                    continue
                assert wait_for(prometheus, filled(expr, job), 15), (job.job_id, title, expr)
    variable = json.loads((REPO / "grafana" / "dashboards" / "hyperagent-job.json").read_text())
    (query,) = [v["query"] for v in variable["templating"]["list"] if v["name"] == "job_id"]
    selector = query.removeprefix("label_values(").rsplit(",", 1)[0].replace("$cluster", CLUSTER)
    listed = {s["metric"]["job_id"] for s in wait_for(prometheus, selector)}
    assert {LIVE_ALICE.job_id, LIVE_BOB.job_id} <= listed
    sums = {
        s["metric"]["job_id"]: float(s["value"][1])
        for s in wait_for(prometheus, "job_id:hyperagent_gpu_power_watts:sum")
    }
    assert sums == {LIVE_ALICE.job_id: 1000.0, LIVE_BOB.job_id: 240.0}
    mean = {
        s["metric"]["job_id"]: float(s["value"][1])
        for s in wait_for(prometheus, "job_id:hyperagent_job_gpu_utilization_ratio:avg")
    }
    assert mean == {LIVE_ALICE.job_id: 0.8, LIVE_BOB.job_id: 0.05}
    groups = prometheus.get("/api/v1/rules")["groups"]
    unhealthy = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]]
    assert [u for u in unhealthy if u[1]] == []
    # a GPU held at 5% for seconds is far from the hour the alert waits for
    assert (
        prometheus.get("/api/v1/query", query='ALERTS{alertname="HyperagentJobGpusIdle"}')["result"]
        == []
    )


@pytest.mark.timeout(120)
def test_the_report_on_a_live_job(setup: Setup) -> None:
    prometheus, live = setup.prometheus, setup.live
    wait_for(prometheus, f'hyperagent_job_gpus{{job_id="{LIVE_ALICE.job_id}"}}')
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # a few scrapes
        report = job_report(PrometheusApi(prometheus.url), LIVE_ALICE.job_id, cluster=CLUSTER)
        if report.seconds >= 5:
            break
        time.sleep(1)
    assert report.seconds >= 5
    assert report.step_s == pytest.approx(1.0, abs=0.05)
    assert report.gpus == 4
    assert report.mean_utilization == pytest.approx(0.8)
    assert report.p10_utilization == pytest.approx(0.8)
    assert report.low_seconds == 0
    assert report.gpu_hours == pytest.approx(4 * report.seconds / 3600, rel=0.02)
    assert report.memory_peak_bytes == 4 * 24 * 2**30
    # its counter started with the endpoint: the report counts the energy since
    assert report.energy_joules == pytest.approx(1000.0 * (report.end - live.started), rel=0.01)
    assert report.joules_per_sample == pytest.approx(1000.0 / 120.0, rel=0.02)
    assert [g.mean for g in report.per_gpu] == pytest.approx([0.8] * 4)


# -- a real agent over the replay of two Slurm jobs, scraped by Prometheus --------------------


def replay_gpus() -> dict[int, tuple[float, float, float]]:
    """Per GPU of the replayed node's nvidia-smi capture: utilisation, memory used (bytes) and
    power (W)."""
    root = ElementTree.parse(REPLAY / "nvidia-smi.xml").getroot()
    out = {}
    for gpu in root.findall("gpu"):
        util = float(gpu.findtext("utilization/gpu_util", "").removesuffix(" %")) / 100
        memory = float(gpu.findtext("fb_memory_usage/used", "").removesuffix(" MiB")) * 2**20
        power = float(gpu.findtext("power_readings/power_draw", "").removesuffix(" W"))
        out[int(gpu.findtext("minor_number", ""))] = (util, memory, power)
    return out


ENERGY_RULE = "job_id:hyperagent_gpu_energy_joules:rate5m"


async def query(prometheus: Prometheus, expr: str) -> dict[str, float]:
    """job_id -> value of an instant query."""
    data = await asyncio.to_thread(prometheus.get, "/api/v1/query", query=expr)
    return {s["metric"].get("job_id", ""): float(s["value"][1]) for s in data["result"]}


@pytest.mark.timeout(120)
@pytest.mark.long(30)
async def test_the_two_job_replay_through_prometheus_the_dashboard_and_the_report(
    tmp_path: Path,
) -> None:
    gpus = replay_gpus()
    expected = {
        REPLAY_ALICE["job_id"]: (0, 1, 2, 3),
        REPLAY_BOB["job_id"]: (4, 5, 6, 7),
    }
    async with replayed(tmp_path, {"mode": "cgroup"}) as (agent, port, node):
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}"], [])
        prometheus.start()
        try:
            async with asyncio.timeout(30):
                while (
                    len(await query(prometheus, "job_id:hyperagent_gpu_energy_joules:rate5m")) < 2
                ):
                    await asyncio.sleep(0.5)
            for job_id in expected:
                job = Job(job_id, "", "", "", ())
                for title, queries in job_panels():
                    for expr in queries:
                        if NODE_ONLY not in expr and SM_ACTIVE not in expr:
                            found = await asyncio.to_thread(
                                wait_for, prometheus, filled(expr, job), 15
                            )
                            assert found, (job_id, title, expr)
            held = await query(prometheus, "job_id:hyperagent_job_gpus:sum")
            assert held == {job_id: 4.0 for job_id in expected}
            mean = await query(prometheus, "job_id:hyperagent_job_gpu_utilization_ratio:avg")
            power = await query(prometheus, "job_id:hyperagent_gpu_power_watts:sum")
            for job_id, ids in expected.items():
                assert mean[job_id] == pytest.approx(statistics.fmean(gpus[g][0] for g in ids))
                assert power[job_id] == pytest.approx(sum(gpus[g][2] for g in ids))
            await asyncio.sleep(10)  # ten more scrapes of both jobs

            # bob's job ends: its processes go, its GPUs fall to 0 on /metrics
            for pid in range(52101, 52105):
                shutil.rmtree(node / "proc" / str(pid))
            for gpu in range(4, 8):
                agent.hardware.nvml.set_processes(gpu, [])
            bob_gpus = f'hyperagent_job_gpus{{job_id="{REPLAY_BOB["job_id"]}"}} == 0'
            async with asyncio.timeout(20):
                while not await query(prometheus, bob_gpus):
                    await asyncio.sleep(0.5)

            api = PrometheusApi(prometheus.url)
            for labels in (REPLAY_ALICE, REPLAY_BOB):
                ids = expected[labels["job_id"]]
                report = await asyncio.to_thread(job_report, api, labels["job_id"])
                assert (report.user, report.slurm_job, report.slurm_step) == (
                    labels["user"],
                    labels["slurm_job"],
                    labels["slurm_step"],
                )
                assert report.gpus == 4 and report.seconds >= 10
                assert report.gpu_hours == pytest.approx(4 * report.seconds / 3600, rel=0.02)
                assert [int(g.gpu) for g in report.per_gpu] == list(ids)
                for g in report.per_gpu:
                    util, memory, _ = gpus[int(g.gpu)]
                    assert (g.mean, g.p10) == (pytest.approx(util), pytest.approx(util))
                    assert g.memory_peak_bytes == memory
                assert report.mean_utilization == pytest.approx(
                    statistics.fmean(gpus[g][0] for g in ids)
                )
                assert report.low_seconds == 0
                assert report.memory_peak_bytes == sum(gpus[g][1] for g in ids)
                assert report.samples is None and report.joules_per_sample is None
                # the energy since the first sample: the GPUs' recorded draw, integrated
                after_first = await asyncio.to_thread(
                    job_report, api, labels["job_id"], report.start + 0.01, report.end + 0.01
                )
                watts = sum(gpus[g][2] for g in ids)
                assert after_first.energy_joules == pytest.approx(
                    watts * after_first.seconds, rel=0.01
                )
                assert report.energy_kwh == pytest.approx(report.energy_joules / 3.6e6)
                out = tmp_path / f"{labels['job_id']}.png"
                await asyncio.to_thread(write_picture, report, out)
                assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 30_000
        finally:
            prometheus.stop()
