"""The whole loop on one machine: broker, coordinator, N agents over fake GPUs, a simulated job.

Each node is a real Agent (fake NVML replaying an 8 x V100S capture taken under training load;
or, with ``capture_dir``, fake amdsmi or HLML replaying an AMD or Gaudi capture directory) with
a simulated training rank reporting through a real JobReporter. The coordinator tunes the
job over MQTT; the agents cap the fake GPUs' power and hand the other knobs to the job, whose
speed and power follow the applied settings. Time inside the job runs ``speedup`` x faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hyperagent import durable
from hyperagent.agent import Agent
from hyperagent.capture.directory import replayed_library
from hyperagent.capture.fake_nvml import FakeNvml
from hyperagent.config import Config, build_config
from hyperagent.coordinator import Coordinator, coordinator_link
from hyperagent.devices import as_library
from hyperagent.devices.base import MW_PER_W
from hyperagent.devices.nvml import NvmlLibrary
from hyperagent.job import KNOBS, JobReporter
from hyperagent.signing import SigningKey, TrustedKeys
from hyperagent.sim import JobModel
from hyperagent.sources import Hardware
from hyperagent.tuner.jobstate import TrialRecord
from hyperagent.tuner.tuning import JobTuning

if TYPE_CHECKING:
    from hyperagent.exporter import MetricsServer

log = logging.getLogger(__name__)

DEMO_CAPTURE = "gtx-8card.xml"
JOB = "demo-job"
JOB_DEFAULTS = {"bucket_mb": 25, "chunk_kb": 4096, "allreduce": "ring"}
"""What the simulated job runs before any setting arrives: PyTorch DDP's 25 MB buckets."""
JOB_KNOBS = KNOBS
"""What the simulated job applies at a step boundary, announced when it attaches."""


def demo_capture() -> Path:
    """The packaged 8 x V100S-PCIE-32GB ``nvidia-smi -q -x`` capture taken under training load."""
    return Path(str(resources.files("hyperagent").joinpath("data", DEMO_CAPTURE)))


class SimulatedGpus(Protocol):
    """A node's fake GPUs as the simulated rank drives them, whatever the vendor."""

    def count(self) -> int: ...

    def set_load(self, index: int, util_pct: float, power_w: float) -> None: ...

    def cap_w(self) -> float:
        """The power cap in force on the first GPU."""


@dataclass
class NvmlGpus:
    nvml: FakeNvml

    def count(self) -> int:
        return NvmlLibrary(self.nvml).count()

    def set_load(self, index: int, util_pct: float, power_w: float) -> None:
        self.nvml.set_load(index, util_gpu_pct=round(util_pct), power_draw_w=power_w)

    def cap_w(self) -> float:
        return NvmlLibrary(self.nvml).by_index(0).enforced_power_limit_mw() / MW_PER_W


@dataclass
class VendorGpus:
    """FakeAmdsmi's or FakeHlml's devices."""

    fake: Any

    def count(self) -> int:
        return len(self.fake.devices)

    def set_load(self, index: int, util_pct: float, power_w: float) -> None:
        self.fake.set_load(index, util_pct=util_pct, power_w=power_w)

    def cap_w(self) -> float:
        return float(self.fake.power_cap_w(0))


@dataclass(frozen=True)
class DemoHardware:
    """What one node of the demo runs on: its fake library and the agent's view of it."""

    gpus: SimulatedGpus
    hardware: Hardware
    sources: dict[str, Any]
    """The ``[sources]`` config that reads it."""
    nvml: FakeNvml | None = None


def demo_hardware(capture_dir: Path | None, clock: Callable[[], float]) -> DemoHardware:
    """Fake GPUs replaying ``capture_dir`` (an AMD or Gaudi capture directory; None: the
    packaged V100S capture, through NVML)."""
    if capture_dir is None:
        nvml = FakeNvml.from_capture(demo_capture(), clock=clock)
        return DemoHardware(NvmlGpus(nvml), Hardware(nvml=nvml), {}, nvml)
    replayed = replayed_library(capture_dir, clock)
    if replayed is None:
        raise ValueError(
            f"{capture_dir}: no AMD (amd-smi, rocm-smi), Gaudi (hl-smi) or Intel (xpu-smi) capture"
        )
    fake, library, name = replayed
    sources: dict[str, Any] = {"nvml": {"enabled": False}, name: {"enabled": True}}
    tools = {name: fake.run} if library is None else {}
    if tools:  # a text tool, read every collection as the vendor libraries are
        sources[name]["interval_s"] = 1.0
    hardware = Hardware(nvml=None, accelerators=library, tools=tools)
    return DemoHardware(VendorGpus(fake), hardware, sources)


def demo_power_limits_w(capture_dir: Path | None) -> tuple[float, float]:
    """The power-cap range the demo's coordinator searches: the devices' own, where a device
    accepts down to 0 W (AMD Instinct) from half its maximum, as an operator would set it."""
    probe = demo_hardware(capture_dir, lambda: 0.0)
    if probe.hardware.power_library is None:  # a telemetry-only tool: its recorded range
        record = probe.gpus.fake.devices[0].record  # type: ignore[attr-defined]
        return float(record.min_power_cap_w), float(record.max_power_cap_w)
    device = as_library(probe.hardware.power_library).power_devices()[0]
    low_mw, high_mw = device.power_limit_constraints_mw()
    low, high = low_mw / 1000, high_mw / 1000
    return (high / 2 if low <= 0 else low), high


class VirtualClock:
    """Job time of one simulated node: advanced by the steps it runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class SimulatedNode:
    """One node: fake GPUs, an agent over them, and one simulated training rank."""

    name: str
    nvml: FakeNvml | None
    """The node's fake NVML (None on AMD or Gaudi: see ``gpus``)."""
    clock: VirtualClock
    agent: Agent
    reporter: JobReporter
    versions_run: list[int] = field(default_factory=list)
    nan_loss: bool = False
    """Fault injection: the rank reports a NaN loss while this is set."""
    stalled: bool = False
    """Fault injection: the rank stops stepping (a hung or crashed job) while this is set."""
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    gpus: SimulatedGpus | None = None

    def __post_init__(self) -> None:
        if self.gpus is None:
            assert self.nvml is not None
            self.gpus = NvmlGpus(self.nvml)

    def stop(self) -> None:
        """The node goes away: its agent (which says offline on the way out) and its rank."""
        for task in self.tasks:
            task.cancel()

    def power_cap_w(self) -> float:
        assert self.gpus is not None
        return self.gpus.cap_w()


async def run_rank(
    node: SimulatedNode, model: JobModel, speedup: float, rng: random.Random
) -> None:
    """Train forever: apply new settings at step boundaries, step, report."""
    knobs: dict[str, Any] = dict(JOB_DEFAULTS)
    assert node.gpus is not None
    gpus = node.gpus.count()
    while True:
        if node.stalled:
            await asyncio.sleep(0.05)
            continue
        new = node.reporter.poll_settings()
        if new is not None:
            knobs = dict(new.settings)
        step = model.step({**knobs, "power_cap_w": node.power_cap_w()}, rng)
        for i in range(gpus):
            node.gpus.set_load(i, step.gpu_util * 100, step.gpu_power_w)
        node.clock.advance(step.step_s)
        if not node.versions_run or node.versions_run[-1] != node.reporter.version:
            node.versions_run.append(node.reporter.version)
        loss = math.nan if node.nan_loss else 2.0
        node.reporter.report_step(step.samples, step.step_s, step.compute_s, step.comm_s, loss)
        await asyncio.sleep(step.step_s / speedup)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def embedded_broker() -> Any:
    """An MQTT broker (rumqttd via iotcore) on a free loopback port; yields its URL."""
    from iotcore import Broker

    port = free_port()
    broker = Broker(port=port, listen="127.0.0.1")
    broker.start()
    try:
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        broker.stop()


@dataclass
class DemoResult:
    state: JobTuning
    nodes: list[SimulatedNode]
    model: JobModel
    journal: Path | None = None
    """The coordinator's journal of the tuning (gone once the demo ends, unless it was given
    a ``state_dir``)."""

    @property
    def start_settings(self) -> dict[str, Any]:
        return self.state.trials[0].settings

    @property
    def best_settings(self) -> dict[str, Any]:
        assert self.state.best is not None
        return self.state.best[0]

    @property
    def simulated_gain(self) -> float:
        """Gain of the chosen settings over the starting ones on the noiseless model."""
        objective = self.state.config.objective
        return (
            self.model.score(self.best_settings, objective)
            / self.model.score(self.start_settings, objective)
            - 1
        )


def cluster_config(
    broker_url: str | list[str],
    nodes: int,
    trials: int,
    seed: int,
    workdir: Path,
    objective: str,
    power_limits_w: tuple[float, float],
) -> dict[str, Any]:
    """Raw config shared by the demo's agents and coordinator."""
    return {
        "cluster": "demo",
        "mqtt": {"url": broker_url, "reconnect_min_s": 0.2, "reconnect_max_s": 2.0},
        "agent": {"interval_s": 1.0, "metrics_address": "", "state_dir": str(workdir)},
        "sources": {"host": {"enabled": False}, "ipmi": {"enabled": False}},
        "coordinator": {
            "metrics_address": "",
            "state_dir": str(workdir / "coordinator"),
            "jobs": [
                {
                    "id": JOB,
                    "nodes": [f"node-{i}" for i in range(nodes)],
                    "backend": "nccl",
                    "objective": objective,
                    "trials": trials,
                    "patience": max(10, trials // 2),
                    "power_limits_w": list(power_limits_w),
                    "seed": seed,
                    "ack_timeout_s": 10,
                    "trial_timeout_s": 60,
                }
            ],
        },
    }


@contextlib.asynccontextmanager
async def simulated_cluster(
    broker_url: str | list[str],
    nodes: int,
    trials: int,
    seed: int = 0,
    *,
    objective: str = "throughput",
    params_b: float = 1.3,
    speedup: float = 40.0,
    key: SigningKey | None = None,
    trusted: TrustedKeys | None = None,
    job_overrides: Mapping[str, Any] | None = None,
    coordinator_dir: Path | None = None,
    on_trial: Callable[[JobTuning, TrialRecord], None] | None = None,
    job_knobs: tuple[str, ...] | None = JOB_KNOBS,
    capture_dir: Path | None = None,
    cluster: str = "demo",
    spread_brokers: bool = False,
    mqtt: Mapping[str, Any] | None = None,
    state_dir: Path | None = None,
    metrics: MetricsServer | None = None,
) -> AsyncIterator[tuple[Coordinator, list[SimulatedNode], JobModel]]:
    """Agents and simulated ranks running in the background, and a coordinator ready to run.
    The ranks announce ``job_knobs`` as the knobs they apply (None: they do not say). The
    nodes' GPUs replay ``capture_dir`` (an AMD or Gaudi capture directory) where given, else
    the packaged V100S capture. ``cluster`` names the topic tree (clusters sharing a broker
    keep apart). With several broker URLs and ``spread_brokers``, node ``i`` tries them from the
    ``i``-th on (the agents spread across a clustered broker's nodes); ``mqtt``: more of the
    ``[mqtt]`` section, for every daemon. Settings are signed by ``key`` (default: a key made
    for this cluster only); the agents trust ``trusted`` (default: that key). The coordinator's
    journals (unless ``coordinator_dir``) and the agents' state go under ``state_dir`` where
    given (``coordinator``, ``node-0``, ...), else into a temporary directory removed at the
    end; with ``metrics`` (a started MetricsServer) the coordinator's /metrics are its."""
    key = key or SigningKey.generate()
    trusted = trusted or key.trusted()
    low, high = demo_power_limits_w(capture_dir)
    gpus_per_node = demo_hardware(capture_dir, lambda: 0.0).gpus.count()
    with tempfile.TemporaryDirectory(prefix="hyperagent-demo-") as tmp:
        workdir = Path(tmp)
        kept = state_dir if state_dir is not None else workdir
        raw = cluster_config(broker_url, nodes, trials, seed, kept, objective, (low, high))
        raw["cluster"] = cluster
        if metrics is not None:
            raw["coordinator"]["metrics_address"] = f"{metrics.host}:{metrics.port}"
        raw["mqtt"].update(mqtt or {})
        raw["coordinator"]["jobs"][0].update(job_overrides or {})
        if coordinator_dir is not None:
            raw["coordinator"]["state_dir"] = str(coordinator_dir)
        model = JobModel(params_b, nodes, gpus_per_node, power_limits_w=(low, high))
        spread = None if not spread_brokers or isinstance(broker_url, str) else broker_url
        maker = _NodeMaker(
            raw, nodes, gpus_per_node, spread, capture_dir, workdir, kept, trusted, job_knobs
        )
        sim_nodes = [maker.node(i) for i in range(nodes)]
        coordinator_config: Config = build_config(raw, {"node": "coordinator"})
        link = coordinator_link(coordinator_config)
        coordinator = Coordinator(
            coordinator_config,
            link,
            key,
            on_trial=on_trial,
            collector=metrics.collector if metrics is not None else None,
        )
        rng = random.Random(seed)
        try:
            async with asyncio.TaskGroup() as tasks:
                await _start(tasks, sim_nodes, model, speedup, rng)
                try:
                    yield coordinator, sim_nodes, model
                finally:
                    for n in sim_nodes:
                        n.stop()
        finally:
            for n in sim_nodes:
                n.reporter.close()
            await asyncio.to_thread(durable.wait)  # nothing is written into a removed folder


@dataclass(frozen=True)
class _NodeMaker:
    """What every simulated node of a cluster is made from."""

    raw: Mapping[str, Any]
    nodes: int
    gpus_per_node: int
    spread: list[str] | None
    """Brokers node ``i`` tries from the ``i``-th on; None: the configured ones in order."""
    capture_dir: Path | None
    workdir: Path
    state_dir: Path
    trusted: TrustedKeys
    job_knobs: tuple[str, ...] | None

    def node(self, index: int) -> SimulatedNode:
        """Node ``index``: its GPUs, agent and rank's reporter."""
        raw, name = self.raw, f"node-{index}"
        clock = VirtualClock()
        node_hw = demo_hardware(self.capture_dir, clock)
        node_raw = {**raw, "sources": {**raw["sources"], **node_hw.sources}}
        if self.spread is not None:
            turn = index % len(self.spread)
            node_raw["mqtt"] = {**raw["mqtt"], "url": self.spread[turn:] + self.spread[:turn]}
        config = build_config(
            node_raw,
            {
                "node": name,
                "sources.job.socket": str(self.workdir / f"{name}.sock"),
                "agent.state_dir": str(self.state_dir / name),
            },
        )
        agent = Agent.from_config(config, node_hw.hardware, self.trusted)
        # the simulated job runs on every GPU of its node: NVML shows its process there,
        # and its rank (one per node, driving them all) says so for the other vendors
        if node_hw.nvml is not None:
            node_hw.nvml.run_on_every_device(os.getpid())
        reporter = JobReporter(
            JOB,
            rank=index,
            socket_path=config.sources.job.socket,
            knobs=self.job_knobs,
            world_size=self.nodes,
            local_world_size=1,
            tune=True,
            gpus=range(self.gpus_per_node),
        )
        return SimulatedNode(name, node_hw.nvml, clock, agent, reporter, gpus=node_hw.gpus)


async def _start(
    tasks: asyncio.TaskGroup,
    sim_nodes: list[SimulatedNode],
    model: JobModel,
    speedup: float,
    rng: random.Random,
) -> None:
    """Start the nodes' agents, and once every agent is connected, their ranks."""
    for n in sim_nodes:
        n.tasks.append(tasks.create_task(n.agent.run(), name=f"agent-{n.name}"))
    for n in sim_nodes:
        await n.agent.ready.wait()
        await n.agent.link.connected.wait()  # type: ignore[union-attr]
    for n in sim_nodes:
        rank = run_rank(n, model, speedup, random.Random(rng.random()))
        n.tasks.append(tasks.create_task(rank, name=f"rank-{n.name}"))


async def run_demo(
    broker_url: str | list[str],
    nodes: int,
    trials: int,
    seed: int,
    on_trial: Callable[[JobTuning, TrialRecord], None] | None = None,
    report: Path | None = None,
    **kwargs: Any,
) -> DemoResult:
    """Tune the simulated job end to end; returns when the best settings are published.
    With ``report``, a picture of the tuning is drawn there (PNG or HTML) from its journal."""
    async with simulated_cluster(broker_url, nodes, trials, seed, on_trial=on_trial, **kwargs) as (
        coordinator,
        sim_nodes,
        model,
    ):
        await coordinator.run(until_tuned=True)
        state = coordinator.job(JOB)
        if report is not None:
            from hyperagent.report import render_report

            await asyncio.to_thread(render_report, coordinator.journals.path(JOB), report)
        return DemoResult(state, sim_nodes, model, coordinator.journals.path(JOB))
