"""Durable writes off the event loop: spooled messages and journal entries on the writer thread,
nothing leaving for the broker before the writes submitted ahead of it are on disk."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import aiomqtt
import pytest
from test_bus import running

from hyperagent import bus, durable
from hyperagent.spool import Spool
from hyperagent.tuner.journal import Journal, JournalError

from conftest import Mosquitto


async def test_a_stuck_disk_holds_spooled_messages_not_the_loop(
    mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """While the writer thread is stuck (a disk that does not answer), publishing and journaling
    return, the loop and telemetry go on, and neither the settings nor a report leaves; once
    the disk answers, the journal entry is on disk before the broker hands out the settings."""
    topics = bus.Topics("t")
    journal = Journal(tmp_path / "state" / "job.jsonl")
    spool_dir = tmp_path / "spool"
    link = bus.MqttLink("127.0.0.1", mosquitto.port, "coordinator", spool_dir=spool_dir)
    disk = threading.Event()
    seen: list[tuple[str, bool]] = []
    async with (
        running(link),
        aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="listener") as listener,
    ):
        await listener.subscribe(f"{topics.root}/#", qos=1)
        stuck = durable.submit(lambda: _wait_for(disk))
        try:
            journal.append({"type": "published", "version": 1, "trial": 0, "settings": {}})
            link.publish(topics.settings("job"), b"settings v1", qos=1, retain=True)
            link.publish(topics.report("job", "n1"), b"report", qos=1)
            link.publish(topics.telemetry("node-a"), b"telemetry", qos=0)
            ticks = 0
            async with asyncio.timeout(30):
                async for message in listener.messages:
                    seen.append((str(message.topic), journal.path.exists()))
                    if str(message.topic) == topics.telemetry("node-a"):
                        break
            while ticks < 20:  # the loop is free
                await asyncio.sleep(0.01)
                ticks += 1
            assert seen == [(topics.telemetry("node-a"), False)]
            assert not journal.path.exists() and not list(spool_dir.glob("*.msg"))
            assert len(link.spool) == 2
        finally:
            disk.set()
        async with asyncio.timeout(30):
            async for message in listener.messages:
                seen.append((str(message.topic), journal.path.exists()))
                if len(seen) == 3:
                    break
        assert await link.flush(30)
    assert stuck.done()
    assert seen[1:] == [(topics.settings("job"), True), (topics.report("job", "n1"), True)]
    durable.wait()
    assert not list(spool_dir.glob("*.msg"))  # each file removed once the broker took it
    state = Journal(journal.path).load()
    assert state.trials == [] and state.in_flight is not None and state.in_flight["version"] == 1


async def test_nothing_is_fsynced_on_the_event_loop(
    mosquitto: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QoS-1 publish and a journal entry reach the disk, fsynced, but never from the loop's
    thread: on a slow disk each fsync would hold every task of the daemon."""
    loop_thread = threading.current_thread()
    fsynced_on: list[threading.Thread] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        fsynced_on.append(threading.current_thread())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    topics = bus.Topics("t")
    journal = Journal(tmp_path / "state" / "job.jsonl")
    link = bus.MqttLink("127.0.0.1", mosquitto.port, "node-a", spool_dir=tmp_path / "spool")
    async with running(link):
        link.publish(topics.report("j", "node-a"), b"report", qos=1)
        journal.append({"type": "published", "version": 1, "trial": 0, "settings": {}})
        assert await link.flush(30)
    assert Journal(journal.path).load().in_flight is not None
    assert len(fsynced_on) >= 2  # the spooled message and the journal entry
    assert loop_thread not in fsynced_on


def _wait_for(disk: threading.Event) -> None:
    disk.wait(60)


def test_spooled_messages_reach_the_disk_in_order_and_survive_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path, limit=100)
    for i in range(50):
        spool.append("t/report", f"r{i}".encode(), 1, False)
    assert all(item.stored is not None for item in spool.pending)
    spool.pending[-1].stored.result(30)  # type: ignore[union-attr]
    assert all(item.stored.done() for item in spool.pending)  # type: ignore[union-attr]
    assert [p.read_bytes().split(b"\n", 1)[1] for p in sorted(tmp_path.glob("*.msg"))] == [
        f"r{i}".encode() for i in range(50)
    ]
    again = Spool(tmp_path, limit=100)
    assert [m.payload for m in again.pending] == [f"r{i}".encode() for i in range(50)]


def test_a_journal_that_cannot_be_written_says_so_at_the_next_entry(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state folder should be")
    journal = Journal(blocker / "job.jsonl")
    written = journal.append({"type": "start", "fingerprint": "x"})
    with pytest.raises(JournalError, match=r"job\.jsonl"):
        written.result(30)
    with pytest.raises(JournalError, match="an earlier entry could not be written"):
        journal.append({"type": "published", "version": 1, "trial": 0, "settings": {}})
    with pytest.raises(JournalError, match="an earlier entry could not be written"):
        journal.load()
