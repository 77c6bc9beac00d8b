"""End-to-end receipts of measurement reports: the broker's PUBACK says only that the broker has
a report; a node keeps it (and sends it again) until the coordinator's receipt says the
coordinator has it. Proven with a broker that loses the coordinator's session: the
coordinator's connection goes through a real TCP relay that the test cuts while the agents
report, and mosquitto (no persistence) restarts with the reports it queued for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from hyperagent import bus
from hyperagent.demo import JOB, simulated_cluster

from conftest import Mosquitto, free_port

pytestmark = pytest.mark.timeout(180)


class Relay:
    """A TCP relay on loopback to one port; while ``deaf`` it drops what comes from that port
    (lost on the way); ``cut`` closes its connections and stops listening (connecting is
    refused), ``mend`` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.deaf = False

    async def mend(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, back: bool) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    if back and self.deaf:
                        continue
                    dst.write(data)
                    await dst.drain()
            for w in (writer, up_writer):
                w.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
        self._writers.difference_update((writer, up_writer))


def _confirmed_runs(journal: Path) -> list[dict[str, Any]]:
    entries = [orjson.loads(line) for line in journal.read_bytes().splitlines() if line.strip()]
    return [e for e in entries if e.get("type") == "trial"]


@pytest.mark.long(60)
async def test_reports_the_broker_lost_with_the_coordinators_session_are_sent_again(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """During the second trial's measurement what the broker sends the coordinator is lost on
    the way: the agents' reports reach the broker (PUBACK, their spools empty), not the
    coordinator; then its connection is cut, and the broker restarts without its session.
    When the coordinator is back, the agents send the reports it never confirmed again: every
    report is accepted once (journal), the spools and the unconfirmed sets end empty, and no
    trial waits for its time-out (without the receipts: 3 reports lost, a trial run again
    after trial_timeout_s, the tuning 117 s instead of 45 s)."""
    relay = Relay(mosquitto.port)
    await relay.mend()
    loop = asyncio.get_running_loop()
    figures: dict[str, float] = {}
    coordinator_dir = tmp_path / "coordinator"
    async with simulated_cluster(
        mosquitto.url,
        nodes=3,
        trials=3,
        seed=4,
        speedup=10,
        coordinator_dir=coordinator_dir,
        job_overrides={"abort_below": 0, "early_stop": False},
    ) as (coordinator, nodes, _):
        link = coordinator.link
        link.brokers = (bus.Broker("127.0.0.1", relay.port),)  # the coordinator via the relay
        agents = [n.agent for n in nodes]

        async def lose_the_session() -> None:
            while True:
                state = coordinator.jobs.get(JOB)
                run = state.run if state is not None else None
                if run is not None and run.measuring and len(state.trials) >= 1:
                    break
                await asyncio.sleep(0.01)
            before = [a.stats.reports_sent for a in agents]
            relay.deaf = True
            cut_at = loop.time()
            while not all(
                a.stats.reports_sent > b and a.link is not None and not a.link.spool
                for a, b in zip(agents, before, strict=True)
            ):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await relay.cut()
            relay.deaf = False
            await loop.run_in_executor(None, mosquitto.stop)  # with the session it held
            await loop.run_in_executor(None, mosquitto.start)
            await relay.mend()
            figures["cut_s"] = loop.time() - cut_at

        losing = asyncio.create_task(lose_the_session())
        started = loop.time()
        await asyncio.wait_for(coordinator.run(until_tuned=True), 150)
        took = loop.time() - started
        await asyncio.wait_for(losing, 5)
        state = coordinator.jobs[JOB]
        sent = sum(a.stats.reports_sent for a in agents)
        resent = sum(a.stats.reports_resent for a in agents)
        async with asyncio.timeout(10):  # the last receipts on their way
            while any(a.unconfirmed for a in agents):
                await asyncio.sleep(0.05)
        spooled_left = sum(len(a.link.spool) for a in agents if a.link is not None)
    await relay.cut()
    runs = [*state.trials, *state.confirmations]
    assert [t.status for t in runs] == ["ok"] * 7
    journal = _confirmed_runs(coordinator_dir / f"{JOB}.jsonl")
    accepted = Counter((entry["version"], node) for entry in journal for node in entry["reports"])
    assert len(journal) == 7 and set(accepted.values()) == {1}
    assert sum(accepted.values()) == sent == 3 * 7  # every report accepted, once
    assert resent >= 3  # the three the broker lost, at least
    assert spooled_left == 0
    assert took < 60, took  # trial_timeout_s is 60: none waited for it
    print(
        f"reports sent {sent}, sent again {resent}, accepted {sum(accepted.values())}; the "
        f"coordinator away {figures['cut_s']:.1f} s; the tuning took {took:.1f} s"
    )
