"""Stragglers across a job's nodes: what a verdict names, when it comes and when it goes."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import numpy as np
import pytest

from hyperagent.readings import Kind, Reading
from hyperagent.tuner.stragglers import (
    Cause,
    EvidenceBook,
    JobVerdict,
    RankStep,
    Signal,
    StragglerConfig,
    StragglerDetector,
)

JOB = "slurm-4242-0"


class SyncJob:
    """A synchronous data-parallel job, step by step: each rank waits its idle gap, computes
    (a constant of its own within +-2%, times lognormal jitter), then waits in the allreduce
    until the last rank arrives, plus the transfer. Ranks are numbered node by node."""

    def __init__(
        self,
        nodes: int = 4,
        gpus: int = 8,
        step_s: float = 1.5,
        comm_share: float = 0.2,
        jitter: float = 0.03,
        seed: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.gpus = gpus
        self.ranks = nodes * gpus
        self.compute_s = step_s * (1 - comm_share)
        self.transfer_s = step_s * comm_share
        self.jitter = jitter
        self.static = [self.rng.uniform(0.98, 1.02) for _ in range(self.ranks)]
        self.slow: dict[int, float] = {}
        """rank -> its compute time's factor."""
        self.late: dict[int, float] = {}
        """rank -> seconds its steps start late."""
        self.transfer_extra_s = 0.0
        self.t = 0.0

    def node(self, rank: int) -> str:
        return f"n{rank // self.gpus}"

    def step(self) -> list[RankStep]:
        rng = self.rng
        idle = [
            0.01 * self.compute_s * rng.lognormvariate(0, 0.5) + self.late.get(r, 0.0)
            for r in range(self.ranks)
        ]
        compute = [
            self.compute_s
            * self.static[r]
            * rng.lognormvariate(0, self.jitter)
            * self.slow.get(r, 1)
            for r in range(self.ranks)
        ]
        arrival = [i + c for i, c in zip(idle, compute, strict=True)]
        end = max(arrival) + self.transfer_s * rng.lognormvariate(0, 0.05) + self.transfer_extra_s
        ended = self.t + end
        steps = [
            RankStep(
                r,
                self.node(r),
                r % self.gpus,
                end - idle[r],
                compute[r],
                end - arrival[r],
                samples=32,
                ended=ended,
            )
            for r in range(self.ranks)
        ]
        self.t = ended
        return steps

    def run(
        self,
        detector: StragglerDetector,
        seconds: float,
        every: float = 5.0,
        before: Callable[[float], None] | None = None,
    ) -> list[JobVerdict]:
        """Step for ``seconds`` more, feeding every step; judge every ``every`` seconds
        (``before`` is called first with the time, to feed evidence)."""
        verdicts = []
        until = self.t + seconds
        due = self.t + every
        while self.t < until:
            for step in self.step():
                detector.observe(JOB, step, self.t)
            while self.t >= due:
                if before is not None:
                    before(due)
                verdicts.append(detector.evaluate(JOB, due))
                due += every
        return verdicts


def throttle(node_gpus: int, hot: int | None, seconds: float) -> list[Reading]:
    """A node's clock-event counters: ``hot`` held in thermal slowdown ``seconds`` so far."""
    return [
        Reading(
            "hyperagent_gpu_throttle_seconds_total",
            seconds if gpu == hot else 0.0,
            {"gpu": str(gpu), "uuid": f"GPU-{gpu}", "reason": "hw_thermal_slowdown"},
            Kind.COUNTER,
        )
        for gpu in range(node_gpus)
    ]


def first(verdicts: list[JobVerdict]) -> JobVerdict | None:
    return next((v for v in verdicts if v.stragglers), None)


def test_a_gpu_in_thermal_slowdown_is_named_with_its_node_and_reason_within_a_minute() -> None:
    job = SyncJob(nodes=4)
    detector = StragglerDetector()
    assert not any(v.stragglers for v in job.run(detector, 300))
    hot = 0.0

    def telemetry(now: float) -> None:
        nonlocal hot
        for node in range(4):
            slow = node == 2 and job.slow
            detector.evidence.observe(f"n{node}", throttle(8, 5 if slow else None, hot), now)
        if job.slow:
            hot += 5 * 0.6  # clocks held down 60% of the time

    onset = job.t
    job.slow[2 * 8 + 5] = 1.15
    verdict = first(job.run(detector, 120, before=telemetry))
    assert verdict is not None
    assert verdict.at - onset <= 60
    (straggler,) = verdict.stragglers
    assert (straggler.node, straggler.gpu, straggler.rank) == ("n2", 5, 21)
    assert straggler.cause is Cause.GPU_THROTTLE and straggler.reason == "thermal"
    assert straggler.signal is Signal.COMPUTE
    assert 0.08 <= straggler.slower <= 0.25
    assert abs(straggler.since - onset) <= 30
    assert straggler.waited_s > 0
    assert "rank 21 (GPU 5 of n2)" in verdict.describe() and "thermal" in verdict.describe()
    assert verdict.changed and verdict.nodes == ("n2",)


def test_the_verdict_holds_while_slow_and_clears_after_recovery() -> None:
    job = SyncJob(nodes=2, seed=1)
    detector = StragglerDetector()
    job.run(detector, 300)
    job.slow[3] = 1.2
    detector.evidence.note("n0", Cause.GPU_THROTTLE, "thermal", job.t, gpu=3)
    slow = job.run(
        detector,
        300,
        before=lambda now: detector.evidence.note("n0", Cause.GPU_THROTTLE, "thermal", now, gpu=3),
    )
    came = first(slow)
    assert came is not None
    assert all(v.stragglers for v in slow[slow.index(came) :]), "no flapping while it is slow"
    assert sum(v.changed for v in slow) == 1
    job.slow.clear()
    recovered_at = job.t
    after = job.run(detector, 180)
    gone = next(v for v in after if not v.stragglers)
    assert gone.changed
    assert gone.at - recovered_at <= detector.config.window_s + detector.config.clear_s + 15
    assert not any(v.stragglers for v in after[after.index(gone) :])


def test_normal_jitter_over_hours_gives_no_verdict() -> None:
    job = SyncJob(nodes=8, step_s=1.2, jitter=0.03, seed=2)
    detector = StragglerDetector()
    verdicts = job.run(detector, 2 * 3600)
    assert len(verdicts) > 1000
    assert not [v.describe() for v in verdicts if v.stragglers]
    assert max(abs(v.slower) for v in verdicts if v.slower is not None) < 0.05


def test_a_flapping_rdma_port_names_the_node_and_its_link() -> None:
    job = SyncJob(nodes=4, seed=3)
    detector = StragglerDetector()
    downed = 0
    flapping = False

    def telemetry(now: float) -> None:
        nonlocal downed
        if flapping and int(now) % 30 == 0:
            downed += 1
        for node in range(4):
            detector.evidence.observe(
                f"n{node}",
                [
                    Reading(
                        "hyperagent_rdma_port_link_downed_total",
                        downed if node == 3 else 0,
                        {"device": "mlx5_1", "port": "1"},
                        Kind.COUNTER,
                    ),
                    Reading("hyperagent_rdma_port_state", 4.0, {"device": "mlx5_1", "port": "1"}),
                ],
                now,
            )

    assert not any(v.stragglers for v in job.run(detector, 600, before=telemetry))
    onset = job.t
    flapping = True
    job.transfer_extra_s = 0.3  # every step's collective 20% of a step longer
    verdict = first(job.run(detector, 180, before=telemetry))
    assert verdict is not None and verdict.at - onset <= 90
    (straggler,) = verdict.stragglers
    assert (straggler.node, straggler.link, straggler.rank) == ("n3", "mlx5_1/1", None)
    assert straggler.cause is Cause.RDMA and "flapping" in straggler.reason
    assert straggler.signal is Signal.COMMUNICATION
    assert 0.1 <= straggler.slower <= 0.35
    assert "mlx5_1/1 of n3" in verdict.describe()


def test_a_job_wide_slowdown_without_evidence_that_began_with_it_names_nobody() -> None:
    job = SyncJob(nodes=4, seed=4)
    detector = StragglerDetector()
    job.run(detector, 60)

    # a link counting errors all along, on a node of the job: not what slowed it now
    def always(now: float) -> None:
        detector.evidence.note("n1", Cause.RDMA, "link errors", now, link="mlx5_0/1")

    job.run(detector, 600, before=always)
    job.transfer_extra_s = 0.4  # congestion elsewhere in the fabric
    verdicts = job.run(detector, 300, before=always)
    assert not any(v.stragglers for v in verdicts)
    assert verdicts[-1].slower is not None and verdicts[-1].slower > 0.15


def test_a_node_whose_steps_start_late_with_numa_balancing_on_is_a_host_straggler() -> None:
    job = SyncJob(nodes=4, seed=5)
    detector = StragglerDetector()
    numa = [Reading("hyperagent_host_numa_balancing_mode", 1.0)]
    job.run(detector, 300, before=lambda now: detector.evidence.observe("n1", numa, now))
    for rank in range(8, 16):
        job.late[rank] = 0.25
    verdicts = job.run(detector, 120, before=lambda now: detector.evidence.observe("n1", numa, now))
    verdict = verdicts[-1]
    assert verdict.nodes == ("n1",)
    assert {s.rank for s in verdict.stragglers} == set(range(8, 16))
    assert all(s.cause is Cause.HOST and s.reason == "numa_balancing" for s in verdict.stragglers)
    assert all(s.signal is Signal.LATE_START for s in verdict.stragglers)


def test_late_steps_without_host_evidence_are_still_the_host() -> None:
    job = SyncJob(nodes=2, seed=6)
    detector = StragglerDetector()
    job.run(detector, 300)
    job.late[12] = 0.3
    (straggler,) = job.run(detector, 120)[-1].stragglers
    assert straggler.rank == 12 and straggler.cause is Cause.HOST
    assert straggler.reason == "steps start late"


def test_a_slower_gpu_without_evidence_is_named_with_an_unknown_cause() -> None:
    job = SyncJob(nodes=2, seed=7)
    detector = StragglerDetector()
    job.run(detector, 300)
    job.slow[9] = 1.2
    (straggler,) = job.run(detector, 120)[-1].stragglers
    assert (straggler.rank, straggler.node, straggler.gpu) == (9, "n1", 1)
    assert straggler.cause is Cause.UNKNOWN and straggler.reason == "no evidence"


def test_an_xid_on_the_slow_gpu_names_it() -> None:
    job = SyncJob(nodes=2, seed=8)
    detector = StragglerDetector()
    xids = {"count": 0.0}

    def telemetry(now: float) -> None:
        reading = Reading(
            "hyperagent_gpu_xid_errors_total",
            xids["count"],
            {"gpu": "6", "xid": "63"},
            Kind.COUNTER,
        )
        detector.evidence.observe("n0", [reading], now)

    job.run(detector, 300, before=telemetry)
    job.slow[6] = 1.25
    xids["count"] = 1
    (straggler,) = job.run(detector, 90, before=telemetry)[-1].stragglers
    assert straggler.rank == 6 and straggler.cause is Cause.XID_ECC
    assert straggler.reason == "xid 63"


def test_a_two_rank_job_names_the_slower_rank_only() -> None:
    job = SyncJob(nodes=1, gpus=2, seed=9)
    detector = StragglerDetector()
    assert not any(v.stragglers for v in job.run(detector, 600))
    job.slow[1] = 1.15
    verdict = job.run(detector, 120)[-1]
    assert [s.rank for s in verdict.stragglers] == [1]


def test_a_stall_shorter_than_the_window_is_no_verdict() -> None:
    job = SyncJob(nodes=4, seed=10)
    detector = StragglerDetector()
    job.run(detector, 300)
    for rank in range(16, 24):
        job.late[rank] = 1.0  # the node stalls, every step, for 20 s
    verdicts = job.run(detector, 20)
    job.late.clear()
    verdicts += job.run(detector, 120)
    assert not any(v.stragglers for v in verdicts)


def test_a_rank_that_leaves_takes_its_verdict_with_it() -> None:
    job = SyncJob(nodes=2, seed=11)
    detector = StragglerDetector()
    job.run(detector, 300)
    job.slow[4] = 1.3
    assert [s.rank for s in job.run(detector, 90)[-1].stragglers] == [4]
    detector.leave(JOB, 4)
    verdict = detector.evaluate(JOB, job.t)
    assert not verdict.stragglers and verdict.changed
    detector.forget(JOB)
    assert detector.verdict(JOB) is None and detector.jobs() == []


def test_summaries_of_several_steps_judge_like_single_steps() -> None:
    """An agent may forward each rank's steps of a period summed (``steps``, ``idle_s``,
    ``comm_min_s``), as arrays for a whole batch."""
    rng = np.random.default_rng(12)
    ranks = 64
    detector = StragglerDetector()
    for rank in range(ranks):
        detector.attach(JOB, rank, f"n{rank // 8}", rank % 8)
    step_s, steps = 1.0, 5
    for period in range(200):
        slow = period >= 120
        compute = 0.8 * rng.lognormal(0, 0.03, (steps, ranks)) * rng.uniform(0.98, 1.02, ranks)
        if slow:
            compute[:, 40] *= 1.12
        idle = 0.01 * rng.lognormal(0, 0.5, (steps, ranks))
        arrival = idle + compute
        end = arrival.max(axis=1, keepdims=True) + 0.2 * step_s
        comm = end - arrival
        detector.observe_arrays(
            JOB,
            np.arange(ranks),
            compute.sum(axis=0),
            comm.sum(axis=0),
            idle.sum(axis=0),
            now=5.0 * (period + 1),
            steps=steps,
            comm_min_s=comm.min(axis=0),
        )
        verdict = detector.evaluate(JOB, 5.0 * (period + 1))
        if not slow:
            assert not verdict.stragglers
    assert [s.rank for s in verdict.stragglers] == [40]
    with pytest.raises(ValueError, match="rank 99 was not attached"):
        detector.observe_arrays(JOB, [99], [1.0], [0.1], [0.0], now=1.0)


def test_judging_a_thousand_ranks_is_cheap() -> None:
    ranks = 1024
    detector = StragglerDetector()
    rng = np.random.default_rng(13)
    for rank in range(ranks):
        detector.attach(JOB, rank, f"n{rank // 8}", rank % 8)
    for period in range(40):
        compute = 4.0 * rng.lognormal(0, 0.015, ranks)
        detector.observe_arrays(
            JOB,
            np.arange(ranks),
            compute,
            5 - compute,
            0.05 + 0 * compute,
            now=5.0 * period,
            steps=5,
        )
    began = time.process_time()
    for _ in range(20):
        verdict = detector.evaluate(JOB, 200.0)
    assert (time.process_time() - began) / 20 < 0.05  # about 1 ms on a 2-core VM
    assert not verdict.stragglers
    step = RankStep(3, "n0", 3, 1.0, 0.8, 0.2, ended=1.0)
    began = time.process_time()
    for i in range(10_000):
        detector.observe(JOB, step, 200.0 + i)
    assert (time.process_time() - began) / 10_000 < 1e-4  # a few microseconds


# -- evidence -----------------------------------------------------------------------------


def counter(name: str, value: float, **labels: str) -> Reading:
    return Reading(name, value, labels, Kind.COUNTER)


def test_counters_become_signs_by_their_rate_and_a_reset_is_not_one() -> None:
    book = EvidenceBook(hold_s=60)
    pfc = "hyperagent_rdma_pfc_pause_duration_seconds_total"
    book.observe("n1", [counter(pfc, 100.0, netdev="eth2", direction="tx", priority="3")], 0.0)
    assert book.active("n1", 0.0) == []  # a first reading has no rate
    book.observe("n1", [counter(pfc, 101.0, netdev="eth2", direction="tx", priority="3")], 10.0)
    (sign,) = book.active("n1", 10.0)
    assert (sign.cause, sign.reason, sign.link) == (Cause.RDMA, "pfc pause", "eth2")
    assert sign.value == pytest.approx(0.1) and sign.since == 10.0
    book.observe("n1", [counter(pfc, 5.0, netdev="eth2", direction="tx", priority="3")], 20.0)
    assert book.active("n1", 20.0)[0].seen == 10.0  # the reset (agent restart) is not a sign
    assert book.active("n1", 71.0) == []  # held 60 s after it was last seen


def test_pauses_a_nic_receives_are_not_evidence_against_its_node() -> None:
    book = EvidenceBook()
    frames = "hyperagent_rdma_pfc_pause_frames_total"
    for t, value in ((0.0, 0.0), (10.0, 1e6)):
        book.observe("n1", [counter(frames, value, netdev="eth2", direction="rx")], t)
    assert book.active("n1", 10.0) == []


def test_a_new_xid_series_on_a_known_node_is_a_sign_and_an_old_one_is_not() -> None:
    book = EvidenceBook()
    old = counter("hyperagent_gpu_xid_errors_total", 3.0, gpu="1", xid="13")
    book.observe("n1", [old], 0.0)
    assert book.active("n1", 0.0) == []  # counted before this coordinator knew the node
    new = counter("hyperagent_gpu_xid_errors_total", 1.0, gpu="2", xid="79")
    book.observe("n1", [old, new], 5.0)
    (sign,) = book.active("n1", 5.0)
    assert (sign.cause, sign.reason, sign.gpu) == (Cause.XID_ECC, "xid 79", 2)


def test_gauges_link_state_degraded_rate_and_low_sm_clocks_are_signs() -> None:
    book = EvidenceBook()
    rate = "hyperagent_rdma_port_rate_bytes_per_second"
    port = {"device": "mlx5_0", "port": "1"}
    book.observe("n1", [Reading(rate, 50e9, port)], 0.0)
    book.observe(
        "n1", [Reading(rate, 25e9, port), Reading("hyperagent_rdma_port_state", 1, port)], 5.0
    )
    clocks = [Reading("hyperagent_gpu_sm_clock_hertz", 1.98e9, {"gpu": str(g)}) for g in range(7)]
    clocks.append(Reading("hyperagent_gpu_sm_clock_hertz", 1.2e9, {"gpu": "7"}))
    book.observe("n1", clocks, 5.0)
    reasons = {(s.reason, s.link, s.gpu) for s in book.active("n1", 5.0)}
    assert reasons == {
        ("link degraded", "mlx5_0/1", None),
        ("link down", "mlx5_0/1", None),
        ("sm_clock", None, 7),
    }
    book.forget("n1")
    assert book.active("n1", 5.0) == []


def test_throttle_reasons_that_do_not_slow_a_gpu_are_left_out() -> None:
    book = EvidenceBook()
    name = "hyperagent_gpu_throttle_seconds_total"
    for t, value in ((0.0, 0.0), (10.0, 10.0)):
        book.observe(
            "n1",
            [
                counter(name, value, gpu="0", reason="gpu_idle"),
                counter(name, value, gpu="1", reason="hw_power_brake_slowdown"),
            ],
            t,
        )
    (sign,) = book.active("n1", 10.0)
    assert (sign.gpu, sign.reason) == (1, "power_brake")


def test_the_configuration_is_checked() -> None:
    with pytest.raises(ValueError):
        StragglerConfig(min_samples=2)
    with pytest.raises(ValueError):
        StragglerConfig(quantile=0.9)
    with pytest.raises(ValueError):
        StragglerConfig(clear=0)
    assert math.isclose(StragglerConfig().slower, 0.05)
