"""One job's tuning under every order of events: nodes going offline and coming back, going
silent, refusing, ranks leaving and rejoining, time passing, a broker node lost (its nodes'
last wills, their return, and the reports they send again), and the coordinator killed and
restarted from its journal at any point. Invariants hold after every step.

``HYPERAGENT_PROPERTY_EXAMPLES`` sets the example count (CI: 200)."""

from __future__ import annotations

import atexit
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tuner.driver import Driver, Nodes, begin, coordinator_section, empty_view, view

from hyperagent.tuner import lifecycle, tuning
from hyperagent.tuner.journal import Journal

NODES = ("n0", "n1", "n2", "n3")
EXAMPLES = int(os.environ.get("HYPERAGENT_PROPERTY_EXAMPLES", "200"))
CHECKS: Counter[str] = Counter()
"""Invariant checks made, and the states examples ended in (printed at exit by a run of more
examples than CI's)."""
if EXAMPLES > 200:
    atexit.register(lambda: print(dict(CHECKS)))


def score(settings: dict) -> float:
    bucket = float(settings.get("bucket_mb") or 25)
    chunk = float(settings.get("chunk_kb") or 4096)
    return 1000.0 + 40.0 * (bucket == 64) + 25.0 * (chunk == 1024)


def joules_per_sample(settings: dict) -> float:
    """Least at a 150 W cap (the power cap searched for energy)."""
    return 0.5 * (1.0 + abs(float(settings.get("power_cap_w") or 150) - 150) / 300)


class JobUnderFaults(RuleBasedStateMachine):
    """The throughput objective: the tuner's plain model over the DDP knobs."""

    SECTION: ClassVar[dict[str, object]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="hyperagent-props-")
        self.path = Path(self.tmp.name) / "j.jsonl"
        self.section = coordinator_section(
            trials=6, trial_timeout_s=60, ack_timeout_s=10, **self.SECTION
        )
        self.nodes = Nodes(NODES, score, joules_per_sample=joules_per_sample)
        self.driver: Driver = begin("j", NODES, self.path, self.section, self.nodes)
        self.offline: set[str] = set()
        self.left: set[str] = set()
        self.versions: list[int] = []
        self.restarts = 0

    def teardown(self) -> None:
        CHECKS[f"ended {lifecycle.name(self.machine.state)}"] += 1
        CHECKS["restarts"] += self.restarts
        CHECKS["trials journalled"] += len(Journal(self.path).load().trials)
        self.tmp.cleanup()

    @property
    def machine(self) -> tuning.JobTuning:
        return self.driver.machine

    def _seen(self) -> None:
        carrying = [n for n in NODES if n not in self.left and n not in self.offline]
        v = view("j", carrying) if carrying else empty_view("j")
        self.driver.feed(tuning.Seen(self.driver.now, v))

    @precondition(lambda self: not self.machine.terminal)
    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0, 65.0, 400.0]))
    def time_passes(self, seconds: float) -> None:
        self.driver.advance(seconds)

    @precondition(lambda self: not self.machine.terminal)
    @rule(node=st.sampled_from(NODES), online=st.booleans())
    def status(self, node: str, online: bool) -> None:
        (self.offline.discard if online else self.offline.add)(node)
        self.driver.feed(tuning.NodeStatus(self.driver.now, node, online))
        self._seen()

    @precondition(lambda self: not self.machine.terminal)
    @rule(node=st.sampled_from(NODES), silent=st.booleans())
    def silence(self, node: str, silent: bool) -> None:
        (self.nodes.silent.add if silent else self.nodes.silent.discard)(node)

    @precondition(lambda self: not self.machine.terminal)
    @rule(node=st.sampled_from(NODES), kind=st.sampled_from(["settings", "node", None]))
    def refusal(self, node: str, kind: str | None) -> None:
        if kind is None:
            self.nodes.refuse.pop(node, None)
        else:
            self.nodes.refuse[node] = kind

    @precondition(lambda self: not self.machine.terminal)
    @rule(node=st.sampled_from(NODES), leave=st.booleans())
    def ranks(self, node: str, leave: bool) -> None:
        (self.left.add if leave else self.left.discard)(node)
        self._seen()

    @precondition(lambda self: not self.machine.terminal)
    @rule(lost=st.sets(st.sampled_from(NODES), min_size=1))
    def broker_node_lost(self, lost: set[str]) -> None:
        """The broker node holding these nodes' connections is killed: their last wills say
        offline, they reconnect to another node, and each sends its last report again (the
        coordinator may have had it already, or it may be for a version no longer in play)."""
        for node in sorted(lost):
            self.driver.feed(tuning.NodeStatus(self.driver.now, node, False))
        self.driver.advance(0.5)
        for node in sorted(lost):
            self.driver.feed(tuning.NodeStatus(self.driver.now, node, node not in self.offline))
        for node in sorted(lost):
            if node in self.driver.reports:
                resent = self.driver.reports[node]
                self.driver.feed(tuning.Report(self.driver.now, resent.message))

    @rule()
    def coordinator_killed_and_restarted(self) -> None:
        now = self.driver.now
        highest = max(self.versions, default=0)
        unconfirmed = self.driver.reports  # the agents keep them and send them again
        self.driver = begin("j", NODES, self.path, self.section, self.nodes)
        self.driver.now = now
        self.driver.reports = unconfirmed
        self.driver.feed(tuning.VersionSeen(highest))  # the broker's retained settings
        self.restarts += 1

    @invariant()
    def versions_only_rise(self) -> None:
        CHECKS["invariants"] += 1
        for publish in self.driver.published:
            if not self.versions or publish.version > self.versions[-1]:
                self.versions.append(publish.version)
            else:
                assert publish.version in self.versions, (publish.version, self.versions)
        self.driver.published.clear()

    @invariant()
    def the_journal_never_repeats_an_index_nor_searches_after_confirming(self) -> None:
        CHECKS["invariants"] += 1
        entries = Journal(self.path).load()  # refuses a repeated index, a search after confirm
        per_round: dict[int, list[int]] = {}
        confirming: set[int] = set()
        for trial in entries.trials:
            round_ = int(trial.get("round", 1))
            per_round.setdefault(round_, []).append(int(trial["index"]))
            if trial.get("confirmation"):
                confirming.add(round_)
            else:
                assert round_ not in confirming, "a search trial after the confirmations began"
        for indices in per_round.values():
            assert len(indices) == len(set(indices)), indices

    @invariant()
    def the_state_is_named_and_its_nodes_are_the_jobs(self) -> None:
        CHECKS["invariants"] += 1
        assert lifecycle.name(self.machine.state) in lifecycle.STATES
        assert set(self.machine.lost) <= set(self.machine.nodes) <= set(NODES)

    @invariant()
    def an_ended_job_wakes_no_more_and_a_live_one_has_a_deadline(self) -> None:
        CHECKS["invariants"] += 1
        if self.machine.terminal:
            assert self.machine.wake_at() is None
        elif isinstance(self.machine.state, lifecycle.Trial | lifecycle.Paused):
            assert self.machine.wake_at() is not None


class EnergyJobUnderFaults(JobUnderFaults):
    """The energy objective: the power cap searched too, by the tuner's sum of terms."""

    SECTION: ClassVar[dict[str, object]] = {"objective": "energy", "power_limits_w": [100, 250]}


for machine, examples in ((JobUnderFaults, EXAMPLES), (EnergyJobUnderFaults, EXAMPLES // 4)):
    machine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
test_job_under_faults = JobUnderFaults.TestCase
test_energy_job_under_faults = EnergyJobUnderFaults.TestCase
