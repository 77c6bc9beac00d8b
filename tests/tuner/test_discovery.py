"""The coordinator's picture of a found job: one owner across the cluster, the scheduler's
nodes, and the power caps a job's nodes can apply (pure: sightings in, views out)."""

from __future__ import annotations

from typing import Any

from driver import coordinator_section, view

from hyperagent.tuner.discovery import NodeBounds, Registry, admission, plan_space

ALICE, MALLORY = 1001, 1003


def entry(uid: int, ranks: range, world: int, **said: Any) -> dict[str, Any]:
    """A node's telemetry entry for a job: ``ranks`` attached under ``uid``."""
    return {
        "attached": len(ranks),
        "rank_ids": list(ranks),
        "uid": uid,
        "world_size": world,
        "gpus": list(range(len(ranks))),
        **said,
    }


def test_a_second_user_under_a_jobs_id_is_not_part_of_it() -> None:
    """mallory's ranks on n3 under alice's job id, with a world of 64 and asking not to be
    tuned: the job is alice's two nodes, complete at her world of 16, and not vetoed."""
    registry = Registry()
    registry.observe("n1", 0.0, {"slurm-42-0": entry(ALICE, range(0, 8), 16)})
    registry.observe("n2", 0.0, {"slurm-42-0": entry(ALICE, range(8, 16), 16)})
    registry.observe("n3", 0.0, {"slurm-42-0": entry(MALLORY, range(63, 64), 64, tune=False)})
    seen = registry.view("slurm-42-0", 1.0)
    assert seen.nodes == ("n1", "n2") and seen.foreign == {"n3": MALLORY}
    assert seen.complete and seen.world_size == 16 and seen.tune is None
    assert seen.said("uid") == ALICE and registry.live("slurm-42-0", 1.0)


def test_the_first_user_on_a_node_does_not_own_a_job_another_users_id_names() -> None:
    """mallory says hello under ``u1001-train`` (alice's bare-host job) before alice's ranks
    start: the id names its owner, so mallory's node never counts, even first."""
    registry = Registry()
    registry.observe("n9", 0.0, {"u1001-train": entry(MALLORY, range(0, 1), 1, tune=True)})
    assert not registry.live("u1001-train", 0.5)
    registry.observe("n1", 1.0, {"u1001-train": entry(ALICE, range(0, 8), 8)})
    seen = registry.view("u1001-train", 1.5)
    assert seen.nodes == ("n1",) and seen.foreign == {"n9": MALLORY}


def test_the_schedulers_owner_and_nodes_decide() -> None:
    """The agents' word from Slurm: the job is alice's on n1 and n2; a node outside that list
    (even under alice's uid) is not part of it, and neither is another uid on a listed node."""
    scheduler = {"user": "alice", "uid": ALICE, "nodes": ["n1", "n2"]}
    registry = Registry()
    registry.observe("n2", 0.0, {"slurm-7-0": entry(MALLORY, range(0, 8), 16)})
    registry.observe("n1", 0.1, {"slurm-7-0": entry(ALICE, range(8, 16), 16, scheduler=scheduler)})
    registry.observe("n4", 0.2, {"slurm-7-0": entry(ALICE, range(0, 8), 16)})
    seen = registry.view("slurm-7-0", 1.0)
    assert seen.nodes == ("n1",) and seen.foreign == {"n2": MALLORY, "n4": ALICE}
    assert registry.owners["slurm-7-0"] == ALICE


def test_a_jobs_owner_is_forgotten_with_it() -> None:
    registry = Registry()
    registry.observe("n1", 0.0, {"u5-x": entry(5, range(0, 1), 1)})
    registry.observe("n1", 1.0, {})
    assert "u5-x" not in registry.owners
    registry.observe("n1", 2.0, {"slurm-1-0": entry(MALLORY, range(0, 1), 1)})
    assert registry.owners["slurm-1-0"] == MALLORY


def test_a_foreign_users_tune_request_does_not_force_a_tuning() -> None:
    """tune = "asked": alice's job never asked; mallory's rank under its id asks: not tuned."""
    section = coordinator_section(tune="asked")
    registry = Registry()
    registry.observe("n1", 0.0, {"slurm-9-0": entry(ALICE, range(0, 8), 8)})
    registry.observe("n2", 0.0, {"slurm-9-0": entry(MALLORY, range(0, 1), 8, tune=True)})
    reason = admission(section, registry.view("slurm-9-0", 1.0))
    assert reason is not None and "did not ask" in reason


def test_a_node_that_knows_no_gpu_of_the_job_leaves_the_power_cap_out() -> None:
    """A CPU-only job's node (no GPU of it known there) never gets a cap of its tuning."""
    section = coordinator_section(power_limits_w=[150, 250], search_power_cap=True)
    cfg = section.tuning("j", ("n1", "n2"))
    seen = view("j", ("n1", "n2"), gpus=())
    plan = plan_space(cfg, seen)
    assert plan.space is not None and not plan.space.power_cap_w
    assert any("knows no GPU of this job" in note for note in plan.notes), plan.notes


def test_bounds_that_meet_none_of_the_jobs_caps_leave_the_power_cap_out() -> None:
    """n2's bounds are [300, 250] W (empty), the job's range 150-250 W: no cap at all rather
    than 300 W, above the job's range."""
    section = coordinator_section(power_limits_w=[150, 250], search_power_cap=True)
    cfg = section.tuning("j", ("n1", "n2"))
    bounds = {"n2": NodeBounds(power_cap=True, min_w=300.0, max_w=250.0)}
    plan = plan_space(cfg, view("j", ("n1", "n2"), bounds=bounds))
    assert plan.failure is None and plan.space is not None and not plan.space.power_cap_w
    assert any("not tuned" in note and "n2" in note for note in plan.notes), plan.notes


def test_a_job_waits_for_its_ranks_gpus_to_be_known_before_it_is_planned() -> None:
    """n2's ranks said hello a moment ago and its agent does not know their GPUs yet: the
    job is not complete (its space would leave the power cap out for the whole tuning)
    until the next sighting names them."""
    registry = Registry()
    registry.observe("n1", 0.0, {"j": entry(ALICE, range(0, 8), 16)})
    registry.observe(
        "n2", 0.0, {"j": {**entry(ALICE, range(8, 16), 16), "gpus": [], "gpus_pending": True}}
    )
    waiting = registry.view("j", 0.5)
    assert not waiting.complete and "n2" in waiting.missing and "GPUs" in waiting.missing
    registry.observe("n2", 1.0, {"j": entry(ALICE, range(8, 16), 16)})
    assert registry.view("j", 1.5).complete
