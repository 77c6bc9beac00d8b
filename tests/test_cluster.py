"""The closed loop as deployed: a cluster of network namespaces installed from the shipped files
(tests/cluster/harness.py), each daemon as its own unprivileged user, the job as another."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cluster.harness import (
    NODES,
    OTHER_USER,
    RANKS_PER_NODE,
    Cluster,
    Unavailable,
    check_host,
    metric_values,
    new_root,
)
from test_prometheus_e2e import panel_queries, variable_queries

from hyperagent.tuner.lifecycle import MEASURED

from conftest import BUSY, unavailable

TORCH_NODE = NODES[0]
UNCAPPED_W = 700.0
"""The replayed H200's power limit."""
MAX_CAP_W = 400.0
"""The top of the shipped job's power_limits_w."""
COMPLETED = MEASURED
"""Trials that measured their settings: ok, aborted below the line, or stopped early."""
PLUMBING = {"no_ack", "timeout", "lost_nodes", "refused"}
"""Trial outcomes that mean the loop's plumbing failed, not the settings."""
NOT_HERE = {
    "hyperagent_gpu_xid_errors_total": "no XID happens on replayed GPUs: the counter has no series",
    "hyperagent_gpu_retired_pages": "an H200 remaps rows, it does not retire pages",
    "hyperagent_pdu_node_power_watts": "the shipped hyperagent.toml maps no PDU outlet to a node",
    "ALERTS{": "the Alerts panel has series only while an alert is pending or firing; on this"
    " healthy cluster none need be pending, and none may fire (asserted above)",
}
"""Metrics of panels that do not apply to the harness's nodes, and why."""


def until(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def deployed(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    try:
        check_host()
    except Unavailable as e:
        unavailable(str(e))
    failed = request.session.testsfailed
    root = new_root()  # not under pytest's 0700 directories: the job users write logs there
    with Cluster(root) as c:
        c.start(torch_node=TORCH_NODE)
        yield c
    if request.session.testsfailed == failed:
        shutil.rmtree(root)
    else:
        print(f"the cluster's logs, journal and files are kept in {root}")


def trials(c: Cluster) -> list[dict[str, Any]]:
    return [e for e in c.journal() if e.get("type") == "trial"]


def completed(c: Cluster) -> list[dict[str, Any]]:
    """Trials that ran to a score: measured, or aborted early by the guardrail on a score."""
    return [t for t in trials(c) if t["status"] in COMPLETED]


def agent_metric(c: Cluster, key: str, name: str) -> list[tuple[dict[str, str], float]]:
    return metric_values(c.metrics(key), name)


def power_limits(c: Cluster, key: str) -> set[float]:
    return {v for _, v in agent_metric(c, key, "hyperagent_gpu_power_limit_watts")}


@pytest.mark.timeout(1200)
@pytest.mark.long(220)
@BUSY
def test_the_loop_closes_as_deployed(deployed: Cluster) -> None:
    c = deployed
    n1, n2, n3 = c.node_keys
    mallory_log = c.start_job(n2, user=OTHER_USER, ranks=1, name="job-mallory")

    until(lambda: len(completed(c)) >= 2, 240, "2 trials")

    # a user outside sources.job.allowed_groups is refused and counted
    refused = until(
        lambda: [
            v
            for labels, v in agent_metric(c, n2, "hyperagent_job_refused_total")
            if labels["reason"] == "unauthorised" and v >= 1
        ],
        30,
        "the other user's refusal on /metrics",
    )
    assert refused
    assert any("refused" in e for e in c.node_log(n2, mallory_log.name))

    # a 30 s broker outage during a trial, with the shipped timeouts
    before = len(trials(c))
    until(
        lambda: (
            c.journal()[-1].get("type") == "published" and c.journal()[-1].get("trial") is not None
        ),
        60,
        "a trial in flight",
    )
    c.kill("mosquitto")
    time.sleep(30)
    c.start_broker()
    until(lambda: len(trials(c)) >= before + 2, 300, "2 trials after the outage")

    # coordinator blip: its last will restores the caps, its return applies them again
    c.kill("coordinator")
    for key in c.node_keys:
        until(
            lambda key=key: "coordinator offline: restored" in c.agent_log(key),
            60,
            f"{key} restoring the power limits",
        )
    for key in c.node_keys:
        until(lambda key=key: power_limits(c, key) == {UNCAPPED_W}, 30, f"{key} uncapped")
    c.start_coordinator()
    for key in c.node_keys:
        until(
            lambda key=key: "coordinator online: applying" in c.agent_log(key),
            60,
            f"{key} applying the current settings again",
        )
        until(lambda key=key: max(power_limits(c, key)) <= MAX_CAP_W, 30, f"{key} capped again")

    until(lambda: len(completed(c)) >= 8, 600, "8 trials")

    done = trials(c)
    statuses = [t["status"] for t in done]
    assert not PLUMBING & set(statuses), statuses
    assert all(len(t["reports"]) == len(NODES) for t in completed(c)), done

    # the job runs as another user, 8 ranks per node, each on its own connection, and every
    # rank received every settings version published after it began (the coordinator goes on
    # tuning: versions newer than this read of the journal, and the newest in flight, aside)
    published = [e["version"] for e in c.journal() if e.get("type") == "published"]
    for key in (n2, n3):
        ranks = [
            v
            for lb, v in agent_metric(c, key, "hyperagent_job_ranks")
            if lb["job_id"] == c.job_id()
        ]
        assert ranks == [RANKS_PER_NODE], (key, ranks)
        log = c.node_log(key, "job-ha-train.jsonl")
        by_rank: dict[int, list[int]] = {}
        for e in log:
            if "received" in e:
                by_rank.setdefault(e["rank"], []).append(e["received"])
        assert len(by_rank) == RANKS_PER_NODE, (key, sorted(by_rank))
        for rank, received in by_rank.items():
            expected = [v for v in published if v >= received[0]]
            until_read = [v for v in received if v <= published[-1]]
            assert until_read in (expected, expected[:-1]), (key, rank, received, published)
    torch_versions = {e["version"] for e in c.node_log(n1, "torch-0.jsonl")}
    assert {v for v in published[-3:]} - torch_versions <= {published[-1]}, (
        torch_versions,
        published,
    )

    refusals = sum(v for _, v in agent_metric(c, n2, "hyperagent_job_refused_total"))
    print(
        f"\ncluster: {len(done)} trials {dict(Counter(statuses))}, settings versions "
        f"{published[0]}..{published[-1]} ({len(published)} published), received by the "
        f"{RANKS_PER_NODE} ha-train ranks of each node: all; other user's connections refused: "
        f"{refusals:.0f}"
    )

    # Prometheus, scraping across namespaces: every node, the coordinator, no alert firing
    instances = [f"{c.hosts[k].name}:10478" for k in c.node_keys]
    up = {s["metric"]["instance"]: s["value"][1] for s in c.query('up{job="hyperagent"}')}
    assert up == {i: "1" for i in instances}
    gpus = c.query("count by (instance) (hyperagent_gpu_power_watts)")
    assert {s["metric"]["instance"] for s in gpus} == set(instances)
    assert c.query('ALERTS{alertstate="firing"}') == []

    missing = {}
    for where, expr in panel_queries(instances, cluster="prod", job_id=c.job_id()):
        if any(metric in expr for metric in NOT_HERE):
            continue
        if not c.query(expr):
            missing[where] = expr
    assert not missing, f"panels without data on the harness: {missing}"
    for name, selector, _ in variable_queries(cluster="prod"):
        assert c.query(selector), (name, selector)
