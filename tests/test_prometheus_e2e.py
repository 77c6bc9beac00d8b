"""A real Prometheus, with the shipped configuration and rules, scrapes an agent replaying the
full-node capture directory, one replaying a real H200's recording, and a coordinator tuning a
simulated two-node job: every rule evaluates, the alerts that should be active are (with their
runbook link under the runbook_base external label), the healthy nodes raise no memory-pressure
alert, and every query of every Grafana panel (and every template variable) returns data."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hyperagent.agent import Agent
from hyperagent.capture.directory import capture_sources
from hyperagent.config import build_config
from hyperagent.demo import JOB, simulated_cluster
from hyperagent.exporter import MetricsServer, SnapshotCollector
from hyperagent.sources import pdu
from hyperagent.sources.host import HostSource

from conftest import FIXTURES, REPO, free_port, require_binary, wait_for_port

FULL_NODE = FIXTURES / "replay" / "full-node"
H200 = FIXTURES / "replay" / "h200-bf16-matmul"
"""A real H200 recorded under load: its GPU remaps rows, where full-node's V100S retire pages."""
RUNBOOK_BASE = "https://runbooks.e2e.test/hyperagent/rules"
ATTRIBUTION = re.compile(
    r"hyperagent_gpu_job_info|hyperagent_job_gpus|hyperagent_job_node_power"
    r"|hyperagent_job_gpu_(utilization|sm_active|memory_used|power|energy)"
    r"|(node_job_id|job_id):hyperagent_gpu_power_watts:sum"
)
"""Queries of the job attribution (hyperagent_gpu_job_info and the per-job series
hyperagent_job_gpu*, exported by the agent for the jobs holding GPUs): they need data only
once an agent exports it (tests/test_job_report.py serves them to Prometheus)."""
RULES = REPO / "rules" / "hyperagent.rules.yml"
DASHBOARDS = sorted((REPO / "grafana" / "dashboards").glob("*.json"))
CLUSTER = "e2e"
NODE_OUTLETS = ("1", "3")
"""The APC walk's outlets 1 (163 W) and 3 (81 W) play the replayed node's power feeds."""
RATE_INTERVAL = "1m"
DEADLINE_S = 45.0
RDMA_HERE = Path("/sys/class/infiniband").is_dir()


class Prometheus:
    """A prometheus server on a loopback port with the shipped config, rules and targets."""

    def __init__(self, workdir: Path, nodes: list[str], coordinators: list[str]) -> None:
        self.binary = require_binary("prometheus", "prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        targets = workdir / "targets"
        targets.mkdir()
        for name, addresses in (("nodes", nodes), ("coordinator", coordinators)):
            entry = [{"targets": addresses, "labels": {"cluster": CLUSTER}}]
            (targets / f"hyperagent-{name}.json").write_text(json.dumps(entry))
        self.config = workdir / "prometheus.yml"
        self.config.write_text(shipped_config(targets))
        self.tsdb = workdir / "tsdb"
        self.log = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self.tsdb}",
                "--web.enable-lifecycle",
            ],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port, timeout_s=20)
        deadline = time.monotonic() + 20
        while not self.ready():
            assert time.monotonic() < deadline, self.log.read_text()[-2000:]
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(OSError):
            urllib.request.urlopen(
                urllib.request.Request(f"{self.url}/-/quit", method="POST"), timeout=5
            ).close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:  # a bad query: 400 with the reason in JSON
            text = e.read().decode(errors="replace")
            assert text.startswith("{"), f"{path} {params}: HTTP {e.code} {text[:300]}"
            body = json.loads(text)
        assert body["status"] == "success", f"{path} {params}: {body.get('error')}"
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await asyncio.to_thread(self.get, "/api/v1/query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [data["result"]]


def shipped_config(targets: Path) -> str:
    """rules/prometheus.yml pointed at this repository's rules and ``targets``, scraping and
    evaluating every second, with the runbook_base external label an operator sets."""
    text = (REPO / "rules" / "prometheus.yml").read_text()
    for old, new in (
        ("scrape_interval: 15s", "scrape_interval: 1s"),
        (
            "evaluation_interval: 15s",
            f"evaluation_interval: 1s\n  external_labels:\n    runbook_base: {RUNBOOK_BASE}",
        ),
        ("/etc/prometheus/rules/", f"{REPO / 'rules'}/"),
        ("/etc/prometheus/targets/", f"{targets}/"),
    ):
        assert old in text, f"rules/prometheus.yml no longer says {old!r}"
        text = text.replace(old, new)
    return text


@contextlib.contextmanager
def serving(collectors: list[SnapshotCollector]) -> Iterator[list[str]]:
    """A /metrics server on a free loopback port per collector; yields their addresses."""
    servers = [MetricsServer("127.0.0.1:0", c) for c in collectors]
    try:
        for server in servers:
            server.start()
        yield [f"127.0.0.1:{s.port}" for s in servers]
    finally:
        for server in servers:
            server.stop()


@contextlib.asynccontextmanager
async def replayed_node(workdir: Path) -> AsyncIterator[Agent]:
    """An agent over the full-node capture, its PDU outlets configured, and the host source
    reading a procfs root with this machine's stat, meminfo, vmstat and pressure/memory (PSI;
    a kernel without it: one that saw no stall), where kernel.numa_balancing is 1."""
    procfs = workdir / "proc"
    (procfs / "sys" / "kernel").mkdir(parents=True)
    (procfs / "pressure").mkdir()
    for name in ("stat", "meminfo", "vmstat"):
        shutil.copyfile(f"/proc/{name}", procfs / name)
    try:
        shutil.copyfile("/proc/pressure/memory", procfs / "pressure" / "memory")
    except FileNotFoundError:
        (procfs / "pressure" / "memory").write_text(
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        )
    (procfs / "sys" / "kernel" / "numa_balancing").write_text("1\n")
    config = build_config(
        {
            "node": "full-node",
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(workdir / "agent")},
        }
    )
    sources, hardware = capture_sources(FULL_NODE, config)
    outlets = pdu.PduTarget("rack01-pdu", "replay", outlets=NODE_OUTLETS, inlets=True)
    sources = [s for s in sources if s.name != "pdu"]
    sources += pdu.pdu_sources([outlets], replay_dir=FULL_NODE / "pdu")
    sources.append(HostSource(procfs_root=procfs))
    async with running(Agent(config, hardware, sources=sources)) as agent:
        yield agent


@contextlib.asynccontextmanager
async def recorded_node(workdir: Path) -> AsyncIterator[Agent]:
    """An agent replaying the H200 recording (its nvml, host and job sources)."""
    config = build_config(
        {
            "node": "h200",
            "mqtt": {"enabled": False},
            "agent": {"metrics_address": "", "state_dir": str(workdir / "h200")},
        }
    )
    sources, hardware = capture_sources(H200, config)
    async with running(Agent(config, hardware, sources=sources)) as agent:
        yield agent


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    """``agent`` running in the background once it is ready."""
    task = asyncio.create_task(agent.run(), name=f"replayed-agent-{agent.config.node}")
    try:
        await asyncio.wait_for(agent.ready.wait(), timeout=20)
        yield agent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def panel_queries(
    instances: list[str], cluster: str = CLUSTER, job_id: str = JOB
) -> list[tuple[str, str]]:
    """(dashboard and panel title, PromQL) of every target, template variables filled in."""
    values = {
        "cluster": cluster,
        "instance": "|".join(instances),
        "job_id": job_id,
        "__rate_interval": RATE_INTERVAL,
        "__range": "5m",
    }
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], target["expr"])
                out.append((f"{dashboard['uid']}: {panel['title']}", expr))
    return out


def variable_queries(cluster: str = CLUSTER) -> list[tuple[str, str, str]]:
    """(variable, metric selector, label) of every label_values() template variable."""
    out = []
    for path in DASHBOARDS:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] == "query":
                match = re.fullmatch(r"label_values\((.+), *(\w+)\)", variable["query"])
                assert match, variable["query"]
                selector = match.group(1).replace("$cluster", cluster)
                out.append((variable["name"], selector, match.group(2)))
    return out


async def wait_until_data(
    prometheus: Prometheus, queries: list[tuple[str, str]], deadline: float
) -> dict[str, list[str]]:
    """Query until every expression returns data or the deadline passes; the ones without."""
    empty: dict[str, list[str]] = {}
    for where, expr in queries:
        empty.setdefault(expr, []).append(where)
    while empty and time.monotonic() < deadline:
        for expr in list(empty):
            if await prometheus.query(expr):
                del empty[expr]
        if empty:
            await asyncio.sleep(1)
    return empty


@pytest.mark.timeout(120)
async def test_every_panel_and_rule_works_on_a_real_prometheus(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + DEADLINE_S
    async with (
        replayed_node(tmp_path) as replayed,
        recorded_node(tmp_path) as h200,
        simulated_cluster(mosquitto.url, nodes=2, trials=100, seed=0, speedup=100) as (
            coordinator,
            sim_nodes,
            _,
        ),
    ):
        tuning = asyncio.create_task(coordinator.run(), name="coordinator")
        agents = [replayed.collector, h200.collector, *(n.agent.collector for n in sim_nodes)]
        with serving(agents) as nodes, serving([coordinator.collector]) as coordinators:
            prometheus = Prometheus(tmp_path, nodes, coordinators)
            prometheus.start()
            try:
                await check(prometheus, replayed, nodes, deadline)
            finally:
                prometheus.stop()
                tuning.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tuning


async def check(prometheus: Prometheus, replayed: Agent, nodes: list[str], deadline: float) -> None:
    full_node, simulated = nodes[0], nodes[2:]
    scraped = f'hyperagent_gpu_info{{instance="{full_node}"}}'
    assert not await wait_until_data(prometheus, [("replayed GPUs", scraped)], deadline), (
        prometheus.log.read_text()[-2000:]
    )
    # a GPU's first XID creates its series: the alert must see it although increase() cannot
    assert replayed.hardware.nvml is not None
    replayed.hardware.nvml.inject_xid(0, 48)

    queries = panel_queries(nodes)
    attribution = [(where, expr) for where, expr in queries if ATTRIBUTION.search(expr)]
    for _, expr in attribution:
        # valid; their data needs hardware these replays lack (SM activity, a node's power
        # feeds while one job holds it): tests/test_job_report.py serves it
        await prometheus.query(expr)
    queries = [query for query in queries if query not in attribution]
    missing = await wait_until_data(prometheus, queries, deadline)
    assert not missing, f"queries without data: {missing}"

    expected = {"cluster": {CLUSTER}, "instance": set(nodes), "job_id": {JOB}}
    for name, selector, label in variable_queries():
        values = {s["metric"].get(label) for s in await prometheus.query(selector)}
        assert expected[name] <= values, (name, selector, values)

    active = [
        f'ALERTS{{alertname="HyperagentGpuXidError", alertstate="firing", instance="{full_node}"}}',
        f'ALERTS{{alertname="HyperagentNumaBalancingEnabled", instance="{full_node}"}}',
    ]
    missing = await wait_until_data(prometheus, [("alert", a) for a in active], deadline)
    assert not missing, f"alerts not active: {missing}"
    assert await prometheus.query('ALERTS{alertname="HyperagentSourceDown"}') == []
    # GPUs 91-99% used by a caching allocator under healthy training: no pressure, not pending
    assert await prometheus.query('ALERTS{alertname="HyperagentHighMemoryPressure"}') == []
    xid = [
        alert
        for alert in (await asyncio.to_thread(prometheus.get, "/api/v1/alerts"))["alerts"]
        if alert["labels"]["alertname"] == "HyperagentGpuXidError"
    ]
    assert xid and {a["annotations"]["runbook_url"] for a in xid} == {
        f"{RUNBOOK_BASE}/RUNBOOK.md#gpu-xid-error"
    }
    if not RDMA_HERE:  # the simulated nodes' RDMA source finds no hardware: up 0, no error
        absent = await prometheus.query('hyperagent_source_up{source="rdma"} == 0')
        assert {s["metric"]["instance"] for s in absent} == set(simulated)

    groups = (await asyncio.to_thread(prometheus.get, "/api/v1/rules"))["groups"]
    evaluated = [rule for group in groups for rule in group["rules"]]
    shipped = yaml.safe_load(RULES.read_text())["groups"]
    assert len(evaluated) == sum(len(group["rules"]) for group in shipped)
    assert [(r["name"], r.get("lastError")) for r in evaluated if r["health"] != "ok"] == []

    power = {
        "node:hyperagent_pdu_node_power_watts:sum": 163 + 81,
        "node:hyperagent_bmc_power_watts:max": 208,
    }
    for rule, watts in power.items():
        samples = await prometheus.query(f'{rule}{{instance="{full_node}"}}')
        assert [float(s["value"][1]) for s in samples] == [watts], rule
