"""Drive a JobTuning the way the coordinator does, with nodes that answer as told: a test
harness for the pure machine (no broker, no clock: time is the test's)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hyperagent.config import CoordinatorSection, JobTuningSection, build_config
from hyperagent.tuner import tuning
from hyperagent.tuner.discovery import JobView, NodeBounds, Sighting, plan_space
from hyperagent.tuner.journal import Journal, JournalState

Score = Callable[[Mapping[str, Any]], float]


def coordinator_section(**defaults: Any) -> CoordinatorSection:
    raw = {"coordinator": {"defaults": {"tune": "all", **defaults}}}
    return build_config(raw).coordinator


def view(
    job: str,
    nodes: Iterable[str],
    ranks_per_node: int = 8,
    bounds: Mapping[str, NodeBounds] | None = None,
    **said: Any,
) -> JobView:
    nodes = tuple(nodes)
    world = ranks_per_node * len(nodes)
    sightings = {
        n: Sighting(
            n,
            0.0,
            ranks_per_node,
            tuple(range(i * ranks_per_node, (i + 1) * ranks_per_node)),
            world,
            ranks_per_node,
            **{"gpus": tuple(range(ranks_per_node)), **said},
        )
        for i, n in enumerate(nodes)
    }
    bounds = {n: NodeBounds(power_cap=True) for n in nodes} | dict(bounds or {})
    return JobView(job, nodes, world, world, "", sightings, bounds)


def empty_view(job: str) -> JobView:
    return JobView(job, (), 0, None, "", {}, {})


@dataclass
class Nodes:
    """Simulated agents: each acks a published version and reports a measurement of it
    whose throughput is ``score(settings)`` split over the nodes (deterministic windows)."""

    names: tuple[str, ...]
    score: Score
    refuse: dict[str, str] = field(default_factory=dict)
    """node -> refusal kind ("settings" or "node") for every version it is sent."""
    silent: set[str] = field(default_factory=set)
    energy: bool = True
    joules_per_sample: Callable[[Mapping[str, Any]], float] = lambda settings: 0.5
    """A node's energy per sample at these settings (reported when ``energy``)."""
    measure_s: float = 0.0
    """How long after its ack a node's report comes (the trial's wall time)."""
    refuses: Callable[[str, Mapping[str, Any]], str | None] | None = None
    """(node, settings) -> refusal kind, or None: refusals that depend on the settings."""

    def refusal(self, node: str, settings: Mapping[str, Any]) -> str | None:
        """The kind of refusal ``node`` answers ``settings`` with (None: it applies them)."""
        if self.refuses is not None and (kind := self.refuses(node, settings)) is not None:
            return kind
        return self.refuse.get(node)

    def ack(self, now: float, publish: tuning.Publish, node: str) -> tuning.Ack:
        kind = self.refusal(node, publish.settings)
        message: dict[str, Any] = {
            "job": "j",
            "node": node,
            "version": publish.version,
            "ok": kind is None,
            "error": None if kind is None else f"refused ({kind})",
            "applied": {},
            "stalled": False,
        }
        if kind is not None:
            message["refusal"] = kind
        return tuning.Ack(now, message)

    def report(self, now: float, publish: tuning.Publish, node: str) -> tuning.Report:
        total = self.score(publish.settings)
        per_node = total / len(self.names)
        windows = [per_node * (1 + d) for d in (-0.01, 0.0, 0.01, 0.0)]
        samples = per_node * 10.0
        return tuning.Report(
            now,
            {
                "job": "j",
                "node": node,
                "version": publish.version,
                "trial": publish.trial,
                "samples": samples,
                "seconds": 10.0,
                "throughput": per_node,
                "windows": windows,
                "steps": 40,
                "energy_j": samples * self.joules_per_sample(publish.settings)
                if self.energy
                else None,
                "nonfinite_loss": False,
                "xid_errors": 0.0,
                "partial": False,
                "stalled": False,
            },
        )


@dataclass
class Driver:
    """Runs a JobTuning's effects: journals into a real journal file, asks its tuner at once,
    and (with ``nodes``) answers each publish."""

    machine: tuning.JobTuning
    journal: Journal
    nodes: Nodes | None = None
    now: float = 0.0
    published: list[tuning.Publish] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    measured: list[Any] = field(default_factory=list)
    answer: bool = True
    reports: dict[str, tuning.Report] = field(default_factory=dict)
    """node -> the last report it sent (what it resends until the coordinator confirms it)."""

    def feed(self, event: tuning.Event) -> None:
        queue = [event]
        while queue:
            effects = self.machine.handle(queue.pop(0))
            for effect in effects:
                queue += self._do(effect)

    def _do(self, effect: tuning.Effect) -> list[tuning.Event]:
        if isinstance(effect, tuning.Journal):
            self.journal.append(effect.entry).result()
        elif isinstance(effect, tuning.Ask):
            return [tuning.Asked(self.now, effect.token, effect.tuner.ask())]
        elif isinstance(effect, tuning.Say):
            self.said.append(effect.text)
        elif isinstance(effect, tuning.Measured):
            self.measured.append(effect.record)
        elif isinstance(effect, tuning.Publish):
            self.published.append(effect)
            if self.nodes is not None and self.answer and effect.plan is not None:
                answering = [n for n in effect.nodes if n not in self.nodes.silent]
                events: list[tuning.Event] = [
                    self.nodes.ack(self.now, effect, node) for node in answering
                ]
                self.now += self.nodes.measure_s
                for node in answering:
                    if self.nodes.refusal(node, effect.settings) is None:
                        self.reports[node] = self.nodes.report(self.now, effect, node)
                        events.append(self.reports[node])
                return events
        return []

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.feed(tuning.Tick(self.now))

    def run_until_done(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if self.machine.done:
                return
            wake = self.machine.wake_at()
            self.now = max(self.now + 0.001, wake if wake is not None else self.now + 1.0)
            self.feed(tuning.Tick(self.now))
        raise AssertionError(f"not done after {limit} ticks: {self.machine.state}")


def begin(
    job: str,
    nodes: tuple[str, ...],
    journal_path: Any,
    section: CoordinatorSection,
    answers: Nodes | None = None,
    journal: JournalState | None = None,
    bounds: Mapping[str, NodeBounds] | None = None,
    **said: Any,
) -> Driver:
    """A machine for ``job`` found on ``nodes``, begun (its journal resumed if any)."""
    cfg: JobTuningSection = section.tuning(job, nodes)
    file = Journal(journal_path)
    loaded = file.load() if journal is None else journal
    machine = tuning.JobTuning(job, cfg, loaded)
    driver = Driver(machine, file, answers)
    v = view(job, nodes, bounds=bounds, **said)
    driver.feed(tuning.Seen(0.0, v))
    start = cfg.start.model_dump()
    if start["power_cap_w"] is None and cfg.power_limits_w:
        start["power_cap_w"] = cfg.power_limits_w[1]
    driver.feed(tuning.Begin(0.0, cfg, plan_space(cfg, v), start))
    return driver


def trial_entry(
    index: int,
    settings: dict[str, Any],
    throughput: float | None,
    seconds: float = 10.0,
    status: str = "ok",
    nodes: int = 2,
    energy_per_s: float | None = None,
    confirmation: bool = False,
) -> dict[str, Any]:
    """A journal trial entry whose ``nodes`` nodes each measured half the job's rate for 5 s."""
    reports: dict[str, Any] = {}
    if throughput is not None:
        for n in range(nodes):
            reports[f"node-{n}"] = {
                "throughput": throughput / nodes,
                "samples": throughput / nodes * 5,
                "seconds": 5.0,
                "energy_j": None if energy_per_s is None else energy_per_s / nodes * 5,
                "windows": [throughput / nodes] * 4,
            }
    if status == "ok" and throughput is not None:
        score: float | None = throughput
        if energy_per_s is not None:
            score = throughput / energy_per_s
    else:
        score = None
    return {
        "type": "trial",
        "index": index,
        "version": index + 1,
        "settings": settings,
        "score": score,
        "status": status,
        "reports": reports,
        "seconds": seconds,
        **({"confirmation": True} if confirmation else {}),
    }
