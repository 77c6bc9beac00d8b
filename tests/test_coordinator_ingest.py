"""The coordinator's ingest: jobs found from telemetry, admitted by policy, messages routed to
their job, invalid payloads counted, only the jobs' nodes on /metrics."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from hyperagent import bus
from hyperagent.config import build_config
from hyperagent.coordinator import Coordinator
from hyperagent.signing import SigningKey
from hyperagent.tuner import tuning
from hyperagent.tuner.journals import Journals

TOPICS = bus.Topics("c")
KEY = SigningKey.generate()


def _coordinator(tmp_path: Path, **coordinator: Any) -> Coordinator:
    config = build_config(
        {
            "cluster": "c",
            "coordinator": {"state_dir": str(tmp_path), "metrics_address": "", **coordinator},
        }
    )
    return Coordinator(config, bus.MqttLink("127.0.0.1", 1, "x"), KEY)


def _job(ranks: range, world: int, **said: Any) -> dict[str, Any]:
    return {
        "samples": 64,
        "step_s": 2.0,
        "attached": len(ranks),
        "ranks": len(ranks),
        "rank_ids": list(ranks),
        "world_size": world,
        "local_world_size": len(ranks),
        "tune": True,
        "user": "alice",
        "uid": 1001,
        "gpus": list(range(len(ranks))),
        **said,
    }


def _telemetry(node: str, jobs: object, ts: float = 5.0) -> bytes:
    return bus.encode(
        {"node": node, "ts": ts, "indicators": {}, "sources_up": {}, "jobs": jobs, "gpu": [1]}
    )


def _events(coordinator: Coordinator, job: str) -> list[tuning.Event]:
    inbox = coordinator.tuned[job].inbox
    return [inbox.get_nowait() for _ in range(inbox.qsize())]


def _feed(coordinator: Coordinator, *messages: tuple[str, bytes]) -> None:
    async def go() -> None:
        for topic, payload in messages:
            handler = {
                "telemetry": coordinator._on_telemetry,
                "status": coordinator._on_status,
                "settings": coordinator._on_settings,
            }.get(topic.rsplit("/", 1)[-1], None)
            if handler is None:
                kind = "ack" if "/ack/" in topic else "report"
                coordinator._route(topic, payload, kind)
            else:
                await handler(topic, payload)

    asyncio.run(go())


def test_a_job_is_found_from_its_ranks_on_two_nodes_and_waits_for_its_world(
    tmp_path: Path,
) -> None:
    coordinator = _coordinator(tmp_path)
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(8), 16)})))
    machine = coordinator.job("j")
    seen = [e for e in _events(coordinator, "j") if isinstance(e, tuning.Seen)]
    assert seen[-1].view.nodes == ("n0",) and not seen[-1].view.complete
    missing = seen[-1].view.missing
    assert "ranks 8, 9, 10" in missing and "(8 of 16 attached)" in missing
    _feed(coordinator, (TOPICS.telemetry("n1"), _telemetry("n1", {"j": _job(range(8, 16), 16)})))
    seen = [e for e in _events(coordinator, "j") if isinstance(e, tuning.Seen)]
    assert seen[-1].view.complete and seen[-1].view.nodes == ("n0", "n1")
    assert coordinator.found == 1 and machine is coordinator.job("j")


def test_the_policy_decides_which_found_jobs_are_tuned_and_says_why_not(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, defaults={"users": ["alice"]})
    jobs = {
        "asked": _job(range(8), 8),
        "silent": _job(range(8), 8, tune=None),
        "refuses": _job(range(8), 8, tune=False),
        "bob": _job(range(8), 8, user="bob", uid=1002),
        "idle": _job(range(0), 8),
    }
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", jobs)))
    assert set(coordinator.tuned) == {"asked"}
    assert coordinator.ignored == {
        "silent": 'its ranks did not ask to be tuned (tune = "asked")',
        "refuses": 'its ranks did not ask to be tuned (tune = "asked")',
        "bob": "its user (bob) is not one of coordinator.defaults.users",
    }
    everyone = _coordinator(tmp_path / "all", defaults={"tune": "all"})
    _feed(everyone, (TOPICS.telemetry("n0"), _telemetry("n0", jobs)))
    assert set(everyone.tuned) == {"asked", "silent", "bob"}
    assert everyone.ignored == {"refuses": "its ranks asked not to be tuned"}


def test_a_job_whose_users_name_comes_after_its_uid_is_tuned_once_it_does(
    tmp_path: Path,
) -> None:
    """An agent looks a rank's user name up off its loop: its first telemetry says the uid
    only. The job waits for the name, then is tuned, with no other change on the node."""
    coordinator = _coordinator(tmp_path, defaults={"users": ["alice"]})
    early = _job(range(8), 8)
    del early["user"]
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": early})))
    assert coordinator.ignored == {"j": "its user's name (uid 1001) is not known yet"}
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(8), 8)}, 6.0)))
    assert set(coordinator.tuned) == {"j"} and not coordinator.ignored


def test_no_more_jobs_than_max_jobs_are_tuned(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path, max_jobs=2)
    jobs = {f"j{i}": _job(range(1), 1) for i in range(3)}
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", jobs)))
    assert set(coordinator.tuned) == {"j0", "j1"}
    assert "coordinator.max_jobs" in coordinator.ignored["j2"]


def test_progress_reaches_only_its_jobs_machine(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    jobs = {"a": _job(range(8), 8), "b": _job(range(8), 8, samples=32, step_s=1.0)}
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", jobs)))
    steps = {
        job: [e.progress for e in _events(coordinator, job) if isinstance(e, tuning.Steps)]
        for job in ("a", "b")
    }
    assert [(p.samples, p.step_s, p.ranks) for p in steps["a"]] == [(64.0, 2.0, 8)]
    assert [(p.samples, p.step_s, p.ranks) for p in steps["b"]] == [(32.0, 1.0, 8)]


def test_invalid_telemetry_is_counted_not_fatal(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    good = _telemetry("n0", {"j": _job(range(1), 1)})
    bad = [
        (TOPICS.telemetry("n0"), b"not json"),
        (TOPICS.telemetry("n0"), b"[1, 2]"),
        (TOPICS.telemetry("n0"), bus.encode({"node": "n0", "ts": "late"})),
        (TOPICS.telemetry("n0"), good.replace(b'"schema":1', b'"schema":2')),
        ("somewhere/else/node/n0/telemetry", good),
    ]
    _feed(coordinator, *bad, (TOPICS.telemetry("n0"), good))
    assert coordinator.invalid_payloads == len(bad)
    assert set(coordinator.tuned) == {"j"}


def test_fields_of_the_wrong_type_are_taken_as_not_said(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    weird = _job(range(2), "two", rank_ids="0,1", user=7, knobs="everything", tune="yes")
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": weird, "k": None})))
    assert coordinator.tuned == {}  # tune "yes" is not a yes
    assert coordinator.ignored == {"j": 'its ranks did not ask to be tuned (tune = "asked")'}


def test_acks_and_reports_reach_their_jobs_machine_and_forgeries_are_dropped(
    tmp_path: Path,
) -> None:
    coordinator = _coordinator(tmp_path)
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(1), 1)})))
    _events(coordinator, "j")
    ack = {"job": "j", "node": "n0", "version": 3, "ok": True, "applied": {}, "ts": 1.0}
    _feed(
        coordinator,
        (TOPICS.ack("j", "n0"), bus.encode(ack)),
        (TOPICS.ack("j", "n1"), bus.encode(ack)),  # n1 speaking for n0
        (TOPICS.ack("other", "n0"), bus.encode({**ack, "job": "other"})),  # not tuned here
    )
    events = _events(coordinator, "j")
    assert [type(e) for e in events] == [tuning.Ack] and events[0].message["version"] == 3
    assert coordinator.invalid_payloads == 1


def test_versions_retained_before_a_job_is_found_keep_rising(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    message = {"job": "j", "settings": {}, "backend": {}, "issued_at": 1.0}
    signed = bus.sign({**message, "version": 41}, KEY)
    forged = bus.sign({**message, "version": 900}, SigningKey.generate())
    _feed(
        coordinator,
        (TOPICS.settings("j"), bus.encode(signed)),
        (TOPICS.settings("j"), bus.encode(forged)),
        (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(1), 1)})),
    )
    assert coordinator.job("j").version == 41


def test_an_offline_node_takes_its_sightings_with_it(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    _feed(
        coordinator,
        (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(8), 16)})),
        (TOPICS.telemetry("n1"), _telemetry("n1", {"j": _job(range(8, 16), 16)})),
    )
    _events(coordinator, "j")
    offline = bus.status_message(TOPICS, "n1", "offline").payload
    _feed(coordinator, (TOPICS.status("n1"), offline))
    events = _events(coordinator, "j")
    seen = [e for e in events if isinstance(e, tuning.Seen)]
    assert seen and seen[-1].view.nodes == ("n0",) and not seen[-1].view.complete


def test_only_the_nodes_of_tuned_jobs_are_on_metrics(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    statuses = [
        (
            TOPICS.status(f"elsewhere-{i}"),
            bus.status_message(TOPICS, f"elsewhere-{i}", "online").payload,
        )
        for i in range(2000)
    ]
    _feed(
        coordinator,
        *statuses,
        (TOPICS.status("n0"), bus.status_message(TOPICS, "n0", "online").payload),
        (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(1), 1)})),
    )
    entry = coordinator.tuned["j"]
    seen = [e for e in _events(coordinator, "j") if isinstance(e, tuning.Seen)][-1]

    async def begin() -> None:
        await coordinator._feed(entry, seen)
        await coordinator._feed(entry, await coordinator._begin(entry.machine, seen))

    asyncio.run(begin())
    registry = CollectorRegistry()
    coordinator.update_metrics()
    registry.register(coordinator.collector)
    samples = [s for m in registry.collect() for s in m.samples]
    online = [s.labels["node"] for s in samples if s.name == "hyperagent_node_online"]
    assert online == ["n0"]
    states = {
        s.labels["state"]: s.value for s in samples if s.name == "hyperagent_coordinator_jobs"
    }
    assert states["searching"] == 1 and sum(states.values()) == 1
    found = [s.value for s in samples if s.name == "hyperagent_coordinator_jobs_found_total"]
    assert found == [1.0]


def test_the_journals_are_loaded_off_the_event_loop(tmp_path: Path) -> None:
    coordinator = _coordinator(tmp_path)
    threads: list[threading.Thread] = []
    load = Journals.load

    def recording_load(self: Journals) -> Any:
        threads.append(threading.current_thread())
        return load(self)

    async def start() -> None:
        task = asyncio.create_task(coordinator.run())
        async with asyncio.timeout(10):
            while not threads:
                await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    Journals.load = recording_load  # type: ignore[method-assign]
    try:
        asyncio.run(start())
    finally:
        Journals.load = load  # type: ignore[method-assign]
    assert threads and threading.main_thread() not in threads


def test_a_restarted_coordinator_resumes_a_round_on_its_nodes_not_the_first_heard_from(
    tmp_path: Path,
) -> None:
    """The journal's round ran on n0 and n1. After a restart n0's telemetry comes first, and
    its ranks say a world that n0 alone fills: the job waits for n1 (for ranks_wait_s), and
    resumes on both instead of starting over on n0."""
    start = {"type": "start", "fingerprint": "nccl/2n/?B/?", "nodes": ["n0", "n1"], "space": {}}
    (tmp_path / "j.jsonl").write_bytes(orjson.dumps(start) + b"\n")
    coordinator = _coordinator(tmp_path, defaults={"ranks_wait_s": 60})
    coordinator.journals.load()
    _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(2), 2)})))
    seen = [e for e in _events(coordinator, "j") if isinstance(e, tuning.Seen)][-1]
    assert not seen.view.complete
    assert seen.view.missing == "nodes n1 (the journal's round) carry no rank"
    _feed(coordinator, (TOPICS.telemetry("n1"), _telemetry("n1", {"j": _job(range(2, 10), 10)})))
    seen = [e for e in _events(coordinator, "j") if isinstance(e, tuning.Seen)][-1]
    assert seen.view.complete and seen.view.nodes == ("n0", "n1")
    machine = coordinator.job("j")
    assert machine.resuming_on(machine.state.since + 59) == ("n0", "n1")
    assert machine.resuming_on(machine.state.since + 60) == ()  # then on what is there


def _finished_journal(path: Path, owner: int | None, settings: dict[str, Any]) -> None:
    """A finished tuning of the fingerprint of a one-node NCCL job, ``settings`` its final."""
    start: dict[str, Any] = {"type": "start", "fingerprint": "nccl/1n/?B/?", "space": {}}
    if owner is not None:
        start["owner"] = owner
    trial = {"type": "trial", "index": 0, "version": 1, "settings": settings, "status": "ok"}
    final = {"type": "final", "version": 2, "settings": settings, "ts": 1.0}
    ended = {"type": "ended", "reason": "every rank left"}
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in (start, trial, final, ended)))


def test_a_job_starts_from_its_own_users_finished_tunings_only(tmp_path: Path) -> None:
    """mallory's finished tuning of the same fingerprint as alice's job (and one whose owner
    no journal says) starts nothing of alice's; alice's own finished tuning warm-starts it."""
    theirs = {"bucket_mb": 4, "chunk_kb": 64, "allreduce": "tree"}
    _finished_journal(tmp_path / "u1003-m.jsonl", 1003, theirs)
    _finished_journal(tmp_path / "old.jsonl", None, theirs)

    def first_settings(state_dir: Path) -> dict[str, Any]:
        coordinator = _coordinator(state_dir, defaults={"backend": "nccl"})
        coordinator.journals.load()
        _feed(coordinator, (TOPICS.telemetry("n0"), _telemetry("n0", {"j": _job(range(8), 8)})))
        seen = [e for e in _events(coordinator, "j") if isinstance(e, tuning.Seen)][-1]
        assert seen.view.complete and coordinator.registry.owners["j"] == 1001
        begin = asyncio.run(coordinator._begin(coordinator.job("j"), seen))
        assert isinstance(begin, tuning.Begin)
        return dict(begin.start)

    configured = first_settings(tmp_path / "empty")
    assert first_settings(tmp_path) == configured
    mine = {"bucket_mb": 128, "chunk_kb": 1024, "allreduce": "ring"}
    _finished_journal(tmp_path / "u1001-a.jsonl", 1001, mine)
    assert first_settings(tmp_path) == mine
