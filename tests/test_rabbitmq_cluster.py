"""The namespace cluster (tests/cluster/harness.py) on a 3-node RabbitMQ cluster installed from
systemd/rabbitmq/ (MQTT over TLS on 8883, durable sessions in quorum queues, the users and topic
permissions of hyperagent-rabbitmq-users), each broker node a host of its own, the agents spread
over them (two on the first, one on the third), the coordinator on the second, every daemon
given the three addresses and the agents persistent sessions. SIGKILL during a trial of the
broker node holding the coordinator's connection, or in a second run of the one holding most
agents: every report sent is accepted once, the agents' spools end empty, no trial waits for
its time-out, every link is connected elsewhere (an agent's gate open again) within
2 x reconnect_max_s, and the tuning ends with its final version applied on every node.

Its own step of ``.ci/run`` (marker ``broker_cluster``: three RabbitMQ nodes take a minute to
start and join on two cores); the default test command leaves it out.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections import Counter

import pytest
from cluster.harness import Cluster, Unavailable, check_host, metric_values, new_root
from test_cluster import COMPLETED, trials, until

from conftest import unavailable

pytestmark = [pytest.mark.broker_cluster, pytest.mark.timeout(600), pytest.mark.long(240)]

RECONNECT_MAX_S = 30.0
"""The shipped mqtt.reconnect_max_s (its default)."""
TRIAL_TIMEOUT_S = 60
DEFAULTS = {
    "trials": "3",
    "trial_timeout_s": str(TRIAL_TIMEOUT_S),
    "abort_below": "0",
    "plan.settle_s": "1.0",
    "plan.measure_s": "2.0",
    "plan.windows": "2",
}
"""A short tuning: 3 trials, then the confirmations."""


def agent_value(c: Cluster, key: str, name: str, **labels: str) -> float | None:
    values = [
        v
        for lb, v in metric_values(c.metrics(key), name)
        if all(lb.get(k) == want for k, want in labels.items())
    ]
    return values[0] if values else None


def in_flight(c: Cluster) -> bool:
    journal = c.journal()
    done = [e for e in journal if e.get("type") == "trial"]
    last = journal[-1] if journal else {}
    return bool(done) and last.get("type") == "published" and last.get("trial") is not None


@pytest.mark.parametrize("victim", ["coordinator", "most agents"])
def test_killing_a_broker_node_mid_trial_loses_no_report(victim: str) -> None:
    try:
        check_host("rabbitmq")
    except Unavailable as e:
        unavailable(str(e))
    root = new_root()
    with Cluster(root, broker="rabbitmq", defaults=DEFAULTS) as c:
        c.start()
        clients = ["ctl", *c.node_keys]
        until(lambda: all(c.mqtt_peer(k) for k in clients), 60, "every daemon connected")
        queues = c.rabbitmqctl("b0", "-s", "list_queues", "-p", "hyperagent", "name", "type")
        sessions = dict(line.split("\t")[:2] for line in queues.splitlines() if "\t" in line)
        durable = {q: t for q, t in sessions.items() if q.endswith("qos1")}  # QoS 0: classic
        assert len(durable) == len(clients) and set(durable.values()) == {"quorum"}, sessions
        until(lambda: in_flight(c), 300, "a trial in flight after the first")
        time.sleep(0.5)
        held_by = {k: c.mqtt_peer(k) for k in clients}
        if victim == "coordinator":
            target = held_by["ctl"]
        else:
            target = Counter(held_by[k] for k in c.node_keys).most_common(1)[0][0]
        assert target is not None, held_by
        version = c.journal()[-1]["version"]
        c.kill(f"rabbitmq-{c.hosts[target].name}")
        killed = time.monotonic()
        killed_at = time.time()
        held = [k for k in clients if held_by[k] == target]
        reconnected: dict[str, float] = {}
        while len(reconnected) < len(held) and time.monotonic() < killed + 3 * RECONNECT_MAX_S:
            for key in held:
                if key in reconnected:
                    continue
                peer = c.mqtt_peer(key)
                if peer not in (None, target) and (
                    key == "ctl" or agent_value(c, key, "hyperagent_mqtt_gate_open") == 1
                ):
                    reconnected[key] = time.monotonic() - killed
            time.sleep(0.1)

        final = until(
            lambda: next((e for e in c.journal() if e.get("type") == "final"), None),
            300,
            "the tuning's final version",
        )
        for key in c.node_keys:
            until(
                lambda key=key: (
                    agent_value(c, key, "hyperagent_job_settings_version", job_id=c.job_id())
                    == final["version"]
                ),
                30,
                f"{key} applying the final version",
            )
            until(
                lambda key=key: (
                    agent_value(c, key, "hyperagent_mqtt_queued_messages") == 0
                    and agent_value(c, key, "hyperagent_reports_unconfirmed") == 0
                ),
                30,
                f"{key}'s spool empty",
            )
        sent = sum(agent_value(c, k, "hyperagent_reports_sent_total") or 0 for k in c.node_keys)
        resent = sum(agent_value(c, k, "hyperagent_reports_resent_total") or 0 for k in c.node_keys)
        journal = c.journal()
        runs = trials(c)
        logs = c.logs

    published = {e["version"]: e["ts"] for e in journal if e.get("type") == "published"}
    took = {t["version"]: t["ts"] - published[t["version"]] for t in runs}
    statuses = [t["status"] for t in runs]
    assert set(statuses) <= COMPLETED, statuses
    assert max(took.values()) < TRIAL_TIMEOUT_S, took
    interrupted = next(t for t in runs if t["version"] == version)
    assert published[version] < killed_at < interrupted["ts"], "the kill fell between trials"
    accepted = Counter((t["version"], node) for t in runs for node in t["reports"])
    assert set(accepted.values()) == {1}, accepted
    assert sum(accepted.values()) == sent == len(c.node_keys) * len(runs), (accepted, sent)
    assert victim != "coordinator" or "ctl" in held
    assert victim == "coordinator" or sum(k != "ctl" for k in held) == 2, held_by
    assert set(reconnected) == set(held), (held_by, reconnected, logs)
    assert max(reconnected.values()) < 2 * RECONNECT_MAX_S, reconnected
    others = [d for v, d in took.items() if v != version]
    lost = took.get(version, 0.0) - statistics.median(others)
    print(
        f"\nRabbitMQ namespace cluster, the node of the {victim} killed: {len(held)} links "
        f"connected elsewhere within {max(reconnected.values()):.2f} s "
        f"({', '.join(f'{k} {s:.2f} s' for k, s in reconnected.items())}), the trial in flight "
        f"{took.get(version, 0.0):.1f} s ({lost:+.1f} s over the others' median "
        f"{statistics.median(others):.1f} s), "
        f"{len(runs)} runs {dict(Counter(statuses))}, reports sent {sent:.0f}, sent again "
        f"{resent:.0f}, final version {final['version']} on every node"
    )
    shutil.rmtree(root)
