"""What each production fault costs a tuning: the production-shape cluster
(tests/production/scenario.py: real daemons over mosquitto, 8 ranks per node, 10 s and 50 ms
steps, two jobs on disjoint nodes, the drift watch on) run once healthy and once per fault.

    python benchmarks/soak.py [--faults healthy,stall,...] [--bound-s 150] [--json FILE]

For each run, and each fault against the healthy run: the time lost (how much later the last
of the two tunings published its best settings), whether both tunings ended within
``--bound-s``, the re-tunes without drift (rounds begun after the first while nothing changed,
watched for two drift-watch periods after the tunings ended: must be 0) and the trials lost
(trials, or confirmations, that a fault cost: they measured nothing), and, for information, the
trials scored on fewer nodes than the job has (a node excluded mid-trial). Each run stops by
itself; the whole soak takes about a minute per fault when the tunings end.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from production.scenario import (  # noqa: E402
    HANG,
    JOBS,
    NO_DRIFT_WATCH_S,
    REFUSE,
    Scenario,
    scenario,
    until,
)

FAULT_S = 12.0
"""How long a hang, a refusal or a stall lasts."""


def _mid_trial(s: Scenario, job: str = "alpha", index: int = 1) -> None:
    until(lambda: s.in_trial(job, index) or s.tuned(job), 120, f"{job}'s trial {index}")
    time.sleep(0.5)


def nvml_hang(s: Scenario) -> None:
    _mid_trial(s)
    s.inject("n1", HANG)
    time.sleep(FAULT_S)
    s.inject("n1", {})


def nvml_errors(s: Scenario) -> None:
    _mid_trial(s, "beta")
    time.sleep(FAULT_S)
    s.inject("n3", {})


def stall(s: Scenario) -> None:
    _mid_trial(s)
    for node in ("n0", "n1"):
        s.stall(node)
    time.sleep(FAULT_S)
    for node in ("n0", "n1"):
        s.resume(node)


def restart(sig: int) -> Callable[[Scenario], None]:
    def run(s: Scenario) -> None:
        _mid_trial(s)
        s.restart_agent("n2", sig)

    return run


FAULTS: dict[str, tuple[str, dict[str, dict[str, Any]], Callable[[Scenario], None] | None]] = {
    "healthy": ("nothing goes wrong", {}, None),
    "nvml-hang": (
        f"every NVML call of n1 blocks 3 s, for {FAULT_S:.0f} s mid-trial",
        {},
        nvml_hang,
    ),
    "nvml-errors": (
        f"n3 cannot set GPU 3's power limit (beta refuses every cap) for {FAULT_S:.0f} s",
        {"n3": REFUSE},
        nvml_errors,
    ),
    "stall": (f"2 of alpha's 3 nodes stop stepping for {FAULT_S:.0f} s mid-trial", {}, stall),
    "agent-sigkill": (
        "n2's agent killed (SIGKILL) mid-trial, started again",
        {},
        restart(signal.SIGKILL),
    ),
    "agent-sigterm": (
        "n2's agent stopped (SIGTERM) mid-trial, started again",
        {},
        restart(signal.SIGTERM),
    ),
}


def soak(name: str, bound_s: float) -> dict[str, Any]:
    _, faults, act = FAULTS[name]
    with (
        tempfile.TemporaryDirectory(prefix="hyperagent-soak-") as tmp,
        scenario(Path(tmp), faults) as s,
    ):
        if act is not None:
            act(s)
        deadline = s.started_at + bound_s
        while not all(s.tuned(j.id) for j in JOBS) and time.time() < deadline:
            time.sleep(0.5)
        ended = all(s.tuned(j.id) for j in JOBS)
        if ended:
            time.sleep(NO_DRIFT_WATCH_S)
        times = [s.tuning_s(j.id) for j in JOBS]
        return {
            "fault": name,
            "tuning_s": max(t for t in times if t is not None) if all(times) else None,
            "ended": ended,
            "retunes": sum(s.retunes(j.id) for j in JOBS),
            "trials_lost": sum(len(s.lost_trials(j.id)) for j in JOBS),
            "partial": sum(len(s.partial_trials(j.id)) for j in JOBS),
            "trials": {j.id: [t["status"] for t in s.trials(j.id)] for j in JOBS},
        }


def table(results: list[dict[str, Any]]) -> str:
    healthy = next((r["tuning_s"] for r in results if r["fault"] == "healthy"), None)
    lines = [
        f"{'fault':<15} {'tuning s':>9} {'time lost s':>12} {'ended':>6} "
        f"{'re-tunes w/o drift':>19} {'trials lost':>12} {'on fewer nodes':>15}"
    ]
    for r in results:
        took = "-" if r["tuning_s"] is None else f"{r['tuning_s']:.1f}"
        lost = "-"
        if r["tuning_s"] is not None and healthy is not None and r["fault"] != "healthy":
            lost = f"{r['tuning_s'] - healthy:+.1f}"
        lines.append(
            f"{r['fault']:<15} {took:>9} {lost:>12} {'yes' if r['ended'] else 'no':>6} "
            f"{r['retunes']:>19} {r['trials_lost']:>12} {r['partial']:>15}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, in order")
    parser.add_argument("--bound-s", type=float, default=150.0, help="give up on a tuning after")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    names = [n for n in args.faults.split(",") if n]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    results = []
    for name in names:
        print(f"{name}: {FAULTS[name][0]} ...", flush=True)
        results.append(soak(name, args.bound_s))
        print(f"  trials: {results[-1]['trials']}", flush=True)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    idle = [f"{r['fault']}: {job}" for r in results for job, run in r["trials"].items() if not run]
    if idle:
        print(f"FAILED: the work did not happen: no trial ran for {', '.join(idle)}")
        return 1
    healthy_run = all(r["ended"] and r["retunes"] == 0 and r["trials_lost"] == 0 for r in results)
    return 0 if healthy_run else 1


if __name__ == "__main__":
    sys.exit(main())
