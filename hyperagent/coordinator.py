"""The cluster daemon: finds the jobs the agents carry and tunes each one, as the I/O around
pure machines.

Agents say in their telemetry which jobs run on their nodes (what each job's ranks said when
they attached) and what the node can apply; :class:`~hyperagent.tuner.discovery.Registry`
keeps that picture, the policy (``[coordinator.defaults]``, ``[[coordinator.jobs]]``) decides
which jobs are tuned, and each tuned job gets its own
:class:`~hyperagent.tuner.tuning.JobTuning` and its own task: MQTT messages for the job become
its events, its effects become journal entries, signed settings, log lines and the status
line. One job's pause, stall or slow trial never delays another's. Deadlines count only time
connected to the broker (:class:`ConnectedClock`): an outage pauses a trial, it does not fail
it. A job whose ranks have all left ends; its state goes ``release_after_s`` later, its
journal stays (``journal_keep_days``, ``journal_keep``) and its final settings warm-start the
next job of the same user with the same fingerprint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from hyperagent import bus
from hyperagent.config import Config, JobTuningSection
from hyperagent.errors import PayloadError
from hyperagent.exporter import SnapshotCollector
from hyperagent.notify import Notifier
from hyperagent.readings import Kind, Reading
from hyperagent.signing import SigningKey, TrustedKeys
from hyperagent.tuner import lifecycle, tuning
from hyperagent.tuner.discovery import (
    JobView,
    Registry,
    SpacePlan,
    admission,
    fingerprint,
    node_bounds,
    plan_space,
)
from hyperagent.tuner.jobstate import Progress
from hyperagent.tuner.journal import Journal
from hyperagent.tuner.journals import Journals
from hyperagent.tuner.lifecycle import Backoff
from hyperagent.tuner.metrics import job_readings
from hyperagent.tuner.tuning import CONFIRM_ROUNDS, JobTuning, TrialCallback

__all__ = ["CONFIRM_ROUNDS", "Coordinator", "coordinator_link"]

log = logging.getLogger(__name__)

CLOCK_TICK_S = 0.5
"""How often the connected clock looks at the link (and a waiting job at its deadlines)."""

HOUSEKEEPING_S = 1.0
"""How often jobs are looked at again (ranks gone quiet, releases) and /metrics rebuilt."""

ANNOUNCE_S = 30.0
"""The coordinator says it is online again this often, and (within ``HOUSEKEEPING_S``) when a
node says it is online: a broker that serves a retained message only from the cluster node
that stored it would leave a node reconnected elsewhere waiting for it."""


class ConnectedClock:
    """Seconds spent connected to the broker: it stops while the link is down."""

    def __init__(self, link: bus.MqttLink) -> None:
        self.link = link
        self._offset = 0.0
        self._down_since: float | None = None

    def now(self) -> float:
        real = time.monotonic()
        if self._down_since is not None:
            return self._down_since - self._offset
        return real - self._offset

    async def run(self) -> None:
        while True:
            real = time.monotonic()
            up = self.link.connected.is_set()
            if not up and self._down_since is None:
                self._down_since = real
            elif up and self._down_since is not None:
                self._offset += real - self._down_since
                self._down_since = None
            await asyncio.sleep(CLOCK_TICK_S)


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


@dataclass
class TunedJob:
    """One tuned job: its machine, its events waiting, its task and journal file."""

    machine: JobTuning
    journal: Journal
    inbox: asyncio.Queue[tuning.Event] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    done_since: float | None = None
    """When (connected clock) it ended or failed."""
    unread: bool = False
    """Its journal was written after the coordinator started: read it before beginning."""

    def tell(self, event: tuning.Event) -> None:
        """Queue ``event`` for the job's task; a job that ended or failed takes no more."""
        if not self.machine.terminal:
            self.inbox.put_nowait(event)


class Coordinator:
    """Finds the cluster's jobs and tunes those the policy admits."""

    def __init__(
        self,
        config: Config,
        link: bus.MqttLink,
        signing_key: SigningKey,
        on_trial: TrialCallback | None = None,
        notifier: Notifier | None = None,
        backoff: Backoff | None = None,
        trusted_keys: TrustedKeys | None = None,
        collector: SnapshotCollector | None = None,
    ) -> None:
        """Settings go out signed by ``signing_key``; retained settings signed by it or by a
        key of ``trusted_keys`` (the key before a rotation) tell it the versions published.
        Its /metrics readings go to ``collector`` (a MetricsServer's started before it; by
        default a collector of its own)."""
        self.config = config
        self.section = config.coordinator
        self.backoff = backoff or Backoff()
        self.notifier = notifier or Notifier()
        self.link = link
        self.key = signing_key
        self.trusted = (trusted_keys or TrustedKeys()).with_key(signing_key.public)
        self.topics = bus.Topics(config.cluster)
        self.on_trial = on_trial
        self.clock = ConnectedClock(link)
        self.registry = Registry()
        self.journals = Journals(
            self.section.state_dir, self.section.journal_keep_days, self.section.journal_keep
        )
        self.tuned: dict[str, TunedJob] = {}
        """The jobs being tuned (and, for ``release_after_s``, those that ended)."""
        self.ignored: dict[str, str] = {}
        self.foreign: set[tuple[str, str, int]] = set()
        """(job, node, uid) of every node seen carrying a job's id under another uid than the
        job's owner's (logged once each; not part of the job)."""
        """Jobs found but not tuned, and why (said once; forgotten when they go)."""
        self.versions: dict[str, int] = {}
        """Highest settings version seen retained per job not (yet) tuned here."""
        self.nodes: dict[str, tuple[bool, float]] = {}
        """node -> (online, time of its last status message)."""
        self.found = 0
        self.invalid_payloads = 0
        self.collector = collector if collector is not None else SnapshotCollector()
        self.expected = {rule.id for rule in self.section.jobs if rule.exact}
        """Jobs the config names: ``run(until_tuned=True)`` waits for them."""
        self._tasks: asyncio.TaskGroup | None = None
        self._settled = False
        self._announce_due = False
        self._announced_at = time.monotonic()
        self._ending = False
        link.subscribe(self.topics.ack("+", "+"), 1, self._on_ack)
        link.subscribe(self.topics.report("+", "+"), 1, self._on_report)
        link.subscribe(self.topics.settings("+"), 1, self._on_settings)
        link.subscribe(self.topics.status("+"), 1, self._on_status)
        link.subscribe(self.topics.telemetry("+"), 0, self._on_telemetry)
        self._followed_nodes: set[str] = set()
        """Nodes whose status topic is followed: a retained status must reach this coordinator
        on brokers that serve it only to a subscriber of the exact topic."""
        self._follow_nodes(n for rule in self.section.jobs for n in rule.nodes)
        self.update_metrics()

    async def run(self, until_tuned: bool = False) -> None:
        """Run until cancelled (with ``until_tuned``: until every job found, and every job
        the config names, is tuned, ended or failed). The journals are read first, off the
        event loop: one that cannot be read raises JournalError before anything goes on the
        network."""
        try:
            await asyncio.to_thread(self.journals.load)
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                background = [
                    tasks.create_task(self.link.run(), name="mqtt"),
                    tasks.create_task(self.clock.run(), name="clock"),
                    tasks.create_task(self.notifier.watchdog(lambda: True), name="watchdog"),
                    tasks.create_task(self._housekeeping(), name="housekeeping"),
                ]
                self.notifier.ready("waiting for jobs")
                try:
                    await self._until(until_tuned)
                    await self.link.flush(timeout_s=10)
                finally:
                    # the link still runs: tell the agents (ended or cancelled), so they put
                    # power limits back and hold what they would send
                    self._ending = True
                    offline = bus.status_message(
                        self.topics, "coordinator", "offline", self.topics.coordinator_status()
                    )
                    await self.link.disconnect([offline])
                for task in [*background, *(j.task for j in self.tuned.values() if j.task)]:
                    task.cancel()
        finally:
            self._tasks = None
            self.notifier.stopping()
            self.notifier.close()

    async def _until(self, until_tuned: bool) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S / 4)
            jobs = self.tuned.values()
            if not until_tuned or not jobs or self.expected - set(self.tuned):
                continue
            now = self.clock.now()
            if all(j.machine.settled(now) and not j.inbox.qsize() for j in jobs):
                self.notifier.status("every job tuned")
                return

    # -- what comes in -------------------------------------------------------------------

    async def _on_telemetry(self, topic: str, payload: bytes) -> None:
        """What a node carries: its jobs (found, their ranks, their progress) and bounds."""
        try:
            node = self.topics.name_in(topic)
            message = bus.decode(payload, "telemetry")
        except PayloadError:
            self.invalid_payloads += 1
            return
        if node not in self._followed_nodes:
            self._follow_nodes((node,))
        jobs = message.get("jobs")
        if not isinstance(jobs, dict):
            return
        now = self.clock.now()
        bounds = node_bounds(message["actuation"]) if "actuation" in message else None
        for job in self.registry.observe(node, now, jobs, bounds):
            self._consider(job, now)
        for job, totals in jobs.items():
            entry = self.tuned.get(job)
            if entry is None or not isinstance(totals, dict):
                continue
            samples, step_s = totals.get("samples"), totals.get("step_s")
            if isinstance(samples, int | float) and isinstance(step_s, int | float):
                ranks = totals.get("ranks")
                if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
                    ranks = 1
                progress = Progress(float(samples), float(step_s), float(message["ts"]), ranks)
                entry.tell(tuning.Steps(now, node, progress))

    def _consider(self, job: str, now: float) -> None:
        """A job's picture changed: tell its machine, or decide whether to tune it."""
        entry = self.tuned.get(job)
        view = self._view(job, now)
        self._note_foreign(view)
        if entry is not None:
            entry.tell(tuning.Seen(now, view))
            return
        if view.attached == 0:
            self.ignored.pop(job, None)
            return
        reason = admission(self.section, view)
        if reason is None and len(self.tuned) >= self.section.max_jobs:
            reason = f"{self.section.max_jobs} jobs are tuned already (coordinator.max_jobs)"
        if reason is not None:
            if self.ignored.get(job) != reason:
                log.info("%s: found on %s, not tuned: %s", job, ", ".join(view.nodes), reason)
            self.ignored[job] = reason
            return
        self.ignored.pop(job, None)
        self.found += 1
        placeholder = self.section.tuning(job, view.nodes or ("?",), view.details())
        state = self.journals.state_of(job)
        unread = state is None and self.journals.unread(job)
        machine = JobTuning(job, placeholder, state, now, self.backoff)
        machine.version = max(machine.version, self.versions.pop(job, 0))
        entry = self.tuned[job] = TunedJob(machine, self.journals.of(job), unread=unread)
        self.link.follow(self.topics.settings(job), 1, self._on_settings)
        self._follow_nodes(view.nodes)
        log.info(
            "%s: found on %s (%d of %s ranks, user %s)",
            job,
            ", ".join(view.nodes),
            view.attached,
            view.world_size or "?",
            view.said("user") or view.said("uid"),
        )
        entry.tell(tuning.Seen(now, self._view(job, now)))
        if self._tasks is not None:
            entry.task = self._tasks.create_task(self._drive(entry), name=f"job-{job}")

    def _note_foreign(self, view: JobView) -> None:
        """Log, once each, a node carrying the job's id under another user's uid."""
        owner = self.registry.owners.get(view.job)
        for node, uid in view.foreign.items():
            if (view.job, node, uid) not in self.foreign:
                self.foreign.add((view.job, node, uid))
                log.warning(
                    "%s: node %s carries it under uid %d, while its owner is uid %s and its "
                    "nodes are %s: that node is not part of the job",
                    view.job,
                    node,
                    uid,
                    owner,
                    ", ".join(sorted(self.registry.scheduled.get(view.job, ()))) or "any",
                )

    def _view(self, job: str, now: float) -> JobView:
        """The job as the agents see it, on the nodes it must have: its rule's, else (a job
        resumed after a restart, for a while) those of its journal's round."""
        rule = self.section.rule_for(job)
        if rule is not None and rule.nodes:
            return self.registry.view(job, now, rule.nodes)
        entry = self.tuned.get(job)
        nodes = entry.machine.resuming_on(now) if entry is not None else ()
        return self.registry.view(job, now, nodes, "the journal's round")

    async def _on_ack(self, topic: str, payload: bytes) -> None:
        self._route(topic, payload, "ack")

    async def _on_report(self, topic: str, payload: bytes) -> None:
        self._route(topic, payload, "report")

    def _route(self, topic: str, payload: bytes, kind: str) -> None:
        try:
            message = bus.decode(payload, kind)
            if message["node"] != self.topics.sender_in(topic) or message[
                "job"
            ] != self.topics.name_in(topic):
                raise PayloadError(
                    f"{kind} of node {message['node']!r} for job {message['job']!r} on {topic!r}"
                )
        except PayloadError as e:
            self.invalid_payloads += 1
            log.warning("dropped an invalid %s: %s", kind, e)
            return
        entry = self.tuned.get(message["job"])
        if entry is not None:
            event = tuning.Ack if kind == "ack" else tuning.Report
            entry.tell(event(self.clock.now(), message))
        if kind == "report" and message.get("partial") is not True:
            self._confirm(message)

    def _confirm(self, report: dict[str, Any]) -> None:
        """Tell the node its report is here, so it stops sending it again. Every report gets
        its receipt, a repeat too: a version the job's machine has not taken now it never
        takes (the versions in play only rise), and the machine takes a repeat once."""
        job, node = report["job"], report["node"]
        receipt = bus.encode({"job": job, "node": node, "version": report["version"]})
        self.link.publish(self.topics.receipt(job, node), receipt, 1)

    async def _on_settings(self, topic: str, payload: bytes) -> None:
        """Learn the last retained version so versions keep rising across restarts."""
        if not payload:
            return
        try:
            message = bus.decode(payload, "settings")
        except PayloadError:
            return
        if not bus.verify(message, self.trusted):
            return
        job, version = message["job"], message["version"]
        entry = self.tuned.get(job)
        if entry is not None:
            entry.tell(tuning.VersionSeen(version))
        elif len(self.versions) < 100 * self.section.max_jobs:
            self.versions[job] = max(self.versions.get(job, 0), version)

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
        online = message["state"] == "online"
        if self.nodes.get(node) == (online, float(message["ts"])):
            return  # the same status again (through a wildcard and its exact topic)
        self.nodes[node] = (online, float(message["ts"]))
        self._announce_due = self._announce_due or online
        now = self.clock.now()
        if not online:
            for job in self.registry.forget_node(node):
                self._consider(job, now)
        for entry in self.tuned.values():
            if node in entry.machine.nodes:
                entry.tell(tuning.NodeStatus(now, node, online))

    def _follow_nodes(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            if node not in self._followed_nodes:
                self._followed_nodes.add(node)
                self.link.follow(self.topics.status(node), 1, self._on_status)

    # -- each job's task -----------------------------------------------------------------

    async def _drive(self, entry: TunedJob) -> None:
        """Feed one job's machine its events (and a tick at its deadlines), carry out what it
        says, until it ends or fails."""
        machine = entry.machine
        if entry.unread:
            journal = await asyncio.to_thread(self.journals.read, machine.job)
            machine.restored, machine.rounds = journal, journal.rounds
            machine.version = max(machine.version, journal.version)
            self._consider(machine.job, self.clock.now())
        while not machine.terminal:
            wake = machine.wake_at()
            event: tuning.Event
            try:
                wait = None if wake is None else max(0.0, wake - self.clock.now())
                async with asyncio.timeout(wait):
                    event = await entry.inbox.get()
            except TimeoutError:
                event = tuning.Tick(self.clock.now())
                if isinstance(machine.state, lifecycle.WaitingForRanks):
                    self._consider(machine.job, event.now)  # a wait for nodes may be over
            if isinstance(event, tuning.Seen) and isinstance(
                machine.state, lifecycle.WaitingForRanks
            ):
                await self._feed(entry, event)
                if event.view.complete and isinstance(machine.state, lifecycle.WaitingForRanks):
                    event = await self._begin(machine, event)
                else:
                    continue
            await self._feed(entry, event)
        while not entry.inbox.empty():  # what came after the end is of no use to anyone
            entry.inbox.get_nowait()
        entry.done_since = self.clock.now()
        self.update_metrics()

    async def _begin(self, machine: JobTuning, seen: tuning.Seen) -> tuning.Event:
        """Every rank is there: the job's tuning on its nodes, its space, its start."""
        view = seen.view
        rule = self.section.rule_for(machine.job)
        nodes = rule.nodes if rule is not None and rule.nodes else view.nodes
        try:
            cfg = self.section.tuning(machine.job, nodes, view.details())
        except ValidationError as e:
            failure = "; ".join(str(err["msg"]) for err in e.errors())
            return tuning.Begin(seen.now, machine.config, SpacePlan(None, (), failure), {})
        plan = plan_space(cfg, view)
        start = self._start(cfg, plan, self.registry.owners.get(machine.job))
        offline = frozenset(n for n in cfg.nodes if n in self.nodes and not self.nodes[n][0])
        return tuning.Begin(self.clock.now(), cfg, plan, start, offline)

    def _start(self, cfg: JobTuningSection, plan: SpacePlan, owner: int | None) -> dict[str, Any]:
        """The best settings of ``owner``'s latest finished tuning with the same fingerprint,
        else the configured start (its power cap the top of the limits)."""
        start = cfg.start.model_dump()
        if start["power_cap_w"] is None and cfg.power_limits_w:
            start["power_cap_w"] = cfg.power_limits_w[1]
        found = self.journals.finished(owner, fingerprint(cfg))
        if found is not None and plan.space is not None:
            log.info("%s: warm start from %s", cfg.id, found[0])
            return plan.space.snap(found[1])
        return start

    async def _feed(self, entry: TunedJob, event: tuning.Event) -> None:
        pending: list[tuning.Event] = [event]
        while pending:
            for effect in entry.machine.handle(pending.pop(0)):
                follow = await self._carry_out(entry, effect)
                if follow is not None:
                    pending.append(follow)

    async def _carry_out(self, entry: TunedJob, effect: tuning.Effect) -> tuning.Event | None:
        machine = entry.machine
        if isinstance(effect, tuning.Journal):
            owner = self.registry.owners.get(machine.job)
            if effect.entry["type"] == "start" and owner is not None:
                effect.entry["owner"] = owner  # whose tuning this is, for warm starts
            entry.journal.append(effect.entry)
            if effect.entry["type"] == "final":
                self.journals.note_final(
                    machine.job, owner, fingerprint(machine.config), effect.entry
                )
            self.update_metrics()
        elif isinstance(effect, tuning.Publish):
            self._publish(machine.job, effect, machine)
        elif isinstance(effect, tuning.Ask):
            settings = await asyncio.to_thread(effect.tuner.ask)
            return tuning.Asked(self.clock.now(), effect.token, settings)
        elif isinstance(effect, tuning.Say):
            log.log(effect.level, "%s", effect.text)
        elif isinstance(effect, tuning.Status):
            self.notifier.status(effect.text)
        elif isinstance(effect, tuning.Measured) and self.on_trial is not None:
            self.on_trial(machine, effect.record)
        return None

    def _publish(self, job: str, effect: tuning.Publish, machine: JobTuning) -> None:
        assert machine.space is not None
        message = bus.sign(
            {
                "job": job,
                "version": effect.version,
                "trial": effect.trial,
                "nodes": list(effect.nodes),
                "settings": effect.settings,
                "backend": machine.space.backend_mapping(effect.settings),
                "plan": effect.plan.to_dict() if effect.plan else None,
                "issued_at": time.time(),
            },
            self.key,
        )
        self.link.publish(self.topics.settings(job), bus.encode(message), 1, True)

    # -- housekeeping --------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        """Look at every tuned job again (its ranks may have gone quiet), release the ended
        ones after ``release_after_s``, keep the journals within their retention."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = self.clock.now()
            for job, entry in list(self.tuned.items()):
                if entry.done_since is None:
                    if entry.machine.nodes or entry.machine.terminal is False:
                        rule = self.section.rule_for(job)
                        view = self.registry.view(job, now, rule.nodes if rule else ())
                        entry.tell(tuning.Seen(now, view))
                elif now - entry.done_since >= entry.machine.config.release_after_s:
                    self._release(job)
            self._say_settled(now)
            self._announce()
            self.update_metrics()

    def _announce(self) -> None:
        """Publish the online status again when a node came online, or ``ANNOUNCE_S`` passed."""
        now = time.monotonic()
        if self._ending or (not self._announce_due and now - self._announced_at < ANNOUNCE_S):
            return
        self._announce_due = False
        self._announced_at = now
        if self.link.connected.is_set():
            online = bus.status_message(
                self.topics, "coordinator", "online", self.topics.coordinator_status()
            )
            self.link.publish(online.topic, online.payload, online.qos, online.retain)

    def _say_settled(self, now: float) -> None:
        """The daemon's status line says so once every job it tunes is tuned (or over)."""
        settled = bool(self.tuned) and all(e.machine.settled(now) for e in self.tuned.values())
        if settled and not self._settled:
            self.notifier.status("every job tuned")
        self._settled = settled

    def _release(self, job: str) -> None:
        """Forget an ended job: its state and series go, its retained settings are cleared,
        its journal stays."""
        entry = self.tuned.pop(job)
        if entry.task is not None:
            entry.task.cancel()
        self.journals.release(job)
        self.link.unfollow(self.topics.settings(job))
        self.link.publish(self.topics.settings(job), b"", 1, True)
        log.info("%s: released", job)

    # -- metrics -------------------------------------------------------------------------

    def readings(self) -> list[Reading]:
        """What the coordinator exposes on /metrics: the nodes of its jobs (their members, and
        the nodes their rules name: a job waiting for its ranks has no members yet) and each
        job."""
        counters = {
            "hyperagent_coordinator_invalid_payloads_total": self.invalid_payloads,
            "hyperagent_coordinator_jobs_found_total": self.found,
            "hyperagent_coordinator_foreign_sightings_total": len(self.foreign),
        }
        out = [Reading(name, value, {}, Kind.COUNTER) for name, value in counters.items()]
        out.append(Reading("hyperagent_coordinator_jobs_not_tuned", len(self.ignored), {}))
        out += [*self.link.broker_readings(), *self.link.handler_error_readings()]
        counts = dict.fromkeys(lifecycle.STATES, 0)
        members: set[str] = set()
        for job, entry in self.tuned.items():
            counts[lifecycle.name(entry.machine.state)] += 1
            members.update(entry.machine.nodes)
            rule = self.section.rule_for(job)
            members.update(rule.nodes if rule is not None else ())  # a job waiting for them
            out += job_readings(entry.machine)
        for state, count in counts.items():
            out.append(Reading("hyperagent_coordinator_jobs", count, {"state": state}))
        for node in sorted(members & set(self.nodes)):
            online, ts = self.nodes[node]
            out.append(Reading("hyperagent_node_online", float(online), {"node": node}))
            out.append(Reading("hyperagent_node_status_timestamp_seconds", ts, {"node": node}))
        return out

    def update_metrics(self) -> None:
        self.collector.update(self.readings())

    def job(self, job: str) -> JobTuning:
        """The machine of a tuned job (KeyError when it is not tuned here)."""
        return self.tuned[job].machine

    @property
    def jobs(self) -> dict[str, JobTuning]:
        """job -> its machine, for every job tuned here."""
        return {job: entry.machine for job, entry in self.tuned.items()}
