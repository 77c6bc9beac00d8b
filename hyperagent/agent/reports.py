"""The node's reports of its trials to the coordinator, and their receipts: a final report is
kept with its payload until the coordinator confirms it (or a newer version), sent again every
``RESEND_S`` and all at once when the coordinator says it is online (it may have lost its
session with the broker)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from hyperagent import bus, ticks
from hyperagent.agent.stats import AgentStats
from hyperagent.errors import PayloadError

RESEND_S = 5.0
"""A measurement report the coordinator has not confirmed (its receipt) is sent again this
often, and at once when the coordinator says it is online (it may have lost its session)."""

UNCONFIRMED_MAX = 256
"""Reports kept for resending at most (the oldest go first)."""


class Reports:
    """Sends the node's reports; owns the unconfirmed ones and their resending."""

    def __init__(
        self, link: bus.MqttLink | None, topics: bus.Topics, node: str, stats: AgentStats
    ) -> None:
        self.link = link
        self.topics = topics
        self.node = node
        self.stats = stats
        self.unconfirmed: dict[tuple[str, int], tuple[str, bytes, float]] = {}
        """(job, version) -> (topic, payload, when last sent) of each measurement report the
        coordinator has not confirmed yet."""
        self._wake = asyncio.Event()
        """Set when a report is kept unconfirmed, or every one is to go again at once
        (``resend_all``)."""
        self._all = False

    def send(self, job: str, version: int, payload: bytes, final: bool) -> None:
        """Publish this node's report of ``job``'s ``version``; a ``final`` one is kept until
        the coordinator confirms it."""
        if self.link is None:
            return
        topic = self.topics.report(job, self.node)
        self.link.publish(topic, payload, qos=1)
        if final:
            self.keep(job, version, topic, payload)

    def keep(self, job: str, version: int, topic: str, payload: bytes) -> None:
        """Keep a final report until the coordinator confirms it; a job's older versions go
        (the coordinator moved on from them)."""
        for key in [k for k in self.unconfirmed if k[0] == job and k[1] < version]:
            del self.unconfirmed[key]
        self.unconfirmed[(job, version)] = (topic, payload, time.monotonic())
        self._wake.set()  # its resend check begins
        while len(self.unconfirmed) > UNCONFIRMED_MAX:
            del self.unconfirmed[next(iter(self.unconfirmed))]

    def resend_all(self) -> None:
        """Send every unconfirmed report again at once (the coordinator came online)."""
        self._all = True
        self._wake.set()

    async def on_receipt(self, topic: str, payload: bytes) -> None:
        """The coordinator has this node's report of ``version`` (and so needs no older one)."""
        try:
            job = self.topics.name_in(topic)
            message = bus.decode(payload, "receipt")
        except PayloadError:
            self.stats.invalid_payloads += 1
            return
        if message["job"] != job or message["node"] != self.node:
            self.stats.invalid_payloads += 1
            return
        version = message["version"]
        for key in [k for k in self.unconfirmed if k[0] == job and k[1] <= version]:
            del self.unconfirmed[key]

    async def loop(self) -> None:
        """Send again each report unconfirmed for ``RESEND_S`` (each one at once when the
        coordinator comes online), while the link has handed everything before to the broker
        (a gated or disconnected link does not pile up copies). Looked at every
        ``RESEND_S / 2`` (on the loop's grid, :mod:`hyperagent.ticks`) while a report is
        unconfirmed; no wake-ups while none is."""
        loop = asyncio.get_running_loop()
        while True:
            due = ticks.next_tick(loop.time(), RESEND_S / 2) if self.unconfirmed else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(due):
                    await self._wake.wait()
            self._wake.clear()
            now_too, self._all = self._all, False
            link = self.link
            if link is None or not link.connected.is_set() or link.spool:
                continue
            now = time.monotonic()
            for key, (topic, payload, sent) in list(self.unconfirmed.items()):
                if now_too or now - sent >= RESEND_S:
                    link.publish(topic, payload, qos=1)
                    self.unconfirmed[key] = (topic, payload, now)
                    self.stats.reports_resent += 1
