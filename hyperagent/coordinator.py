"""The cluster daemon: per job, the trial protocol over MQTT around a Tuner, safely.

ask -> journal + publish signed settings v (retained) -> wait for every active node's ack of v
-> the agents settle and measure (partial reports after each window) -> wait for every active
node's report of v, aborting early when the partial score falls below ``abort_below`` x the
baseline -> score -> journal -> tell. A run that fails (missing ack, refusal, timeout, NaN loss,
XID) rolls the job back to the last known good settings at once. Nodes that go offline, stop
answering, or whose job stops stepping (their agent says "stalled") are excluded from scoring
while they are away, and back at their next ack, report or step. The search space follows the
knobs the job's ranks announce (the others stay at their starting value). After the trial
budget or on convergence the starting and the best settings are measured again, interleaved,
and the best is kept only when its gain's interval lies above zero; the chosen settings are
published without a measurement plan; the coordinator keeps watching the job and re-tunes when
its throughput drifts (a node's throughput being the sum over its ranks, as in a score).

Which of these the job is in is :mod:`hyperagent.tuner.lifecycle`'s pure state machine; this
module is the I/O around it. A refusal, a missing ack or a missing measurement is not a trial:
the job pauses with the reason and the nodes, and retries the same settings with back-off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from hyperagent import bus
from hyperagent.config import Config, JobTuningSection
from hyperagent.errors import PayloadError
from hyperagent.exporter import SnapshotCollector
from hyperagent.notify import Notifier
from hyperagent.readings import Kind, Reading
from hyperagent.tuner import lifecycle
from hyperagent.tuner.jobstate import (
    JobState,
    Progress,
    TrialCallback,
    TrialRecord,
    job_readings,
)
from hyperagent.tuner.journal import Journal, JournalState
from hyperagent.tuner.lifecycle import NOT_TRIALS, TRIALS, Backoff, Trial, Tuned
from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import SearchSpace
from hyperagent.tuner.trial import (
    Gain,
    MeasurementPlan,
    compare,
    score,
    score_noise,
    trial_samples,
)

log = logging.getLogger(__name__)

POWER_AVERAGING_WINDOW_S = 1.0
"""NVML averages board power over about a second; a power change settles for 3x that."""

CONFIRM_ROUNDS = 2
"""After tuning, the baseline and the best settings are each measured this many times more,
interleaved (baseline, best, best, baseline, ...), and compared on those measurements."""


CLOCK_TICK_S = 0.5
"""Trial deadlines count only time connected to the broker, checked this often."""

QUORUM_RECHECK_S = 10.0
"""A job waiting for its nodes looks again this often (and whenever a node comes back)."""

READMIT = frozenset({"silent", "no measurement", "stalled"})
"""Why a node may be out of scoring while its agent is online: its next ack, report or step
(telemetry whose samples grew) brings it back. "offline" ends with its status saying online."""


def announced(knobs: Any) -> tuple[str, ...] | None:
    """The knobs an ack or a telemetry message says a node's job applies (None: not said,
    or not a list of names)."""
    if isinstance(knobs, list) and all(isinstance(k, str) for k in knobs):
        return tuple(knobs)
    return None


def coordinator_link(config: Config) -> bus.MqttLink:
    """The coordinator's MQTT link: a persistent session (reports queue while it restarts)
    and a retained status whose last will tells the agents it is gone."""
    topics = bus.Topics(config.cluster)
    return bus.link_from_config(
        config,
        f"hyperagent-coordinator-{config.cluster}",
        status_node="coordinator",
        persistent_session=True,
        status_topic=topics.coordinator_status(),
        username="coordinator",
    )


def fingerprint(job: JobTuningSection) -> str:
    """What makes two tunings comparable: backend, node count, model size, GPU model."""
    return f"{job.backend}/{len(job.nodes)}n/{job.model_params_b or '?'}B/{job.gpu_model or '?'}"


def job_space(job: JobTuningSection) -> SearchSpace:
    """The space a job's tuning searches before its ranks announce the knobs they apply."""
    full = SearchSpace.default(
        job.backend, len(job.nodes), job.power_limits_w, gradient_dtype=job.gradient_dtype
    )
    return full.for_objective(job.objective, job.power_budget_w, job.search_power_cap)


class Coordinator:
    """Tunes every job of ``config.coordinator.jobs``."""

    def __init__(
        self,
        config: Config,
        link: bus.MqttLink,
        settings_key: bytes,
        on_trial: TrialCallback | None = None,
        notifier: Notifier | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.config = config
        self.backoff = backoff or Backoff()
        """How a paused job's retries space out."""
        self.notifier = notifier or Notifier()
        self.link = link
        self.key = settings_key
        self.topics = bus.Topics(config.cluster)
        self.on_trial = on_trial
        self.invalid_payloads = 0
        self.collector = SnapshotCollector()
        self.nodes: dict[str, tuple[bool, float]] = {}
        """node -> (online, time of its last status message), from the retained status topics;
        only the nodes of configured jobs (a broker's other nodes are not tracked)."""
        self.members = frozenset(n for job in config.coordinator.jobs for n in job.nodes)
        self.jobs: dict[str, JobState] = {}
        self._journals: dict[str, JournalState] = {}
        """Each job's journal as ``run`` read it before starting, until its tuning takes it."""
        state_dir = config.coordinator.state_dir
        for job in config.coordinator.jobs:
            space = job_space(job)
            journal = Journal(state_dir / f"{job.id}.jsonl")
            tuner = Tuner(space, seed=job.seed, objective=job.objective)
            state = JobState(job, space, tuner, journal)
            self.jobs[job.id] = state
        link.subscribe(self.topics.ack("+", "+"), 1, self._on_ack)
        link.subscribe(self.topics.report("+", "+"), 1, self._on_report)
        link.subscribe(self.topics.settings("+"), 1, self._on_settings)
        link.subscribe(self.topics.status("+"), 1, self._on_status)
        link.subscribe(self.topics.telemetry("+"), 0, self._on_telemetry)
        self.update_metrics()

    async def run(self, until_tuned: bool = False) -> None:
        """Run the MQTT link and every job's tuning; afterwards keep watching the jobs (or,
        with ``until_tuned``, return once every tuning is finished and its settings sent).
        The journals are read first, off the event loop: one that cannot be read raises
        JournalError before anything goes on the network."""
        try:
            for job, state in self.jobs.items():
                self._journals[job] = await asyncio.to_thread(state.journal.load)
            async with asyncio.TaskGroup() as tasks:
                link_task = tasks.create_task(self.link.run(), name="mqtt")
                watchdog = tasks.create_task(self.notifier.watchdog(lambda: True), name="watchdog")
                try:
                    await self._tune_then_watch(tasks, until_tuned)
                except asyncio.CancelledError:
                    # the link still runs: tell the agents, so they put power limits back
                    offline = bus.status_message(
                        self.topics, "coordinator", "offline", self.topics.coordinator_status()
                    )
                    await self.link.disconnect([offline])
                    raise
                link_task.cancel()
                watchdog.cancel()
        finally:
            self.notifier.stopping()
            self.notifier.close()

    async def _tune_then_watch(self, tasks: asyncio.TaskGroup, until_tuned: bool) -> None:
        jobs = [
            tasks.create_task(self.tune(state), name=f"tune-{job}")
            for job, state in self.jobs.items()
        ]
        self.notifier.ready(f"tuning {len(jobs)} job(s)")
        await asyncio.gather(*jobs)
        self.notifier.status("every job tuned")
        if until_tuned:
            await self.link.flush(timeout_s=10)
            return
        for state in self.jobs.values():
            if state.config.mode == "tune":
                tasks.create_task(self.watch(state), name=f"watch-{state.config.id}")
        await asyncio.Future()  # watch until stopped

    # -- what comes in -------------------------------------------------------------------

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
        await self._store(topic, payload, "ack")

    async def _on_report(self, topic: str, payload: bytes) -> None:
        await self._store(topic, payload, "report")

    async def _store(self, topic: str, payload: bytes, kind: str) -> None:
        try:
            message = bus.decode(payload, kind)
            sender = self.topics.sender_in(topic)
            if message["node"] != sender or message["job"] != self.topics.name_in(topic):
                raise PayloadError(
                    f"{kind} of node {message['node']!r} for job {message['job']!r} on {topic!r}"
                )
        except PayloadError as e:
            self.invalid_payloads += 1
            log.warning("dropped an invalid %s: %s", kind, e)
            return
        state = self.jobs.get(message["job"])
        if state is None or not state.has_node(message["node"]):
            return
        node = message["node"]
        if not state.in_play(message["version"]):
            log.debug(
                "%s: %s of v%d from %s ignored (v%d in play)",
                state.config.id,
                kind,
                message["version"],
                node,
                state.version,
            )
            return
        if kind == "ack":
            table = state.acks
            applied = message.get("applied") or {}
            latency = applied.get("power_cap_latency_s")
            if isinstance(latency, int | float) and 0 <= latency < 60:
                state.cap_latency_s = max(state.cap_latency_s or 0.0, float(latency))
            knobs = announced(applied.get("knobs"))
            if knobs is not None:
                state.knobs[node] = knobs
        else:
            table = state.partials if message.get("partial") else state.reports
        if message.get("stalled") is True:
            # its job stopped stepping while its agent is online: out of the trial at once,
            # its partial windows discarded; back in scoring at its next ack, report or step,
            # but its agent has left this version's trial: the message is its answer to it
            if state.lost.get(node) != "stalled":
                log.warning(
                    "%s: node %s's job stopped stepping (v%d); excluded from scoring",
                    state.config.id,
                    node,
                    message["version"],
                )
            state.lost[node] = "stalled"
            async with state.changed:
                state.partials.get(message["version"], {}).pop(node, None)
                table.setdefault(message["version"], {})[node] = message
                state.changed.notify_all()
            return
        self._readmit(state, node, f"its {kind}")
        async with state.changed:
            # keyed by node: a redelivered message replaces itself, it never counts twice
            table.setdefault(message["version"], {})[message["node"]] = message
            state.changed.notify_all()

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
        if node not in self.members:
            return
        online = message["state"] == "online"
        self.nodes[node] = (online, float(message["ts"]))
        for state in self.jobs.values():
            if not state.has_node(node):
                continue
            if online and state.lost.get(node) == "offline":
                del state.lost[node]
                log.info("%s: node %s is back", state.config.id, node)
            elif not online and node not in state.lost:
                state.lost[node] = "offline"
                log.warning(
                    "%s: node %s went offline; excluded from scoring", state.config.id, node
                )
            async with state.changed:
                state.changed.notify_all()
        self.update_metrics()

    async def _on_telemetry(self, topic: str, payload: bytes) -> None:
        """Track each tuned job's throughput from its nodes' telemetry (for drift)."""
        try:
            node = self.topics.name_in(topic)
            message = bus.decode(payload, "telemetry")
        except PayloadError:
            self.invalid_payloads += 1
            return
        jobs = message.get("jobs")
        if not isinstance(jobs, dict):
            return
        for job, totals in jobs.items():
            state = self.jobs.get(job)
            if state is None or not state.has_node(node) or not isinstance(totals, dict):
                continue
            samples, step_s = totals.get("samples"), totals.get("step_s")
            if isinstance(samples, int | float) and isinstance(step_s, int | float):
                ranks = totals.get("ranks")
                if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
                    ranks = 1
                before = state.progress.get(node)
                state.progress[node] = Progress(
                    float(samples), float(step_s), float(message["ts"]), ranks
                )
                if before is not None and samples > before.samples:
                    self._readmit(state, node, "its job steps")
                    async with state.changed:
                        state.changed.notify_all()
            knobs = announced(totals.get("knobs"))
            if knobs is not None:
                state.knobs[node] = knobs

    @staticmethod
    def _readmit(state: JobState, node: str, why: str) -> None:
        """Bring ``node`` back into scoring if it was out for a reason ``why`` answers."""
        if state.lost.get(node) in READMIT:
            log.info(
                "%s: node %s is back (%s; it was out: %s)",
                state.config.id,
                node,
                why,
                state.lost.pop(node),
            )

    # -- metrics -------------------------------------------------------------------------

    def readings(self) -> list[Reading]:
        """What the coordinator exposes on /metrics: nodes and every job's tuning."""
        out = [
            Reading(
                "hyperagent_coordinator_invalid_payloads_total",
                self.invalid_payloads,
                {},
                Kind.COUNTER,
            ),
            Reading("hyperagent_mqtt_connected", float(self.link.connected.is_set())),
            *self.link.handler_error_readings(),
        ]
        for node, (online, ts) in sorted(self.nodes.items()):
            out.append(Reading("hyperagent_node_online", float(online), {"node": node}))
            out.append(Reading("hyperagent_node_status_timestamp_seconds", ts, {"node": node}))
        for state in self.jobs.values():
            out += job_readings(state)
        return out

    def update_metrics(self) -> None:
        self.collector.update(self.readings())

    # -- the trial protocol --------------------------------------------------------------

    async def _collect(
        self,
        state: JobState,
        table: dict[int, dict[str, dict[str, Any]]],
        version: int,
        timeout_s: float,
        abort: Callable[[], bool] = lambda: False,
    ) -> dict[str, dict[str, Any]]:
        """Every active node's message for ``version`` (or what came before the timeout, or
        before ``abort()`` said so). Nodes going offline meanwhile are no longer waited for."""

        def complete() -> bool:
            return set(state.active_nodes) <= set(table.get(version, {})) or abort()

        remaining = timeout_s
        while remaining > 0:
            began, connected = time.monotonic(), self.link.connected.is_set()
            try:
                async with asyncio.timeout(min(remaining, CLOCK_TICK_S)), state.changed:
                    await state.changed.wait_for(complete)
                break
            except TimeoutError:
                pass
            if connected and self.link.connected.is_set():
                remaining -= time.monotonic() - began  # the clock stops while the broker is away
        return dict(table.get(version, {}))

    async def _publish_acked(
        self,
        state: JobState,
        settings: dict[str, Any],
        plan: MeasurementPlan | None,
        trial: int | None,
    ) -> tuple[int, dict[str, dict[str, Any]]]:
        """Publish settings and collect the acks. Agents that applied a newer version than
        this coordinator knows (its journal lost, or retained settings not seen yet) refuse it
        as stale and say which: the version jumps past theirs and the settings go out again."""
        version = self._publish_settings(state, settings, plan, trial)
        acks = await self._collect(state, state.acks, version, state.config.ack_timeout_s)
        applied = [(a.get("applied") or {}).get("version") for a in acks.values() if not a["ok"]]
        newer = [v for v in applied if isinstance(v, int) and v > version]
        if newer:
            state.version = max(state.version, *newer)
            log.warning(
                "%s: agents apply v%d already; publishing again above it",
                state.config.id,
                max(newer),
            )
            version = self._publish_settings(state, settings, plan, trial)
            acks = await self._collect(state, state.acks, version, state.config.ack_timeout_s)
        return version, acks

    def _publish_settings(
        self,
        state: JobState,
        settings: dict[str, Any],
        plan: MeasurementPlan | None,
        trial: int | None,
    ) -> int:
        state.version += 1
        state.prune()
        state.journal.append(
            {"type": "published", "version": state.version, "trial": trial, "settings": settings}
        )
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

    @staticmethod
    def _cap_settle_s(state: JobState) -> float:
        """How long a power-cap change settles: the slowest change the nodes measured (from
        the set call until instant power was under the cap) plus NVML's averaging window;
        3 averaging windows until a node has measured one."""
        if state.cap_latency_s is None:
            return 3 * POWER_AVERAGING_WINDOW_S
        return state.cap_latency_s + POWER_AVERAGING_WINDOW_S

    def _plan(self, state: JobState, settings: dict[str, Any]) -> MeasurementPlan:
        p = state.config.plan
        settle_s = p.settle_s
        if state.current.get("power_cap_w") != settings.get("power_cap_w"):
            settle_s = max(settle_s, self._cap_settle_s(state))
        return MeasurementPlan(
            p.settle_steps,
            settle_s,
            p.measure_steps,
            p.measure_s,
            p.windows,
            p.target_rel_se,
            p.max_windows,
        )

    def _score(self, state: JobState, reports: list[dict[str, Any]]) -> float | None:
        cfg = state.config
        return score(reports, cfg.objective, len(cfg.nodes), cfg.power_budget_w)

    def _should_abort(self, state: JobState, version: int) -> bool:
        """Every active node's partial measurement puts the trial below the abort line."""
        if state.baseline is None or not state.config.abort_below:
            return False
        partials = state.partials.get(version, {})
        active = state.active_nodes
        if not active or not set(active) <= set(partials):
            return False
        partial = self._score(state, [partials[n] for n in active])
        return partial is not None and partial < state.config.abort_below * state.baseline

    async def run_trial(
        self,
        state: JobState,
        settings: dict[str, Any],
        index: int,
        version: int | None = None,
        abortable: bool = True,
    ) -> TrialRecord:
        """One trial: publish (unless resuming ``version``), wait for acks, wait for the
        measurements (or, when ``abortable``, abort early), score."""
        began = time.monotonic()
        cfg = state.config
        if version is None:
            plan = self._plan(state, settings)
            version, acks = await self._publish_acked(state, settings, plan, index)
        else:
            acks = await self._collect(state, state.acks, version, cfg.ack_timeout_s)
        record = TrialRecord(index, version, settings, None, "ok", acks=acks)
        refused = {n: str(a.get("error")) for n, a in acks.items() if not a["ok"]}
        if refused:
            record.status, record.errors = "refused", refused
            log.debug("%s v%d refused by %s", cfg.id, version, refused)
        else:
            self._lose(state, set(state.active_nodes) - set(acks), "silent", version)
            if not acks:
                record.status = "no_ack"
            elif not self._quorum(state):
                record.status = "lost_nodes"
        if record.status == "ok":
            await self._measure(state, record, abortable)
        if record.status == "refused":
            record.nodes = tuple(sorted(refused))
        elif record.status in ("no_ack", "lost_nodes"):
            record.nodes = tuple(n for n in cfg.nodes if n not in acks)
        elif record.status == "timeout":
            record.nodes = tuple(n for n in cfg.nodes if n not in record.reports)
        record.seconds = time.monotonic() - began
        state.trial_started = None
        return record

    async def _measure(self, state: JobState, record: TrialRecord, abortable: bool) -> None:
        """Wait for the active nodes' measurements of the trial, or abort it early."""
        version = record.version

        def abort() -> bool:
            return abortable and self._should_abort(state, version)

        answers = await self._collect(
            state, state.reports, version, state.config.trial_timeout_s, abort=abort
        )
        active = state.active_nodes
        if abort() and not set(active) <= set(answers):
            partials = state.partials[version]
            record.status = "aborted"
            record.reports = {n: partials[n] for n in active}
            record.score = self._score(state, list(record.reports.values()))
            return
        reports = {n: r for n, r in answers.items() if not r.get("stalled")}
        self._lose(state, set(active) - set(reports), "no measurement", version)
        record.reports = {n: reports[n] for n in state.active_nodes if n in reports}
        usable = list(record.reports.values())
        if not usable or not self._quorum(state):
            record.status = "timeout"
        elif any(r["nonfinite_loss"] for r in usable):
            record.status = "nonfinite_loss"
        elif any(r.get("xid_errors") for r in usable):
            record.status = "xid"
        else:
            record.score = self._score(state, usable)
            record.noise = score_noise(usable, state.config.objective, len(state.config.nodes))
            if record.score is None:
                record.status = "infeasible"

    def _lose(self, state: JobState, nodes: set[str], reason: str, version: int) -> None:
        for node in sorted(nodes):
            if node not in state.lost:
                log.warning(
                    "%s: node %s lost (%s of v%d); excluded from scoring",
                    state.config.id,
                    node,
                    reason,
                    version,
                )
            state.lost[node] = reason

    def _quorum(self, state: JobState) -> bool:
        return len(state.active_nodes) * 2 >= len(state.config.nodes) and bool(state.active_nodes)

    async def _rollback(self, state: JobState, why: str, quiet: bool = False) -> None:
        """Put the job back on its last known good settings, without measuring."""
        good = state.last_good or state.space.defaults()
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "%s: %s; rolling back to %s",
            state.config.id,
            why,
            good,
        )
        state.rollback = await self._publish_acked(state, good, None, None)

    def _resume(self, state: JobState, journal: JournalState) -> None:
        """Bring the tuner and the running best up to what the journal says happened."""
        state.version = max(state.version, journal.version)
        for entry in journal.trials:
            trial = TrialRecord.from_journal(entry)
            if trial.confirmation:
                state.confirmations.append(trial)
                continue
            penalty = self._penalty(state)
            state.record(trial, penalty)
        if journal.trials:
            log.info(
                "%s: resumed %d trials from %s",
                state.config.id,
                len(journal.trials),
                state.journal.path,
            )

    @staticmethod
    def _penalty(state: JobState) -> float:
        scores = [s for _, s in state.tuner.observations]
        return 0.5 * min(scores) if scores else 0.0

    def _warm_start(self, state: JobState) -> dict[str, Any]:
        """The best settings of a finished tuning with the same fingerprint, else the start.
        Reads other journals: call it off the event loop."""
        start = state.config.start.model_dump()
        if start["power_cap_w"] is None and state.config.power_limits_w:
            start["power_cap_w"] = state.config.power_limits_w[1]
        mine = fingerprint(state.config)
        for path in sorted(state.journal.path.parent.glob("*.jsonl")):
            if path == state.journal.path:
                continue
            other = Journal(path).load()
            if other.fingerprint == mine and other.final is not None and other.measured:
                log.info("%s: warm start from %s", state.config.id, path)
                return state.space.snap(other.final["settings"])
        return state.space.snap(start)

    def _start(self, state: JobState) -> dict[str, Any]:
        return state.start_settings or state.space.snap(state.space.defaults())

    async def tune(self, state: JobState) -> JobState:
        """The whole tuning of one job (resumed from its journal); ends by publishing the best
        settings, or, in recommend mode, by reporting them without publishing anything."""
        cfg = state.config
        journal = self._journals.pop(cfg.id, None)
        if journal is None:
            journal = await asyncio.to_thread(state.journal.load)
        state.start_settings = await asyncio.to_thread(self._warm_start, state)
        if cfg.mode == "recommend":
            return self._recommend(state, journal)
        await self.link.connected.wait()
        if self._measured_elsewhere(state, journal):
            log.warning(
                "%s: the journal's settings lie outside the search space (objective, power"
                " limits or search_power_cap changed); the tuning starts over",
                cfg.id,
            )
            journal = JournalState(version=journal.version)
        elif any(t["status"] in NOT_TRIALS for t in journal.trials):
            log.warning(
                "%s: the journal counts refusals or missing measurements as trials; the tuning"
                " starts over",
                cfg.id,
            )
            journal = JournalState(version=journal.version)
        if (
            journal.final is not None
            and journal.measured
            and journal.fingerprint == fingerprint(cfg)
        ):
            self._resume(state, journal)
            state.best = (journal.final["settings"], journal.final["score"])
            state.baseline = journal.final.get("baseline")
            state.last_good = journal.final["settings"]
            state.phase = Tuned()
            await self._finish(state, journal.final["settings"], announce=False)
            return state
        if not journal.trials or journal.final is not None:
            state.journal.append({"type": "start", "fingerprint": fingerprint(cfg)})
            journal = JournalState(version=journal.version, in_flight=journal.in_flight)
        state.tuner = Tuner(
            state.space, seed=cfg.seed, start=self._start(state), objective=cfg.objective
        )
        self._resume(state, journal)
        await self._trials(state, journal.in_flight)
        return state

    @staticmethod
    def _measured_elsewhere(state: JobState, journal: JournalState) -> bool:
        """Whether the journal holds settings outside the job's space (a config change)."""
        entries = [*journal.trials, journal.in_flight or {}, journal.final or {}]
        return any(
            "settings" in entry and not state.space.contains(entry["settings"]) for entry in entries
        )

    async def _trials(self, state: JobState, in_flight: dict[str, Any] | None = None) -> None:
        """Run the job's lifecycle from its trials so far until it is tuned: trials, pauses
        and their retries, confirmations, the final settings."""
        state.rounds += 1
        round_ = state.rounds
        index = len(state.trials) + len(state.confirmations)
        if len(state.trials) < state.config.trials:
            state.phase = Trial(round_, "search", len(state.trials))
        elif state.config.confirm_best and self._confirm_pair(state) is not None:
            # resumed after the search: the confirmations left, or their verdict
            self._begin_confirm(state)
            state.phase = Trial(round_, "confirm", index)
            if len(state.confirmations) >= len(state.confirm_order):
                state.phase = Tuned(round_)
                await self._conclude(state, Trial(round_, "confirm", index))
        else:
            state.phase = Tuned(round_)
            await self._conclude(state, Trial(round_, "search", index))
        self.update_metrics()
        while not isinstance(state.phase, Tuned):
            phase = state.phase
            if not isinstance(phase, Trial):
                await self._wait_to_retry(state)
                continue
            settings = self._settings_for(state, phase, in_flight)
            in_flight = None
            record = await self.run_trial(
                state, settings, phase.trial, abortable=phase.phase == "search"
            )
            await self._ended(state, phase, record)

    def _settings_for(
        self, state: JobState, phase: Trial, in_flight: dict[str, Any] | None
    ) -> dict[str, Any]:
        """What a run of ``phase`` measures: a resumed trial's, a retried one's, the next
        confirmation's, or the tuner's next ask."""
        if in_flight is not None and in_flight.get("trial") == phase.trial:
            # measured anew under a new version: what the dead process had received of it
            # is gone, and half a measurement must not count
            settings: dict[str, Any] = in_flight["settings"]
        elif phase.phase == "confirm":
            settings = state.confirm_order[len(state.confirmations)]
        elif phase.retrying is not None and state.running is not None:
            settings = state.running
        else:
            self._follow_knobs(state)
            settings = state.tuner.ask()
        state.running = settings
        return settings

    async def _ended(self, state: JobState, phase: Trial, record: TrialRecord) -> None:
        """Account one run and do what the lifecycle says comes next."""
        cfg = state.config
        confirm = phase.phase == "confirm"
        if record.status in TRIALS:
            record.confirmation = confirm
            state.journal.append(record.to_journal())
            if confirm:
                state.confirmations.append(record)
            else:
                state.record(record, self._penalty(state))
            if self.on_trial:
                self.on_trial(state, record)
            best = f"{state.best[1]:.4g}" if state.best else "none"
            self.notifier.status(f"{cfg.id}: trial {len(state.trials)}/{cfg.trials}, best {best}")
        if confirm:
            more = len(state.confirmations) < 2 * CONFIRM_ROUNDS
            converged = False
        else:
            more = len(state.trials) < cfg.trials
            converged = (
                state.best is not None
                and state.tuner.n_told >= cfg.patience
                and state.tuner.converged(cfg.patience)
            )
        ends = not confirm and record.status in TRIALS and (not more or converged)
        event = lifecycle.Ended(
            record.status,
            time.monotonic(),
            record.nodes,
            more=more,
            converged=converged,
            confirm=ends and cfg.confirm_best and self._confirm_pair(state) is not None,
        )
        state.phase, actions = lifecycle.advance(phase, event, self.backoff)
        self.update_metrics()
        # a retry that fails again for the same reason says nothing new
        quiet = phase.retrying is not None and not any(
            isinstance(a, lifecycle.Pause) for a in actions
        )
        for action in actions:
            await self._act(state, phase, record, action, quiet)

    async def _act(
        self,
        state: JobState,
        phase: Trial,
        record: TrialRecord,
        action: lifecycle.Action,
        quiet: bool,
    ) -> None:
        cfg = state.config
        if isinstance(action, lifecycle.Rollback):
            await self._rollback(state, action.why, quiet=quiet)
        elif isinstance(action, lifecycle.Pause):
            paused = action.paused
            detail = "; ".join(f"{n}: {e}" for n, e in record.errors.items())
            delay = max(0.0, paused.retry_at - time.monotonic())
            log.warning(
                "%s: paused (%s: %s%s); retrying the same settings in %.0fs, then with back-off",
                cfg.id,
                paused.reason,
                ", ".join(paused.nodes) or "no node answered",
                f"; {detail}" if detail else "",
                delay,
            )
            self.notifier.status(
                f"{cfg.id}: paused, {paused.reason}: {', '.join(paused.nodes) or 'no node'}"
            )
            state.journal.append(
                {
                    "type": "paused",
                    "trial": paused.trial,
                    "version": record.version,
                    "reason": paused.reason,
                    "nodes": list(paused.nodes),
                    "errors": record.errors,
                }
            )
        elif isinstance(action, lifecycle.Resume):
            log.info(
                "%s: resumed after %d retr%s (%s)",
                cfg.id,
                action.paused.attempt + 1,
                "y" if action.paused.attempt == 0 else "ies",
                action.paused.reason,
            )
        elif isinstance(action, lifecycle.Confirm):
            self._begin_confirm(state)
        elif isinstance(action, lifecycle.Finish):
            if phase.phase == "search":
                log.info("%s: the search ended after %d trials", cfg.id, len(state.trials))
            await self._conclude(state, phase)
        self.update_metrics()

    async def _wait_to_retry(self, state: JobState) -> None:
        """Paused: wait for the retry to be due and half the nodes to answer."""
        while True:
            phase = state.phase
            assert isinstance(phase, lifecycle.Paused | lifecycle.WaitingForQuorum)
            tick = lifecycle.Tick(time.monotonic(), self._quorum(state))
            state.phase, actions = lifecycle.advance(phase, tick, self.backoff)
            if (
                isinstance(phase, lifecycle.Paused)
                and isinstance(state.phase, lifecycle.WaitingForQuorum)
                and phase.attempt == 0
            ):
                log.warning(
                    "%s: fewer than half the nodes answer (out: %s); waiting for them",
                    state.config.id,
                    ", ".join(f"{n} {why}" for n, why in sorted(state.lost.items())),
                )
                self.notifier.status(f"{state.config.id}: paused, waiting for nodes")
            if actions:
                state.retries += 1
                log.debug("%s: retrying after a pause", state.config.id)
                self.update_metrics()
                return
            self.update_metrics()
            now = state.phase
            # paused: until the retry is due; waiting for a quorum: until a node comes back
            wait_s = QUORUM_RECHECK_S
            if isinstance(now, lifecycle.Paused):
                wait_s = min(wait_s, now.retry_at - time.monotonic())
            try:
                async with asyncio.timeout(max(0.01, wait_s)):
                    async with state.changed:
                        await state.changed.wait()
            except TimeoutError:
                pass

    def _follow_knobs(self, state: JobState) -> None:
        """Narrow the search space to the knobs the job's ranks announced (the others stay
        at their starting value); the tuner starts over on the new space with the trials
        that lie in it."""
        announced = state.announced_knobs
        if announced is None:
            return
        cfg = state.config
        full = job_space(cfg)
        start = full.snap(state.trials[0].settings) if state.trials else self._start(state)
        space = full.announced(announced, start)
        pinned = [k for k in full.knobs if len(full.values(k)) > 1 and len(space.values(k)) == 1]
        if space == state.space:
            return
        log.info(
            "%s: the job applies %s; tuning those, with %s kept at %s",
            cfg.id,
            ", ".join(announced) or "no knob",
            ", ".join(pinned) or "nothing",
            {k: start[k] for k in pinned},
        )
        tuner = Tuner(space, seed=cfg.seed, start=space.snap(start), objective=cfg.objective)
        for trial in state.trials:
            if trial.score is not None and space.contains(trial.settings):
                noise = trial.noise if trial.status == "ok" else None
                tuner.tell(trial.settings, trial.score, noise=noise)
        state.space, state.tuner = space, tuner
        if state.best is not None and not space.contains(state.best[0]):
            state.best = tuner.best

    def _confirm_pair(self, state: JobState) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The start and the settings to confirm against it: the best, or, when the start
        measured best once (not interleaved), the best of the others; None when there is
        nothing to compare (then the start is the best)."""
        if state.best is None:
            return None
        baseline = next((t for t in state.trials if t.index == 0), None)
        start = baseline.settings if baseline is not None else state.space.defaults()
        best = (state.tuner.best or state.best)[0]
        if best != start:
            return start, best
        others = [t for t in state.trials if t.status == "ok" and t.settings != start]
        if not others:
            state.best = (start, state.baseline or state.best[1])
            return None
        return start, max(others, key=lambda t: t.score or 0.0).settings

    def _begin_confirm(self, state: JobState) -> None:
        """Measure the baseline and the best settings again, interleaved (``CONFIRM_ROUNDS``
        each); the best is kept only when its gain's interval lies above zero."""
        pair = self._confirm_pair(state)
        assert pair is not None
        start, best = pair
        state.confirm_order = ([start, best, best, start] * CONFIRM_ROUNDS)[: 2 * CONFIRM_ROUNDS]

    async def _conclude(self, state: JobState, phase: Trial) -> None:
        """The lifecycle's end: judge the confirmations (if any), publish the final settings."""
        if phase.phase == "confirm":
            self._judge_confirmations(state)
        final = state.best[0] if state.best else (state.last_good or self._first_settings(state))
        await self._finish(state, final, announce=True)

    def _first_settings(self, state: JobState) -> dict[str, Any]:
        return state.trials[0].settings if state.trials else self._start(state)

    def _judge_confirmations(self, state: JobState) -> None:
        start, best = state.confirm_order[0], state.confirm_order[1]
        gain = self.confirmed_gain(state, start, best)
        state.confirmed = gain
        if gain is None:
            log.warning("%s: the confirmations measured too little to compare", state.config.id)
            return
        state.baseline = gain.baseline
        if gain.better:
            state.best = (best, gain.best)
            log.info("%s: %s over the baseline, confirmed", state.config.id, gain.describe())
        else:
            state.best = (start, gain.baseline)
            log.info(
                "%s: no setting was better than the baseline (best candidate %s)",
                state.config.id,
                gain.describe(),
            )

    def confirmed_gain(
        self, state: JobState, start: dict[str, Any], best: dict[str, Any]
    ) -> Gain | None:
        """The best settings against the baseline from the confirmations that measured them."""
        cfg = state.config
        samples: dict[str, list[float]] = {"start": [], "best": []}
        for record in state.confirmations:
            if record.status != "ok" or record.settings not in (start, best):
                continue
            which = "start" if record.settings == start else "best"
            reports = list(record.reports.values())
            samples[which] += trial_samples(reports, cfg.objective, len(cfg.nodes))
        return compare(samples["start"], samples["best"])

    async def _finish(self, state: JobState, final: dict[str, Any], announce: bool) -> None:
        cfg = state.config
        state.final_version, _ = await self._publish_acked(state, final, None, None)
        score_ = state.best[1] if state.best else None
        confirmed = state.confirmed
        state.journal.append(
            {
                "type": "final",
                "version": state.final_version,
                "settings": final,
                "score": score_,
                "baseline": state.baseline,
                **(
                    {
                        "gain": confirmed.value,
                        "gain_low": confirmed.low,
                        "gain_high": confirmed.high,
                        "better": confirmed.better,
                    }
                    if confirmed is not None
                    else {}
                ),
            }
        )
        state.last_good = final
        self.update_metrics()
        if announce:
            log.info("%s: best %s score %s gain %s", cfg.id, final, score_, state.gain)

    def _recommend(self, state: JobState, journal: JournalState) -> JobState:
        """Recommend mode: what tuning would start from, and why; nothing is published."""
        cfg = state.config
        if journal.final is not None:
            state.recommendation = journal.final["settings"]
            state.why = f"the last finished tuning of this job ({state.journal.path})"
        else:
            table = state.space.recommended(len(cfg.nodes), self._start(state))
            state.recommendation = table
            state.why = (
                f"BACKGROUND.md's table for {len(cfg.nodes)} nodes on {cfg.backend} "
                f"({table.get('allreduce')}, {table.get('chunk_kb')} KiB chunks, "
                f"{table['bucket_mb']} MiB buckets) over the starting settings; "
                "no measurement yet"
            )
        state.phase = Tuned()
        log.info("%s: recommend %s because %s", cfg.id, state.recommendation, state.why)
        self.notifier.status(f"{cfg.id}: recommending {state.recommendation}")
        self.update_metrics()
        return state

    # -- after tuning --------------------------------------------------------------------

    def job_throughput(self, state: JobState, previous: dict[str, Progress]) -> float | None:
        """The job's samples/s since ``previous`` from its nodes' telemetry, in a trial
        score's unit: a node's rate is the sum over its ranks (its samples over its step time
        per rank), the nodes' mean scaled to the job's node count; None without two points
        from any node."""
        rates = []
        for node, now in state.progress.items():
            before = previous.get(node)
            if before is not None and node not in state.lost:
                d_samples, d_step = now.samples - before.samples, now.step_s - before.step_s
                if d_step > 0 and d_samples >= 0:
                    rates.append(d_samples / (d_step / now.ranks))
        if not rates:
            return None
        return statistics.fmean(rates) * len(state.config.nodes)

    async def watch(self, state: JobState, interval_s: float = 10.0) -> None:
        """After tuning: re-tune when throughput stays ``drift_threshold`` below the tuned
        score for ``drift_sustained_s`` (only for the throughput objective, whose score the
        telemetry gives directly)."""
        cfg = state.config
        if cfg.objective != "throughput":
            return
        previous = dict(state.progress)
        while True:
            await asyncio.sleep(interval_s)
            now = self.job_throughput(state, previous)
            previous = dict(state.progress)
            if now is None or state.best is None or not math.isfinite(now):
                continue
            if not isinstance(state.phase, Tuned):
                continue
            tuned = state.best[1]
            below = now < (1 - cfg.drift_threshold) * tuned
            drift = lifecycle.Drift(time.monotonic(), below, cfg.drift_sustained_s)
            state.phase, actions = lifecycle.advance(state.phase, drift, self.backoff)
            if actions:
                log.warning(
                    "%s: throughput %.4g is %.0f%% below the tuned %.4g for %.0fs; re-tuning",
                    cfg.id,
                    now,
                    100 * (1 - now / tuned),
                    tuned,
                    cfg.drift_sustained_s,
                )
                await self.retune(state)
                previous = dict(state.progress)

    async def retune(self, state: JobState) -> None:
        """A new round of trials from the current best (earlier scores no longer hold)."""
        start = state.best[0] if state.best else None
        state.tuner = Tuner(
            state.space,
            seed=state.config.seed + state.rounds,
            start=start,
            objective=state.config.objective,
        )
        state.trials, state.best, state.baseline = [], None, None
        state.confirmations, state.confirmed = [], None
        state.journal.append({"type": "start", "fingerprint": fingerprint(state.config)})
        await self._trials(state)
