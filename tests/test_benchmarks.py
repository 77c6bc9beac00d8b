"""The performance harness runs end to end, and the hot-path code it led to behaves as the code
it replaced: topic matching, metric families, reused health readings, slowed-down sources."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiomqtt
import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import CollectorRegistry

from hyperagent import bus
from hyperagent.capture.directory import capture_sources
from hyperagent.catalog import help_text
from hyperagent.config import build_config
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.readings import Kind, Reading, Snapshot, by_name
from hyperagent.sources.runner import SourceRunner

from conftest import BUSY, REPO

KEYS = (
    "agent_cpu_percent_1hz",
    "nvml_calls_per_gpu_cycle",
    "agent_cpu_percent_10hz",
    "agent_rss_mib",
    "agent_overhead_vs_floor",
    "attribution_cpu_ratio",
    "coordinator_msgs_per_s",
    "fanout_p99_s_1000",
    "tuner_ask_tell_ms_100",
    "replay_speedup",
)


@pytest.mark.peer
@BUSY
@pytest.mark.long(25)
def test_benchmark_harness_runs_every_section_and_writes_json(tmp_path: Path) -> None:
    """``--smoke`` is ``--quick`` cut to seconds: every section, worker and peer runs."""
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(KEYS) <= set(figures)
    measured = [k for k in KEYS if k not in ("fanout_p99_s_1000", "tuner_ask_tell_ms_100")]
    assert all(isinstance(figures[k], float) and figures[k] > 0 for k in measured), figures
    assert figures["fanout_p99_s_5"] > 0
    details = figures["details"]
    assert set(details["agent"]) == {"1hz", "1hz_all", "10hz", "10hz_all"}
    assert all(run["agent"]["cycles"] >= 1 for run in details["agent"].values())
    assert all(details["agent"]["1hz"]["agent"]["ready"]["sources_up"].values())
    attributed = details["attribution_runs"]
    assert attributed["1hz_slurm_cgroup"]["agent"]["ready"]["jobs_on_gpus"] == [
        "slurm-4242-0",
        "slurm-4243-0",
    ]
    assert attributed["1hz_slurm_off"]["agent"]["ready"]["jobs_on_gpus"] == []
    assert details["fanout"]["5"]["missing_acks"] == 0
    ladder = details["coordinator_ladder"][-1]
    assert ladder["invalid"] == 0 and ladder["ingested"] > 0
    assert figures["machine"]["nproc"] >= 1
    assert set(figures["done_when"]) == set(KEYS)
    capped = details["powercap"]  # the fake GPUs obey after 0.25 s: a harness check
    assert capped["lowered"]["changes"] == capped["lowered"]["measured"] == 8
    assert 0.25 <= capped["lowered"]["max_s"] < 5.0
    assert figures["power_cap_latency_s_max"] is None  # a measurement only on real GPUs


@pytest.mark.peer
@BUSY
@pytest.mark.long(15)
def test_benchmark_that_ingests_nothing_fails_instead_of_reporting_zero(tmp_path: Path) -> None:
    """The ingest ladder against a broker that drops every telemetry message (an ACL that
    lets clients read, never write): the coordinator runs and is sampled, the load is sent,
    nothing arrives. ``run.py`` says which figure measured nothing and exits 1, where it
    printed "ingested 0/s at 0% of a core" as a figure before (issue 47)."""
    acl = tmp_path / "read-only.acl"
    acl.write_text("topic read #\n")
    out = tmp_path / "figures.json"
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke", "--json", str(out)]
    result = subprocess.run(
        [*command, "--only", "coordinator", "--mosquitto-option", f"acl_file {acl}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "MEASURED NOTHING coordinator: 50 agents at 1 Hz: " in result.stdout, result.stdout
    assert "messages sent, the coordinator ingested none of them" in result.stdout
    assert "FAILED: 1 figure(s) measured nothing" in result.stdout
    figures = json.loads(out.read_text())
    assert [f.split(":")[0] for f in figures["measured_nothing"]] == ["coordinator"]
    assert "ingested none" in figures["measured_nothing"][0]
    assert figures["coordinator_msgs_per_s"] is None  # no figure stands for it
    step, total = figures["details"]["coordinator_ladder"]
    assert step["samples"] >= 2 and step["sent"] > 0  # sampled while the load was sent
    assert step["ingested"] == total["ingested"] == 0


def test_churn_benchmark_accepts_every_new_job_and_comes_back_to_idle() -> None:
    """``benchmarks/churn.py`` cut to seconds: its agent process, its table, its verdict."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "churn.py"),
            "--generations",
            "4",
            "--ranks",
            "2",
            "--release-after-s",
            "1",
            "--bound-s",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[2] for row in rows if row[:1] == ["gen"]] == ["accepted"] * 4
    assert "accepted 4 of 4 new job ids" in result.stdout and "(back to idle)" in result.stdout


def test_tuner_families_benchmark_reports_each_method_per_family(tmp_path: Path) -> None:
    """``benchmarks/tuner_families.py`` cut to seconds: one small family, every method, the
    prior-right landscapes, the verdicts and the JSON a later run can ``--reuse``."""
    out = tmp_path / "families.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "tuner_families.py"),
        "--families",
        "4-gloo-throughput",
        "--landscapes",
        "2",
        "--trials",
        "12",
        "--sim-seeds",
        "1",
        "--jobs",
        "1",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    family = figures["families"]["4-gloo-throughput"]
    assert set(family) == {"hyperagent", "no priors", "scikit-optimize", "random"}
    for method in family.values():
        assert len(method["reached_at"]) == 2
        assert all(r is None or 1 <= r <= 12 for r in method["reached_at"])
    assert len(figures["sim"]) == 8
    assert "done-when" in result.stdout and "prior right" in result.stdout
    again = subprocess.run(
        [*command[:-2], "--reuse", str(out)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "32 searches" in result.stdout
    assert "20 searches" in again.stdout, again.stdout  # the baselines' 12 runs reused


def test_tuner_families_cost_reports_each_arm(tmp_path: Path) -> None:
    """``--cost`` cut to seconds: whole tunings of one family with and without early-stopped
    trials, their wall time, samples lost, break-even and final value, and the verdict."""
    out = tmp_path / "cost.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "tuner_families.py"),
        "--cost",
        "--families",
        "16-nccl-throughput",
        "--landscapes",
        "2",
        "--jobs",
        "1",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    family = json.loads(out.read_text())["families"]["16-nccl-throughput"]
    assert set(family) == {"full", "early"}
    full, early = family["full"], family["early"]
    assert full["judged"] == 0 and early["judged"] > 0  # the full arm never stops a trial early
    assert early["seconds"] < full["seconds"]
    for arm in (full, early):
        assert 0 < arm["quality"] <= 1 and -1 < arm["lost_ratio"] < 1
    assert "done-when" in result.stdout and "stopped as worse" in result.stdout


TOPICS = [
    "hyperagent/v1/c/node/gpu-1/telemetry",
    "hyperagent/v1/c/node/gpu-1/status",
    "hyperagent/v1/c/job/llama/settings",
    "hyperagent/v1/c/job/llama/ack/gpu-1",
    "hyperagent/v1/c/coordinator/status",
    "hyperagent/v1/other/node/gpu-1/telemetry",
    "hyperagent/v1/c",
    "a/b",
    "a",
]
FILTERS = [
    "hyperagent/v1/c/node/+/telemetry",
    "hyperagent/v1/c/job/+/settings",
    "hyperagent/v1/c/+/+/+",
    "hyperagent/v1/c/#",
    "hyperagent/#",
    "hyperagent/v1/c/coordinator/status",
    "$share/group/hyperagent/v1/c/node/+/status",
    "+/+",
    "a/#",
    "#",
    "+",
]


@pytest.mark.parametrize("topic", TOPICS)
def test_topic_matching_agrees_with_aiomqtt(topic: str) -> None:
    for topic_filter in FILTERS:
        expected = aiomqtt.Topic(topic).matches(topic_filter)
        assert bus.topic_matches(topic_filter, topic) is expected, (topic_filter, topic)


def test_link_routes_each_topic_to_its_handlers_in_order() -> None:
    async def first(topic: str, payload: bytes) -> None: ...

    async def second(topic: str, payload: bytes) -> None: ...

    link = bus.MqttLink("127.0.0.1", 1, "test")
    link.subscribe("hyperagent/v1/c/node/+/telemetry", 0, first)
    link.subscribe("hyperagent/v1/c/#", 0, second)
    assert link.handlers_for(TOPICS[0]) == (first, second)
    assert link.handlers_for(TOPICS[2]) == (second,)
    link.subscribe("hyperagent/v1/c/job/+/settings", 1, first)  # a new filter: routes anew
    assert link.handlers_for(TOPICS[2]) == (second, first)
    assert link.handlers_for("elsewhere") == ()


def _prometheus_families(readings: list[Reading]) -> list[object]:
    """What the exporter built before: prometheus_client's family classes and add_metric."""
    out: list[object] = []
    for name, group in by_name(readings).items():
        if group[0].kind is Kind.INFO:
            info = InfoMetricFamily(name.removesuffix("_info"), help_text(name))
            for r in group:
                info.add_metric([], dict(r.labels))
            out.append(info)
            continue
        labelnames = sorted(set().union(*(r.labels for r in group)))
        family: CounterMetricFamily | GaugeMetricFamily
        if group[0].kind is Kind.COUNTER:
            family = CounterMetricFamily(
                name.removesuffix("_total"), help_text(name), labels=labelnames
            )
        else:
            family = GaugeMetricFamily(name, help_text(name), labels=labelnames)
        for r in group:
            family.add_metric([r.labels.get(k, "") for k in labelnames], r.value)
        out.append(family)
    return out


READINGS = [
    Reading("hyperagent_gpu_power_watts", 232.8, {"gpu": "0", "uuid": "GPU-a"}),
    Reading("hyperagent_gpu_power_watts", 1e-7, {"gpu": "1", "uuid": "GPU-b"}),
    Reading("hyperagent_gpu_info", 1.0, {"gpu": "0", "model": 'Tesla "V100"\\'}, Kind.INFO),
    Reading("hyperagent_gpu_energy_joules_total", 1.5e12, {"gpu": "0"}, Kind.COUNTER),
    Reading("hyperagent_source_errors_total", 3, {"source": "x", "target": "y"}, Kind.COUNTER),
    Reading("hyperagent_qu_ratio", float("nan")),
    Reading("hyperagent_ccr_ratio", 0.25, {"method": "estimated"}),
    Reading("hyperagent_ccr_ratio", 0.5),  # a missing label: exposed as method=""
    Reading("hyperagent_pdu_outlet_power_watts", -0.0, {"pdu": "p", "outlet": "1\n2"}),
    Reading("hyperagent_rdma_port_info", 1.0, {"device": "mlx5_0"}, Kind.INFO),
    Reading("hyperagent_rdma_port_info", 1.0, {"device": "rxe0", "netdev": "eth0"}, Kind.INFO),
]


def test_families_built_directly_expose_what_prometheus_client_families_did() -> None:
    class Reference:
        def collect(self) -> list[object]:
            return _prometheus_families(READINGS)

    reference = CollectorRegistry(auto_describe=False)
    reference.register(Reference())  # type: ignore[arg-type]
    ours = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector()
    collector.update(READINGS)
    ours.register(collector)
    assert generate_latest(ours) == generate_latest(reference)
    assert generate_openmetrics(ours) == generate_openmetrics(reference)
    labels = {"gpu": "0", "uuid": "GPU-a"}
    assert ours.get_sample_value("hyperagent_gpu_power_watts", labels) == 232.8


PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def _get(port: int, accept: str, query: str = "", gzipped: bool = False) -> tuple[str, bytes]:
    headers = {"Accept": accept, **({"Accept-Encoding": "gzip"} if gzipped else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics{query}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return response.headers["Content-Type"], body


@pytest.mark.parametrize("capture", ["full-node", "v100s-8gpu-training", "apc-ap8641-pdu"])
async def test_metrics_server_answers_scrapes_as_prometheus_client_does(capture: str) -> None:
    config = build_config({"node": "n", "mqtt": {"enabled": False}})
    sources, _ = capture_sources(REPO / "fixtures" / "replay" / capture, config, lambda: 10.0)
    runner = SourceRunner(sources, timeout_s=10.0)
    await runner.start()
    readings = [*await runner.read_all(), *READINGS]
    await runner.close()
    server = MetricsServer("127.0.0.1:0")
    server.collector.update(readings)
    server.start()
    try:
        content_type, body = await asyncio.to_thread(_get, server.port, PROMETHEUS_ACCEPT)
        assert content_type == (
            "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
        )
        assert body == generate_openmetrics(server.registry)
        _, zipped = await asyncio.to_thread(_get, server.port, PROMETHEUS_ACCEPT, "", True)
        assert zipped == body
        content_type, body = await asyncio.to_thread(_get, server.port, "text/plain")
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        assert body == generate_latest(server.registry)
        names = ["hyperagent_ccr_ratio"]  # a filtered scrape: the samples of that name
        _, body = await asyncio.to_thread(_get, server.port, "text/plain", f"?name[]={names[0]}")
        chosen = SnapshotCollector()
        chosen.update([r for r in readings if r.name in names])
        assert b"hyperagent_ccr_ratio" in body and body == generate_latest(chosen)
    finally:
        server.stop()


def test_collector_builds_families_once_per_update() -> None:
    collector = SnapshotCollector()
    collector.update(READINGS)
    first = list(collector.collect())
    assert all(again is built for again, built in zip(collector.collect(), first, strict=True))
    collector.update(READINGS[:1])
    assert [f.name for f in collector.collect()] == ["hyperagent_gpu_power_watts"]


def test_readings_stay_frozen_dataclasses_with_their_defaults() -> None:
    reading = Reading("hyperagent_qu_ratio", 0.5)
    assert reading == Reading("hyperagent_qu_ratio", 0.5, {}, Kind.GAUGE, "")
    assert reading.labels == {} and reading.labels is not Reading("x", 1).labels
    with pytest.raises(dataclasses.FrozenInstanceError):
        reading.value = 1.0  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(Reading)] == [
        "name",
        "value",
        "labels",
        "kind",
        "unit",
    ]


def test_snapshot_lookups_by_name() -> None:
    snapshot = Snapshot(0.0, "n", tuple(READINGS))
    assert snapshot.total("hyperagent_gpu_power_watts") == pytest.approx(232.8 + 1e-7)
    assert snapshot.value("hyperagent_ccr_ratio", method="estimated") == 0.25
    assert snapshot.value("hyperagent_ccr_ratio", method="reported") is None
    assert snapshot.values("hyperagent_absent") == [] and snapshot.total("absent") is None
    assert snapshot == Snapshot(0.0, "n", tuple(READINGS))


class Counting:
    """A source that counts its reads and fails when told to."""

    def __init__(self, name: str) -> None:
        self.name, self.target = name, "local"
        self.reads = 0
        self.failing = False

    async def start(self) -> None:
        return None

    async def read(self) -> list[Reading]:
        self.reads += 1
        if self.failing:
            raise RuntimeError("broken")
        return [Reading(f"hyperagent_{self.name}_reads", self.reads)]

    async def close(self) -> None:
        return None


async def test_runner_reads_a_slowed_source_at_its_own_interval() -> None:
    fast, slow = Counting("fast"), Counting("slow")
    runner = SourceRunner([fast, slow], timeout_s=1.0, intervals={"slow": 0.3})
    await runner.start()
    repeated = [(await runner.read_by_source())["slow"][0].value for _ in range(4)]
    assert fast.reads == 4 and slow.reads == 1 and repeated == [1, 1, 1, 1]
    await asyncio.sleep(0.3)
    assert (await runner.read_by_source())["slow"][0].value == 2
    slow.failing = True
    await asyncio.sleep(0.3)
    assert "slow" not in await runner.read_by_source()
    assert "slow" not in await runner.read_by_source()  # down, and not read again before due
    assert slow.reads == 3 and fast.reads == 7
    up = [r for r in runner.health_readings() if r.name == "hyperagent_source_up"]
    assert [r.value for r in up] == [1.0, 0.0]


async def test_health_readings_are_reused_only_while_unchanged() -> None:
    source = Counting("x")
    runner = SourceRunner([source], timeout_s=1.0)
    await runner.start()
    await runner.read_all()

    def up() -> Reading:
        return next(r for r in runner.health_readings() if r.name == "hyperagent_source_up")

    before = up()
    await runner.read_all()
    assert up() is before and before.value == 1.0
    source.failing = True
    await runner.read_all()
    assert up().value == 0.0
    errors = [r for r in runner.health_readings() if r.name == "hyperagent_source_errors_total"]
    assert errors[0].value == 1 and errors[0].kind is Kind.COUNTER


async def test_the_real_gpu_call_counter_counts_what_nvml_source_calls() -> None:
    """``--real-gpus`` counts pynvml's calls through ``workers.CountingNvml``: over a fake that
    counts its own calls too, both agree, and the source reads through it unchanged."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from workers import CountingNvml, nvml_read_calls
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from hyperagent.capture.fake_nvml import FakeNvml
    from hyperagent.sources.nvml import NvmlSource

    fake = FakeNvml.from_capture(REPO / "fixtures" / "nvidia-smi" / "gtx-8card.xml")
    counting = CountingNvml(fake)
    source = NvmlSource(counting, event_wait_ms=20)
    await source.start()
    watcher = source.telemetry.events_thread
    try:
        readings = await source.read()
    finally:
        await source.close()
    if watcher is not None:
        watcher.join(timeout=10)  # its last calls (free, shutdown) land before the counts
    assert len([r for r in readings if r.name == "hyperagent_gpu_power_watts"]) == 8
    calls = nvml_read_calls(counting)
    assert calls is not None
    wanted = {k: v for k, v in fake.call_counts().items() if not k.startswith("nvmlEventSetWait")}
    assert calls() == wanted
    assert calls()["nvmlDeviceGetFieldValues"] == 16  # the cycle's batch and the health batch
