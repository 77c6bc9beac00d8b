"""The cluster daemon: per job, the trial protocol over MQTT around a Tuner.

ask -> publish signed settings v (retained) -> wait for every node's ack of v -> the agents
settle and measure -> wait for every node's report of v -> score -> tell. After the trial
budget or on convergence it publishes the best settings, without a measurement plan.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperagent import bus
from hyperagent.config import Config, JobTuningSection
from hyperagent.errors import PayloadError
from hyperagent.exporter import SnapshotCollector
from hyperagent.notify import Notifier
from hyperagent.readings import Kind, Reading
from hyperagent.tuner import SearchSpace, Tuner
from hyperagent.tuner.trial import MeasurementPlan, score

log = logging.getLogger(__name__)

POWER_AVERAGING_WINDOW_S = 1.0
"""NVML averages board power over about a second; a power change settles for 3x that."""


@dataclass
class TrialRecord:
    """One finished trial of one job."""

    index: int
    version: int
    settings: dict[str, Any]
    score: float | None
    status: str
    """ok, no_ack, refused, timeout or nonfinite_loss."""
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class JobState:
    """What the coordinator knows about one job's tuning."""

    config: JobTuningSection
    space: SearchSpace
    tuner: Tuner
    version: int = 0
    trials: list[TrialRecord] = field(default_factory=list)
    baseline: float | None = None
    best: tuple[dict[str, Any], float] | None = None
    final_version: int | None = None
    done: bool = False
    current: dict[str, Any] = field(default_factory=dict)
    """The settings last published."""
    trial_started: float | None = None
    """Unix time the running trial's settings went out; None between trials."""
    acks: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    reports: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def gain(self) -> float | None:
        """Best score over the baseline (the starting settings), minus one."""
        if self.best is None or not self.baseline:
            return None
        return self.best[1] / self.baseline - 1


TrialCallback = Callable[[JobState, TrialRecord], None]


def job_readings(state: JobState) -> list[Reading]:
    """The tuning of one job as readings (trials by status, scores, current settings)."""
    job = {"job_id": state.config.id}
    scored = {**job, "objective": state.config.objective}
    out = [
        Reading("hyperagent_tuner_settings_version", state.version, job),
        Reading("hyperagent_tuner_done", float(state.done), job),
    ]
    for status, count in sorted(Counter(t.status for t in state.trials).items()):
        out.append(
            Reading("hyperagent_tuner_trials_total", count, {**job, "status": status}, Kind.COUNTER)
        )
    if state.baseline is not None:
        out.append(Reading("hyperagent_tuner_baseline_score", state.baseline, scored))
    if state.best is not None:
        out.append(Reading("hyperagent_tuner_best_score", state.best[1], scored))
    last = next((t for t in reversed(state.trials) if t.score is not None), None)
    if last is not None:
        out.append(Reading("hyperagent_tuner_last_score", last.score or 0.0, scored))
    if state.trial_started is not None:
        out.append(
            Reading("hyperagent_tuner_trial_started_timestamp_seconds", state.trial_started, job)
        )
    for knob in ("bucket_mb", "chunk_kb", "power_cap_w"):
        value = state.current.get(knob)
        if isinstance(value, int | float):
            out.append(Reading("hyperagent_tuner_setting", float(value), {**job, "knob": knob}))
    if "allreduce" in state.current:
        out.append(
            Reading(
                "hyperagent_tuner_allreduce_info",
                1.0,
                {**job, "algorithm": str(state.current["allreduce"])},
                Kind.INFO,
            )
        )
    return out


class Coordinator:
    """Tunes every job of ``config.coordinator.jobs``; ``run`` returns when all are done."""

    def __init__(
        self,
        config: Config,
        link: bus.MqttLink,
        settings_key: bytes,
        on_trial: TrialCallback | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.link = link
        self.key = settings_key
        self.topics = bus.Topics(config.cluster)
        self.on_trial = on_trial
        self.invalid_payloads = 0
        self.collector = SnapshotCollector()
        self.nodes: dict[str, tuple[bool, float]] = {}
        """node -> (online, time of its last status message), from the retained status topics."""
        self.jobs: dict[str, JobState] = {}
        for job in config.coordinator.jobs:
            space = SearchSpace.default(job.backend, len(job.nodes), job.power_limits_w)
            start = job.start.model_dump()
            if start["power_cap_w"] is None and job.power_limits_w:
                start["power_cap_w"] = job.power_limits_w[1]
            tuner = Tuner(space, seed=job.seed, start=start)
            self.jobs[job.id] = JobState(job, space, tuner)
        link.subscribe(self.topics.ack("+"), 1, self._on_ack)
        link.subscribe(self.topics.report("+"), 1, self._on_report)
        link.subscribe(self.topics.settings("+"), 1, self._on_settings)
        link.subscribe(self.topics.status("+"), 1, self._on_status)
        self.update_metrics()

    async def run(self, until_tuned: bool = False) -> None:
        """Run the MQTT link and every job's tuning; afterwards keep watching the nodes (or,
        with ``until_tuned``, return once every tuning is finished and its settings sent)."""
        try:
            async with asyncio.TaskGroup() as tasks:
                link_task = tasks.create_task(self.link.run(), name="mqtt")
                watchdog = tasks.create_task(self.notifier.watchdog(lambda: True), name="watchdog")
                jobs = [
                    tasks.create_task(self.tune(state), name=f"tune-{job}")
                    for job, state in self.jobs.items()
                ]
                self.notifier.ready(f"tuning {len(jobs)} job(s)")
                await asyncio.gather(*jobs)
                self.notifier.status("every job tuned; watching")
                if until_tuned:
                    await self.link.flush(timeout_s=10)
                    link_task.cancel()
                    watchdog.cancel()
        finally:
            self.notifier.stopping()
            self.notifier.close()

    async def _on_status(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        try:
            node = self.topics.name_in(topic)
            message = bus.decode(payload, "status")
        except PayloadError as e:
            self.invalid_payloads += 1
            log.warning("dropped an invalid status: %s", e)
            return
        self.nodes[node] = (message["state"] == "online", float(message["ts"]))
        self.update_metrics()

    def readings(self) -> list[Reading]:
        """What the coordinator exposes on /metrics: nodes and every job's tuning."""
        out = [
            Reading(
                "hyperagent_coordinator_invalid_payloads_total",
                self.invalid_payloads,
                {},
                Kind.COUNTER,
            ),
        ]
        for node, (online, ts) in sorted(self.nodes.items()):
            out.append(Reading("hyperagent_node_online", float(online), {"node": node}))
            out.append(Reading("hyperagent_node_status_timestamp_seconds", ts, {"node": node}))
        for state in self.jobs.values():
            out += job_readings(state)
        return out

    def update_metrics(self) -> None:
        self.collector.update(self.readings())

    async def _on_settings(self, topic: str, payload: bytes) -> None:
        """Learn the last retained version so versions keep rising across restarts."""
        if not payload:
            return
        try:
            message = bus.decode(payload, "settings")
        except PayloadError:
            return
        state = self.jobs.get(message["job"])
        if state is not None and bus.verify(message, self.key):
            state.version = max(state.version, message["version"])

    async def _on_ack(self, topic: str, payload: bytes) -> None:
        await self._store(payload, "ack", lambda s: s.acks)

    async def _on_report(self, topic: str, payload: bytes) -> None:
        await self._store(payload, "report", lambda s: s.reports)

    async def _store(self, payload: bytes, kind: str, table: Callable[[JobState], Any]) -> None:
        try:
            message = bus.decode(payload, kind)
        except PayloadError as e:
            self.invalid_payloads += 1
            log.warning("dropped an invalid %s: %s", kind, e)
            return
        state = self.jobs.get(message["job"])
        if state is None or message["node"] not in state.config.nodes:
            return
        async with state.changed:
            table(state).setdefault(message["version"], {})[message["node"]] = message
            state.changed.notify_all()

    async def _collect(
        self,
        state: JobState,
        table: dict[int, dict[str, dict[str, Any]]],
        version: int,
        timeout_s: float,
    ) -> dict[str, dict[str, Any]]:
        """Every node's message for ``version`` (or what arrived before the timeout)."""
        nodes = set(state.config.nodes)

        def complete() -> bool:
            return nodes <= set(table.get(version, {}))

        try:
            async with asyncio.timeout(timeout_s), state.changed:
                await state.changed.wait_for(complete)
        except TimeoutError:
            pass
        return dict(table.get(version, {}))

    def _publish_settings(
        self,
        state: JobState,
        settings: dict[str, Any],
        plan: MeasurementPlan | None,
        trial: int | None,
    ) -> int:
        state.version += 1
        state.current = dict(settings)
        state.trial_started = time.time() if plan is not None else None
        self.update_metrics()
        message = bus.sign(
            {
                "job": state.config.id,
                "version": state.version,
                "trial": trial,
                "nodes": list(state.config.nodes),
                "settings": settings,
                "backend": state.space.backend_mapping(settings),
                "plan": plan.to_dict() if plan else None,
                "issued_at": time.time(),
            },
            self.key,
        )
        self.link.publish(self.topics.settings(state.config.id), bus.encode(message), 1, True)
        return state.version

    def _plan(self, state: JobState, settings: dict[str, Any]) -> MeasurementPlan:
        p = state.config.plan
        settle_s = p.settle_s
        previous = state.trials[-1].settings if state.trials else None
        if previous is None or previous.get("power_cap_w") != settings.get("power_cap_w"):
            settle_s = max(settle_s, 3 * POWER_AVERAGING_WINDOW_S)
        return MeasurementPlan(p.settle_steps, settle_s, p.measure_steps, p.measure_s, p.windows)

    async def run_trial(self, state: JobState, settings: dict[str, Any]) -> TrialRecord:
        """One trial: publish, wait for acks, wait for measurements, score."""
        began = time.monotonic()
        index = len(state.trials)
        version = self._publish_settings(state, settings, self._plan(state, settings), index)
        cfg = state.config
        acks = await self._collect(state, state.acks, version, cfg.ack_timeout_s)
        record = TrialRecord(index, version, settings, None, "ok")
        refused = {n: a.get("error") for n, a in acks.items() if not a["ok"]}
        if refused:
            record.status = "refused"
            log.warning("%s v%d refused by %s", cfg.id, version, refused)
        elif len(acks) < len(cfg.nodes):
            record.status = "no_ack"
            log.warning(
                "%s v%d: no ack from %s", cfg.id, version, sorted(set(cfg.nodes) - set(acks))
            )
        else:
            reports = await self._collect(state, state.reports, version, cfg.trial_timeout_s)
            record.reports = reports
            if len(reports) < len(cfg.nodes):
                record.status = "timeout"
            elif any(r["nonfinite_loss"] for r in reports.values()):
                record.status = "nonfinite_loss"
            else:
                record.score = score(list(reports.values()), cfg.objective)
        record.seconds = time.monotonic() - began
        return record

    async def tune(self, state: JobState) -> JobState:
        """The whole tuning of one job; ends by publishing the best settings."""
        cfg = state.config
        await self.link.connected.wait()
        await asyncio.sleep(0.5)  # let retained settings arrive so versions keep rising
        for _ in range(cfg.trials):
            settings = state.tuner.ask()
            record = await self.run_trial(state, settings)
            state.trials.append(record)
            if record.score is not None:
                state.tuner.tell(settings, record.score)
                if state.baseline is None and record.index == 0:
                    state.baseline = record.score
                if state.best is None or record.score > state.best[1]:
                    state.best = (settings, record.score)
            else:
                worst = min((s for _, s in state.tuner.observations), default=0.0)
                state.tuner.tell(settings, 0.5 * worst)
            self.update_metrics()
            if self.on_trial:
                self.on_trial(state, record)
            best = f"{state.best[1]:.4g}" if state.best else "none"
            self.notifier.status(f"{cfg.id}: trial {len(state.trials)}/{cfg.trials}, best {best}")
            if state.tuner.n_told >= cfg.patience and state.tuner.converged(cfg.patience):
                log.info("%s converged after %d trials", cfg.id, len(state.trials))
                break
        final = state.best[0] if state.best else state.trials[0].settings
        state.final_version = self._publish_settings(state, final, None, None)
        await self._collect(state, state.acks, state.final_version, cfg.ack_timeout_s)
        state.done = True
        self.update_metrics()
        log.info(
            "%s: best %s score %s gain %s",
            cfg.id,
            final,
            state.best[1] if state.best else None,
            state.gain,
        )
        return state
